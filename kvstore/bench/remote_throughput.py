"""``kvstore bench remote``, part 1: the remote tier's put/get GB/s against raw ``SET`` / ``GET`` of the same values.

For each layout, ``num_chunks`` chunks of random bf16 KV are encoded once into remote values (the disk tier's
frames). Each repeat then times, in this order and through the same client connection:

* ``raw_set``: one pipeline of ``SET`` of those bytes under plain keys (the baseline of ``put_frames``);
* ``put_frames``: ``RemoteTier.put_values``, the writer's send step (one pipeline of ``SET`` of the values);
* ``raw_get``: ``MGET`` of the plain keys (the baseline of ``get_frames``);
* ``get_frames``: ``RemoteTier.fetch``, one round trip plus every value's header and meta-record checks;
* ``put_chunks``: ``RemoteTier.put`` of each chunk's KV tensor, then ``flush``: copy, zstd encode, send;
* ``get_chunks``: ``fetch`` and ``decode_into`` of every chunk: the whole read a retrieve does.

(The raw and frame ops of a direction swap places every other repeat, so neither always runs against the fuller
server.)

``*_frames`` count the values' bytes, ``*_chunks`` the raw KV bytes; ratios are against the raw op of the same
direction, medians over the repeats. The frame ops carry the target (≥ 0.8x); the chunk ops add the codec's cost
on one thread, reported without a target.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.errors import StorageError
from kvstore.keys import PrefixKey, as_token_array, chained_key
from kvstore.layout import KVLayout
from kvstore.misses import MissReason
from kvstore.remote_address import parse_remote_url
from kvstore.tiers.base import ChunkRecord
from kvstore.tiers.remote.link import RemoteLink
from kvstore.tiers.remote.names import RemoteNames
from kvstore.tiers.remote.tier import RemoteTier

__all__ = ["FRAME_TARGET", "ThroughputRow", "run_throughput"]

FRAME_TARGET = 0.8
_TIMEOUT_S = 30.0  # a pipeline of a few hundred MiB on a slow host: the bench measures, it does not fail over


@dataclass(frozen=True, slots=True, kw_only=True)
class ThroughputRow:
    """One op of one layout (see the module docstring)."""

    part: str
    layout: str
    op: str
    chunks: int
    value_mib: float
    gb_per_s: float
    baseline_op: str
    baseline_gb_per_s: float
    ratio: float
    target: float | None
    met: bool | None


def run_throughput(
    url: str, layout_name: str, layout: KVLayout, chunk_size: int, *, num_chunks: int, repeats: int, seed: int
) -> list[ThroughputRow]:
    """Measure the six ops on a remote at ``url`` (a namespace of its own, deleted afterwards)."""
    link = RemoteLink(parse_remote_url(url), timeout_s=_TIMEOUT_S)
    names = RemoteNames.for_layout(f"kvstore-bench-{os.getpid()}", layout, chunk_size)
    tier = RemoteTier(link, names, layout, chunk_size, host_id=seed)
    try:
        records, tensors = _chunks(layout, chunk_size, num_chunks, seed)
        values = [
            (record.key, tier.encode(record, kv.reshape(-1).view(torch.uint8).numpy(), now_ns=time.time_ns()))
            for record, kv in zip(records, tensors, strict=True)
        ]
        keys = [record.key for record in records]
        raw_keys = [f"{names.namespace}:raw:{index}".encode() for index in range(num_chunks)]
        value_bytes = sum(len(value) for _, value in values)
        raw_bytes = sum(kv.numel() * kv.element_size() for kv in tensors)
        times: dict[str, list[float]] = {}

        def timed(op: str, action: Callable[[], object]) -> None:
            started = time.perf_counter()
            action()
            times.setdefault(op, []).append(time.perf_counter() - started)

        puts: list[tuple[str, Callable[[], object]]] = [
            ("raw_set", lambda: _call(link, lambda client: _set_pipeline(client, raw_keys, values))),
            ("put_frames", lambda: _require(tier.put_values(values, raw_bytes=raw_bytes), "put_values")),
        ]
        gets: list[tuple[str, Callable[[], object]]] = [
            ("raw_get", lambda: _call(link, lambda client: _get_all(client, link.is_cluster, raw_keys))),
            ("get_frames", lambda: _require(not any(isinstance(c, MissReason) for c in tier.fetch(keys)), "fetch")),
        ]
        for repeat in range(repeats):
            _delete(link, [names.chunk(key) for key in keys] + raw_keys)
            tier.forget(keys)
            order = 1 if repeat % 2 else -1  # each op goes first in half the repeats
            for op, action in [*puts[::order], *gets[::order]]:
                timed(op, action)
            _delete(link, [names.chunk(key) for key in keys])
            tier.forget(keys)
            timed("put_chunks", lambda: _put_chunks(tier, records, tensors))
            timed("get_chunks", lambda: _get_chunks(tier, keys, tensors))
        _delete(link, [names.chunk(key) for key in keys] + raw_keys)
    finally:
        tier.close()
    rate = {op: (raw_bytes if op.endswith("_chunks") else value_bytes) / statistics.median(t) / 1e9
            for op, t in times.items()}  # fmt: skip
    rows = []
    for op, baseline in (("put_frames", "raw_set"), ("get_frames", "raw_get"), ("put_chunks", "raw_set"),
                         ("get_chunks", "raw_get")):  # fmt: skip
        ratio = rate[op] / rate[baseline]
        frames = op.endswith("_frames")
        rows.append(
            ThroughputRow(
                part="throughput",
                layout=layout_name,
                op=op,
                chunks=num_chunks,
                value_mib=value_bytes / num_chunks / 2**20,
                gb_per_s=rate[op],
                baseline_op=baseline,
                baseline_gb_per_s=rate[baseline],
                ratio=ratio,
                target=FRAME_TARGET if frames else None,
                met=ratio >= FRAME_TARGET if frames else None,
            )
        )
    return rows


def _chunks(layout: KVLayout, chunk_size: int, count: int, seed: int) -> tuple[list[ChunkRecord], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    records, tensors = [], []
    for _ in range(count):
        tensors.append(torch.randn(layout.chunk_shape(chunk_size), generator=generator).to(layout.dtype.torch_dtype))
        tokens = as_token_array(torch.randint(0, 100_000, (chunk_size,), generator=generator).numpy())
        key = chained_key(bytes(layout.namespace), tokens)  # a value must chain to its key (remote_value.py)
        records.append(ChunkRecord(key=key, source_start=0, tokens=tokens))
    return records, tensors


def _put_chunks(tier: RemoteTier, records: list[ChunkRecord], tensors: list[torch.Tensor]) -> None:
    for record, kv in zip(records, tensors, strict=True):
        _require(tier.put(record, kv), "put")
    _require(tier.flush(_TIMEOUT_S * 4), "flush")
    _require(all(tier.knows(record.key) for record in records), "put (the remote refused a chunk)")


def _get_chunks(tier: RemoteTier, keys: list[PrefixKey], tensors: list[torch.Tensor]) -> None:
    out = torch.empty_like(tensors[0])
    for chunk in tier.fetch(keys):
        _require(not isinstance(chunk, MissReason) and tier.decode_into(chunk, out), "fetch and decode")


def _set_pipeline(client: Any, raw_keys: list[bytes], values: list[tuple[PrefixKey, bytes]]) -> bool:
    pipe = client.pipeline(transaction=False)
    for name, (_, value) in zip(raw_keys, values, strict=True):
        pipe.set(name, value)
    pipe.execute()
    return True


def _get_all(client: Any, is_cluster: bool, raw_keys: list[bytes]) -> bool:
    found = client.mget_nonatomic(raw_keys) if is_cluster else client.mget(raw_keys)
    return all(value is not None for value in found)


def _delete(link: RemoteLink, names: list[bytes]) -> None:
    def delete(client: Any) -> bool:
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.delete(name)
        pipe.execute()
        return True

    _call(link, delete)


def _call(link: RemoteLink, operation: Callable[[Any], bool]) -> None:
    _require(link.call(operation, default=False, what="benchmark"), "a raw command")


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise StorageError(f"kvstore bench remote: {what} failed (see the log); the remote is down or full")
