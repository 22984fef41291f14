"""KV events (``kvstore serve --kv-events``): what publishing costs, and whether a consumer holds the exact residency.

Two phases, on real ``kvstore serve`` processes (tiers cpu,disk) and real ZeroMQ sockets:

- **cost**: two servers of the same settings, one publishing events, one not; the events are read by a subscriber
  in this process (a router on the same two cores), then, in a second run, by nobody (the publisher's own cost).
  Rounds alternate between the servers: each round stores ``--docs`` new documents of ``--doc-chunks`` chunks
  (chunks/s: every chunk is a ``BlockStored`` and, once the cpu tier is full, a ``BlockRemoved`` too) and looks
  each up once (lookups/s). The figure is events-on over events-off, per rate, the median of the rounds; target
  >= 0.98 (publishing costs <= 2%). Beside the rates, the CPU time each server process spent on a round (every
  thread's, from ``/proc/PID/task/*/schedstat``, in nanoseconds): what publishing costs a server bound by its
  cores, steadier than rates on a VM whose other tenants come and go; and the publisher thread's own share of it
  (``kvstore_kv_events_cpu_seconds_total`` over the server's CPU in the same round), the direct cost without the
  noise of comparing two processes. ``--warmup-rounds`` come first, unmeasured, so that the publishing server's
  replay ring (``--replay-mib``, its ``--kv-events-replay-mib``) is full: until it is, every batch kept is new
  memory and its pages fault in; a long-running server's full ring recycles the memory of the batches it drops.
  16 MiB (~6 MB of batches a round at this layout) stands for the default 256 MiB reached sooner.
- **publisher**: the publisher's own CPU time per residency change, in this process (no server, no subscriber).
- **residency**: one publishing server; ``--chunks`` chunks stored through a cpu tier of ``--cpu-chunks`` and a disk
  of ``--disk-chunks`` (evictions from both), every third document looked up again (promotions), some evicted by
  key. The subscriber's mirror (gaps filled by replay) is compared with the server's own answer for every key (0
  phantom and 0 missing blocks is the target); then a late joiner rebuilds it from a snapshot and a replay, timed
  (target <= 1 s at 100K chunks; the median of ``--joins``, each in a fresh process), with the chunks' token ids
  and with keys only (``snapshot-keys``); beside it, the time until a snapshot's bytes are in hand, undecoded (what
  the server and the wire take; the rest is the consumer's decoding, which a compiled router does many times faster
  than Python).

The layout is small (one layer, one KV head of 8 dims: 8 KiB a 256-token chunk) so that per-chunk costs -- where
events live -- dominate, not KV bytes. Prints one JSON object per figure with ``--json``.

Usage::

    .venv/bin/python benchmarks/bench_kv_events.py --json
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from kvstore import Client
from kvstore.bench.serve_process import ServeProcess, start_serve_process
from kvstore.keys import PrefixKey, as_token_array, prefix_keys
from kvstore.layout import KVLayout, RopeSpec
from kvstore.server.kv_events.consumer import ResidencyMirror, Subscriber, free_port, join_late, request
from kvstore.server.kv_events.encoding import MEDIUMS
from kvstore.server.kv_events.options import KVEventOptions
from kvstore.server.kv_events.publisher import KEYS_SNAPSHOT_REQUEST, SNAPSHOT_REQUEST, KVEventPublisher
from kvstore.tiers.base import ChunkRecord, TierName

LAYOUT = KVLayout(model_id="bench/kv-events", num_layers=1, num_kv_heads=1, head_dim=8, rope=RopeSpec(theta=1e4))
CHUNK = 256
TARGET_COST_RATIO = 0.98
TARGET_JOIN_S = 1.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--docs", type=int, default=200)
    parser.add_argument("--doc-chunks", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--cpu-chunks", type=int, default=2_000)
    parser.add_argument("--disk-chunks", type=int, default=80_000)
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--skip-residency", action="store_true")
    parser.add_argument("--interval-ms", type=float, help="the cost phase's --kv-events-interval-ms (default: its own)")
    parser.add_argument("--joins", type=int, default=3, help="residency phase: late joins of each kind (median)")
    parser.add_argument("--warmup-rounds", type=int, default=3, help="cost phase: rounds before the measured ones")
    parser.add_argument("--replay-mib", type=int, default=16, help="cost phase: the server's --kv-events-replay-mib")
    parser.add_argument("--join-late", metavar="REPLAY_ENDPOINT", help="(internal) be the late joiner, print JSON")
    parser.add_argument("--keys-only", action="store_true", help="(internal) with --join-late: snapshot-keys")
    args = parser.parse_args()
    if args.join_late:
        return join_late_here(args.join_late, with_tokens=not args.keys_only)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-kv-events-") as scratch:
        root = Path(scratch)
        rows += publisher_rows(args)
        if not args.skip_cost:
            rows += cost_rows(root / "cost-unsubscribed", args, subscribed=False)
            rows += cost_rows(root / "cost-subscribed", args, subscribed=True)
        if not args.skip_residency:
            rows += residency_rows(root / "residency", args)
    for row in rows:
        print(json.dumps(row) if args.json else "  ".join(f"{key}={value}" for key, value in row.items()))
    return 0 if all(row.get("met", True) for row in rows) else 1


@contextmanager
def server(directory: Path, name: str, flags: list[str]) -> Iterator[ServeProcess]:
    directory.mkdir(parents=True, exist_ok=True)
    process = start_serve_process(LAYOUT, CHUNK, directory, ["--data-dir", str(directory / name), *flags], name=name)
    try:
        yield process
    finally:
        process.stop()


def sizes(cpu_chunks: int, disk_chunks: int) -> list[str]:
    chunk_bytes = LAYOUT.chunk_bytes(CHUNK)
    return ["--tiers", "cpu,disk", "--cpu-size", str(cpu_chunks * chunk_bytes), "--disk-size",
            str(disk_chunks * (chunk_bytes + 512))]  # fmt: skip


def document(seed: int, num_chunks: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 2**17, num_chunks * CHUNK, dtype=np.int64)
    kv = rng.standard_normal(LAYOUT.chunk_shape(num_chunks * CHUNK), dtype=np.float32)
    return tokens, kv


def cost_rows(root: Path, args: argparse.Namespace, *, subscribed: bool) -> list[dict[str, object]]:
    """``subscribed``: a subscriber in this process reads every batch (a router on this host, sharing its cores);
    else the events go to a bound socket nobody reads (the publisher's own cost: ZeroMQ drops them unsent)."""
    replay = f"tcp://127.0.0.1:{free_port()}"
    subscriber = Subscriber(ResidencyMirror(), replay, high_water_mark=10_000_000)
    all_rounds = args.warmup_rounds + args.rounds
    flags = sizes(args.docs * args.doc_chunks // 4, 10 * all_rounds * args.docs * args.doc_chunks)
    endpoint = subscriber.endpoint if subscribed else f"tcp://*:{free_port()}"
    events_flags = [*flags, "--kv-events", endpoint, "--kv-events-replay", replay,
                    "--kv-events-replay-mib", str(args.replay_mib)]  # fmt: skip
    if args.interval_ms is not None:
        events_flags += ["--kv-events-interval-ms", str(args.interval_ms)]
    interval_ms = args.interval_ms or 1000 * KVEventOptions(endpoint=endpoint).interval_s
    rates: dict[str, list[tuple[float, float]]] = {"on": [], "off": []}
    cpu_s: dict[str, list[float]] = {"on": [], "off": []}
    publisher_cpu_s: list[float] = []
    try:
        with server(root, "on", events_flags) as on, server(root, "off", flags) as off:
            clients = {"on": Client(on.url, LAYOUT), "off": Client(off.url, LAYOUT)}
            servers = {"on": on, "off": off}
            documents = [document(seed, args.doc_chunks) for seed in range(args.docs)]
            for round_index in range(all_rounds):
                for side in ("on", "off") if round_index % 2 == 0 else ("off", "on"):
                    if round_index < args.warmup_rounds:
                        store_and_look_up(clients[side], documents, salt=round_index)
                        continue
                    before, publisher_before = servers[side].cpu_s(), on.kv_events_cpu_s()
                    rates[side].append(store_and_look_up(clients[side], documents, salt=round_index))
                    if subscribed:
                        subscriber.receive(quiet_s=0.2)  # the round's events reach the mirror before the clock stops
                    else:
                        time.sleep(0.1)  # the publisher's last batch of the round is sent before its CPU is read
                    cpu_s[side].append(servers[side].cpu_s() - before)
                    if side == "on":
                        publisher_cpu_s.append(on.kv_events_cpu_s() - publisher_before)
            for client in clients.values():
                client.close()
            subscriber.receive(quiet_s=1.0)
    finally:
        subscriber.close()
    rows: list[dict[str, object]] = []
    for index, rate in enumerate(("store_chunks_per_s", "lookups_per_s")):
        on_rate = statistics.median(pair[index] for pair in rates["on"])
        off_rate = statistics.median(pair[index] for pair in rates["off"])
        ratio = on_rate / off_rate
        rows.append({"phase": "cost", "subscriber": "this host" if subscribed else "none", "rate": rate,
                     "events_on": round(on_rate, 1), "events_off": round(off_rate, 1), "ratio": round(ratio, 4),
                     "target": TARGET_COST_RATIO, "met": ratio >= TARGET_COST_RATIO,
                     "rounds": args.rounds})  # fmt: skip
    on_cpu, off_cpu = statistics.median(cpu_s["on"]), statistics.median(cpu_s["off"])
    rows.append({"phase": "cost", "subscriber": "this host" if subscribed else "none", "rate": "server_cpu_s_per_round",
                 "events_on": round(on_cpu, 4), "events_off": round(off_cpu, 4),
                 "ratio": round(off_cpu / on_cpu, 4), "target": TARGET_COST_RATIO,
                 "met": off_cpu / on_cpu >= TARGET_COST_RATIO, "rounds": args.rounds,
                 "samples_on": [round(s, 4) for s in cpu_s["on"]],
                 "samples_off": [round(s, 4) for s in cpu_s["off"]]})  # fmt: skip
    shares = [publisher / server for publisher, server in zip(publisher_cpu_s, cpu_s["on"], strict=True)]
    rows.append({"phase": "cost", "subscriber": "this host" if subscribed else "none",
                 "rate": "publisher_share_of_server_cpu", "share": round(statistics.median(shares), 4),
                 "target": round(1 - TARGET_COST_RATIO, 4), "met": statistics.median(shares) <= 1 - TARGET_COST_RATIO,
                 "rounds": args.rounds, "interval_ms": interval_ms, "warmup_rounds": args.warmup_rounds,
                 "replay_mib": args.replay_mib,
                 "samples": [round(share, 4) for share in shares]})  # fmt: skip
    return rows


def store_and_look_up(client: Client, documents: list[tuple[np.ndarray, np.ndarray]], salt: int) -> tuple[float, float]:
    """Store every document under new keys (the first token salted), then look each up: (chunks/s, lookups/s)."""
    import torch

    salted = []
    for tokens, kv in documents:
        tokens = tokens.copy()
        tokens[0] = 2**18 + salt
        salted.append((tokens, torch.from_numpy(kv).to(LAYOUT.dtype.torch_dtype)))
    started = time.perf_counter()
    for tokens, kv in salted:
        client.store(tokens, kv)
    stored_s = time.perf_counter() - started
    started = time.perf_counter()
    for tokens, _ in salted:
        client.release(client.lookup(tokens))
    looked_s = time.perf_counter() - started
    num_chunks = sum(len(tokens) // CHUNK for tokens, _ in salted)
    return num_chunks / stored_s, len(salted) / looked_s


def publisher_rows(args: argparse.Namespace) -> list[dict[str, object]]:
    """The publisher's own CPU: this process feeds it ``--chunks`` stored and as many removed changes at about 3,000
    of each a second (the cost phase's store rate), and its CPU time is compared with the same feed into a plain
    queue nobody reads."""
    records = [
        ChunkRecord(
            key=PrefixKey(bytes(rng.bytes(16))), source_start=0, tokens=rng.integers(0, 2**17, CHUNK, dtype="<u4")
        )
        for rng in [np.random.default_rng(7)]
        for _ in range(1000)
    ]

    def feed(
        stored: Callable[[TierName, ChunkRecord], None], removed: Callable[[TierName, tuple[PrefixKey]], None]
    ) -> float:
        started = time.process_time()
        for index in range(args.chunks):
            record = records[index % len(records)]
            stored(TierName.CPU, record)
            removed(TierName.CPU, (record.key,))
            if index % 30 == 29:
                time.sleep(0.01)
        return time.process_time() - started

    queue: collections.deque[object] = collections.deque()
    baseline_s = feed(lambda tier, record: queue.append((tier, record)), lambda tier, keys: queue.append((tier, keys)))
    publisher = KVEventPublisher(KVEventOptions(endpoint=f"tcp://*:{free_port()}"), lambda: None, CHUNK)
    try:
        started = time.process_time()
        feed(publisher.stored, publisher.removed)
        while publisher.stats().queued:
            time.sleep(0.01)
        publishing_s = time.process_time() - started
    finally:
        publisher.close()
    changes = 2 * args.chunks
    per_change_us = 1e6 * (publishing_s - baseline_s) / changes
    return [{"phase": "publisher", "changes": changes, "cpu_us_per_change": round(per_change_us, 2),
             "cpu_share_at_3000_chunks_per_s": round(2 * 3000 * per_change_us / 1e6, 4)}]  # fmt: skip


def residency_rows(root: Path, args: argparse.Namespace) -> list[dict[str, object]]:
    import torch

    replay = f"tcp://127.0.0.1:{free_port()}"
    subscriber = Subscriber(ResidencyMirror(), replay, high_water_mark=10_000_000)
    flags = [*sizes(args.cpu_chunks, args.disk_chunks), "--kv-events", subscriber.endpoint]
    flags += ["--kv-events-replay", replay]
    doc_chunks = 16
    num_documents = args.chunks // doc_chunks
    keys: list[PrefixKey] = []
    try:
        with server(root, "residency", flags) as process, Client(process.url, LAYOUT) as client:
            started = time.perf_counter()
            for seed in range(num_documents):
                tokens, kv = document(seed, doc_chunks)
                client.store(tokens, torch.from_numpy(kv).to(LAYOUT.dtype.torch_dtype))
                document_keys = prefix_keys(LAYOUT.namespace, as_token_array(tokens), CHUNK)
                keys += document_keys
                if seed % 3 == 0 and seed:
                    older, _ = document(seed // 2, doc_chunks)
                    client.release(client.lookup(older))  # a hit promotes it from the disk into the cpu tier
                if seed % 50 == 0:
                    client.evict(document_keys[:2])
                if seed % 500 == 0:
                    subscriber.receive(quiet_s=0.01, timeout_s=0.5)  # a router reads as it goes
            client.flush()
            store_s = time.perf_counter() - started
            subscriber.receive(quiet_s=2.0)
            truth = {(MEDIUMS[tier], key) for key in keys for tier in client.chunk(key).tiers}
            stats = client.stats()
            joins = {
                kind: [join_late_elsewhere(replay, with_tokens=kind == "with token ids") for _ in range(args.joins)]
                for kind in JOIN_KINDS
            }
    finally:
        subscriber.close()
    mirror = subscriber.mirror.resident
    cpu, disk = stats.tier(TierName.CPU), stats.tier(TierName.DISK)
    assert cpu is not None and disk is not None
    phantom, missing = len(mirror - truth), len(truth - mirror)
    return [
        {"phase": "residency", "chunks_stored": len(keys), "store_s": round(store_s, 1), "resident": len(truth),
         "cpu_evictions": cpu.evictions, "disk_evictions": disk.evictions, "batches": len(subscriber.seqs),
         "replayed_batches": subscriber.num_replayed, "phantom": phantom, "missing": missing,
         "met": phantom == 0 and missing == 0},
        *(late_join_row(kind, samples, truth) for kind, samples in joins.items()),
    ]  # fmt: skip


def late_join_row(
    kind: str, samples: list[tuple[float, float, str]], truth: set[tuple[str, bytes]]
) -> dict[str, object]:
    """The median of a kind's late joins (each in a fresh process), exact only if every one was."""
    seconds = statistics.median(sample[1] for sample in samples)
    exact = all(digest == residency_digest(truth) for _, _, digest in samples)
    return {"phase": "late_join", "snapshot": kind, "resident": len(truth), "snapshot_and_replay_s": seconds,
            "snapshot_received_s": statistics.median(sample[0] for sample in samples), "exact": exact,
            "samples_s": [sample[1] for sample in samples], "target_s": TARGET_JOIN_S,
            "met": exact and seconds <= TARGET_JOIN_S}  # fmt: skip


JOIN_KINDS = ("with token ids", "keys only")


def residency_digest(resident: set[tuple[str, bytes]]) -> str:
    """One hash of a residency, so a joiner in another process can say what it rebuilt in a line."""
    return hashlib.sha256(b"".join(medium.encode() + key for medium, key in sorted(resident))).hexdigest()


def join_late_elsewhere(replay: str, *, with_tokens: bool) -> tuple[float, float, str]:
    """A late joiner in a fresh process (a router that starts now, not this benchmark's heap): the seconds until the
    snapshot's bytes were in hand (a first request, not decoded: the server's and the wire's share), its seconds to
    rebuild the residency (a second request, decoded and applied with the replay), and that residency's digest."""
    command = [sys.executable, __file__, "--join-late", replay, *([] if with_tokens else ["--keys-only"])]
    answer = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    return answer["received_s"], answer["seconds"], answer["digest"]


def join_late_here(replay: str, *, with_tokens: bool) -> int:
    started = time.perf_counter()
    request(replay, SNAPSHOT_REQUEST if with_tokens else KEYS_SNAPSHOT_REQUEST)
    received_s = time.perf_counter() - started
    mirror = ResidencyMirror()
    seconds = join_late(replay, mirror, with_tokens=with_tokens)
    print(json.dumps({"received_s": round(received_s, 3), "seconds": round(seconds, 3),
                      "digest": residency_digest(mirror.resident)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
