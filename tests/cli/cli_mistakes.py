"""Realistic command-line mistakes a newcomer makes (issue 45, item 9), each with the one line that must refuse it.

Shared by ``tests/cli/test_refusals.py`` (each is refused in one line, with a non-zero exit, without importing torch,
numba or LMDB) and ``benchmarks/cli_refusal_times.py`` (how long each takes against ``kvstore --version``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["BLOCKED_MODULES", "Mistake", "bench_mistakes", "cli_mistakes", "refusal_command"]

BLOCKED_MODULES = ("torch", "numba", "lmdb")
"""What a refusal must not import: together they are most of the 2.5 s a command took before checking anything."""

_BLOCKING_MAIN = f"""
import sys

class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED_MODULES!r}:
            raise ImportError(f"{{name}} imported before the arguments were refused (blocked by the test)")
        return None

sys.meta_path.insert(0, _Blocker())
from kvstore.cli.main import main
main(sys.argv[1:])
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class Mistake:
    """One mistaken command line and how it must be refused.

    Args:
        name: what the user got wrong.
        argv: the arguments after ``kvstore``.
        fragment: a piece of the one line on stderr.
        exit_code: 1 for a refused value, 2 for a malformed flag (click's).
        env: variables added to the environment.
    """

    name: str
    argv: tuple[str, ...]
    fragment: str
    exit_code: int = 1
    env: Mapping[str, str] = field(default_factory=dict)


def refusal_command(argv: tuple[str, ...], *, block_heavy_imports: bool) -> list[str]:
    """The child's command line: ``kvstore ARGV``, with a meta-path blocker of ``BLOCKED_MODULES`` or without."""
    if block_heavy_imports:
        return [sys.executable, "-c", _BLOCKING_MAIN, *argv]
    return [sys.executable, "-m", "kvstore.cli.main", *argv]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def cli_mistakes(scratch: Path) -> list[Mistake]:
    """The mistakes, with the files they need made under ``scratch`` (run the commands with ``cwd=scratch``).

    A held data dir names this process in its ``serve.json`` (alive while the mistakes run); a used-but-never-opened
    one is what a server leaves when no client named a layout.
    """
    a_file = scratch / "notes.txt"
    a_file.write_text("not a data dir")
    held = scratch / "held"
    held.mkdir()
    (held / "serve.json").write_text(
        json.dumps({"pid": os.getpid(), "url": "tcp://127.0.0.1:5999", "metrics_url": "http://127.0.0.1:6000/metrics"})
    )
    unopened = scratch / "unopened"
    unopened.mkdir()
    (unopened / "LOCK").write_text("")
    nothing = f"tcp://127.0.0.1:{_free_port()}"
    data = ("--data-dir", str(scratch / "data"))
    return [
        Mistake(name="serve: port out of range", argv=("serve", "--port", "99999"), fragment="is not a TCP port"),
        Mistake(name="serve: not a number", argv=("serve", "--port", "many"), fragment="--port", exit_code=2),
        Mistake(name="serve: metrics port negative", argv=("serve", "--metrics-port", "-1"), fragment="TCP port"),
        Mistake(name="serve: size typo", argv=("serve", "--cpu-size", "12XB"), fragment="'12XB' is not a size"),
        Mistake(name="serve: tier too small", argv=("serve", "--cpu-size", "1KiB"), fragment="chunk of any model"),
        Mistake(name="serve: more RAM than there is", argv=("serve", "--cpu-size", "1PiB"), fragment="does not fit"),
        Mistake(
            name="serve: more disk than there is", argv=("serve", *data, "--disk-size", "1EiB"), fragment="does not fit"
        ),
        Mistake(name="serve: unknown tier", argv=("serve", "--tiers", "cpu,ssd"), fragment="each tier must be one"),
        Mistake(name="serve: tiers out of order", argv=("serve", "--tiers", "disk,cpu"), fragment="out of order"),
        Mistake(name="serve: unknown layout", argv=("serve", "--layout", "llama-70b"), fragment="neither a preset"),
        Mistake(
            name="serve: data dir is a file", argv=("serve", "--data-dir", str(a_file)), fragment="not a directory"
        ),
        Mistake(name="serve: unusable data dir", argv=("serve", "--data-dir", "/proc/kv"), fragment="cannot create"),
        Mistake(name="serve: data dir held", argv=("serve", "--data-dir", str(held)), fragment="held by kvstore serve"),
        Mistake(
            name="serve: dedup without blend",
            argv=("serve", *data, "--enable-dedup-content"),
            fragment="needs enable_blend",
        ),
        Mistake(
            name="serve: remote url, no remote tier",
            argv=("serve", *data, "--remote-url", "valkey://c:6379"),
            fragment="have no remote",
        ),
        Mistake(
            name="serve: remote tier, no url",
            argv=("serve", *data, "--tiers", "cpu,disk,remote"),
            fragment="needs remote_url",
        ),
        Mistake(
            name="serve: event option without events",
            argv=("serve", *data, "--kv-events-topic", "t"),
            fragment="need --kv-events",
        ),
        Mistake(
            name="serve: events endpoint without scheme",
            argv=("serve", *data, "--kv-events", "router:5557"),
            fragment="--kv-events:",
        ),
        Mistake(name="serve: no workers", argv=("serve", *data, "--workers", "0"), fragment="between 1 and 64"),
        Mistake(
            name="serve: owner already gone",
            argv=("serve", *data, "--exit-with-pid", str(_dead_pid())),
            fragment="no such process",
        ),
        Mistake(
            name="serve: config file missing",
            argv=("serve", "--config", "kvstore.tml"),
            fragment="cannot read --config",
        ),
        Mistake(
            name="serve: variable typo",
            argv=("serve", *data),
            fragment="unknown variable KVSTORE_CPU_SZE",
            env={"KVSTORE_CPU_SZE": "8GiB"},
        ),
        Mistake(
            name="inspect: no such data dir",
            argv=("inspect", "--data-dir", str(scratch / "nowhere")),
            fragment="does not exist",
        ),
        Mistake(
            name="inspect: a server's dir, never opened",
            argv=("inspect", "--data-dir", str(unopened)),
            fragment="holds no KV yet",
        ),
        Mistake(name="inspect: nothing listens", argv=("inspect", "--url", nothing), fragment="nothing listens there"),
        Mistake(
            name="inspect: unknown server",
            argv=("inspect", "--url", "tcp://kvstore-server.invalid:5555"),
            fragment="unknown host 'kvstore-server.invalid'",
        ),
        Mistake(name="inspect: no documents asked", argv=("inspect", "--top", "0"), fragment="--top", exit_code=2),
        Mistake(
            name="inspect: not a server URL",
            argv=("inspect", "--url", "http://127.0.0.1:5555"),
            fragment="must look like",
        ),
        Mistake(
            name="inspect: url and data dir",
            argv=("inspect", "--url", nothing, "--data-dir", "d"),
            fragment="give one of them",
        ),
        Mistake(name="evict: nothing to evict", argv=("evict",), fragment="exactly one of"),
        Mistake(name="evict: size typo", argv=("evict", "--bytes", "lots"), fragment="is not a size"),
        Mistake(
            name="evict: tier offline",
            argv=("evict", "--all", "--yes", "--tier", "cpu"),
            fragment="--tier picks a tier",
        ),
        Mistake(
            name="evict: no such data dir",
            argv=("evict", "--data-dir", str(scratch / "nowhere"), "--all", "--yes"),
            fragment="not a kvstore data dir",
        ),
        Mistake(
            name="evict: nothing listens",
            argv=("evict", "--url", nothing, "--all", "--yes"),
            fragment="nothing listens there",
        ),
        Mistake(
            name="evict: held data dir",
            argv=("evict", "--data-dir", str(held), "--all", "--yes"),
            fragment="kvstore evict --url tcp://127.0.0.1:5999",
        ),
        Mistake(name="demo: data dir is a file", argv=("demo", "--data-dir", str(a_file)), fragment="not a directory"),
        *bench_mistakes(),
    ]


def bench_mistakes() -> list[Mistake]:
    """Mistakes of every ``kvstore bench`` command: each option dataclass checks itself before the benchmark (torch,
    numba, LMDB, a model) is imported."""

    def bench(name: str, command: str, fragment: str) -> Mistake:
        argv = tuple(command.split())
        return Mistake(name=f"bench {argv[0]}: {name}", argv=("bench", *argv), fragment=fragment)

    return [
        bench("unknown tier", "tiers --tiers cpu,ssd", "each tier must be one"),
        bench("unknown layout", "tiers --layouts llama-70b", "unknown layout preset 'llama-70b'"),
        bench("size typo", "tiers --cpu-size 12XB", "'12XB' is not a size"),
        bench("no repeats", "tiers --repeats 0", "num_repeats=0 must be positive"),
        bench("no chunks", "index --chunks 0", "--chunks needs positive chunk counts"),
        bench("count with a suffix", "index --chunks 1M", "give comma-separated chunk counts"),
        bench("negative chunks", "rebuild --chunks -1", "--chunks -1: give a positive chunk count"),
        bench("head too wide", "rebuild --head-dim 1024", "--head-dim 1024 must lie in [1, 256]"),
        bench("ratio above 1", "multi-doc-qa --recompute-ratio 1.5", "recompute_ratio=1.5"),
        bench(
            "more documents a query than stored",
            "multi-doc-qa --docs-per-query 9",
            "--docs-per-query 9 must be between 1 and --num-documents 8",
        ),
        bench("model and random model", "multi-doc-qa --model m --random-init tiny-llama", "exclude each other"),
        bench("unknown random model", "multi-doc-qa --random-init llama-70b", "unknown random-init"),
        bench("unknown selection", "multi-doc-qa --selection magic", "selection='magic' is not one"),
        bench("no documents", "shuffle --num-documents 0", "num-documents=0 must be at least 1"),
        bench("unknown tier", "shuffle --tiers ssd", "each tier must be one"),
        bench("no lookups", "server --lookups 0", "num_lookups=0 must be positive"),
        bench("unknown layout", "server --bulk-layout llama-70b", "unknown layout preset"),
        bench(
            "fleet on an existing Valkey",
            "remote --parts fleet --remote-url valkey://c:6379",
            "run it without --remote-url",
        ),
        bench("one host", "remote --hosts 1", "--hosts needs 2 or more"),
        bench("unknown layout", "remote --layouts gpt-9", "unknown layout preset 'gpt-9'"),
        bench("negative prompt", "vllm --prompt-tokens -3", "--prompt-tokens -3"),
        bench("unknown KV dtype", "vllm --kv-cache-dtype fp4", "--kv-cache-dtype fp4"),
        bench(
            "parallel blend",
            "vllm --blend --tensor-parallel-size 2",
            "--tensor-parallel-size 2 is for the default mode",
        ),
        bench("blend ratio above 1", "vllm --blend --ratio 1.5", "recompute_ratio=1.5"),
        bench("split and serve", "vllm --prefill-decode --serve", "--prefill-decode runs its own sessions"),
        bench(
            "blend, more documents a query than stored",
            "vllm --blend --docs-per-query 9",
            "--docs-per-query 9 must be between 1 and --documents 5",
        ),
        bench("unknown corpus", "vllm --serve --corpus poems", "--corpus 'poems'"),
        bench("nothing in flight", "vllm --serve --max-inflight 0", "--max-inflight 0"),
        bench("chat outside serve", "vllm --blend --chat", "--chat: for --serve only"),
        bench("interleaved, many in flight", "vllm --serve --interleaved --max-inflight 4", "--interleaved sends one"),
        bench("unknown deployment", "vllm --serve --deployments vllm,lmcache", "--deployments 'vllm,lmcache'"),
        bench("interleaved beside a cold vLLM", "vllm --serve --interleaved --deployments vllm_cold,kvstore_blend",
              "drop vllm_cold"),
        bench("unknown cut rule", "vllm --serve --chunking rolling", "chunking='rolling' must be one of"),
        Mistake(
            name="bench vllm: empty separator",
            argv=("bench", "vllm", "--serve", "--separator", ""),
            fragment="--separator ''",
        ),
    ]
