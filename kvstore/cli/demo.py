"""``kvstore demo``: the end-to-end walk-through ``make run`` shows until the server exists.

Store three documents' KV, close the store (a restart), reopen it on the same data dir (the content index is rebuilt
from disk), look up a prompt that starts with one of the documents, retrieve it, check it is bit-identical, look up
a prompt with two documents in another order behind a system prompt (blend segments found by content), and
inspect the data dir.
The KV is random (shaped like SmolLM2-135M's): this demonstrates the store, not a model. torch and the store are
imported after the data dir is checked.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from kvstore.cli.quantities import count_text, size_text
from kvstore.config import DEFAULT_DATA_DIR, GIB, StoreConfig
from kvstore.data_dir.server_record import live_server_record
from kvstore.errors import StorageError
from kvstore.server.serve_flags import check_data_dir_path
from kvstore.tiers.names import TierName

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch
    from rich.console import Console

    from kvstore.store import TieredStore

__all__ = ["demo_command"]

_NUM_DOCUMENTS = 3
_DOCUMENT_TOKENS = 1000


def demo_command(
    path: Path = typer.Option(DEFAULT_DATA_DIR, "--data-dir", help="Data dir to use (created if missing)."),
) -> None:
    """Store KV, restart, look up, retrieve and inspect, on an embedded data dir.

    Examples:

        kvstore demo

        kvstore demo --data-dir /tmp/kvstore-demo
    """
    _check_data_dir(path)
    if not _run_demo(path):
        raise typer.Exit(1)


def _check_data_dir(path: Path) -> None:
    """Refuse a data dir that cannot be one or that a server holds, before torch and the store are imported (a
    mistake is refused at once)."""
    check_data_dir_path(path)
    holder = live_server_record(path)
    if holder is not None:
        raise StorageError(
            f"data dir {path} is held by kvstore serve (pid {holder.pid}) at {holder.url}; the demo opens its own "
            "store: give it another --data-dir"
        )


def _run_demo(path: Path) -> bool:
    """Steps 1 (store), 2 (restart) and 6 (inspect) around ``_walk_reopened``; whether the retrieve was
    bit-identical."""
    import numpy as np
    import torch
    from rich.console import Console

    from kvstore.cli.inspect import render_summary
    from kvstore.presets import preset_layout
    from kvstore.store import TieredStore
    from kvstore.store.inspection import summarize_data_dir

    console = Console(soft_wrap=True)
    layout = preset_layout("smollm2-135m")
    tiers = (TierName.GPU, TierName.CPU, TierName.DISK) if torch.cuda.is_available() else (TierName.CPU, TierName.DISK)
    config = StoreConfig(
        tiers=tiers,
        data_dir=path,
        gpu_capacity_bytes=GIB // 4,
        cpu_capacity_bytes=GIB // 4,
        disk_capacity_bytes=2 * GIB,
        enable_blend=True,
    )
    rng = np.random.default_rng(2026)
    documents = [rng.integers(0, 49_152, size=_DOCUMENT_TOKENS) for _ in range(_NUM_DOCUMENTS)]
    kvs = [
        torch.randn(layout.chunk_shape(_DOCUMENT_TOKENS), generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        for i in range(_NUM_DOCUMENTS)
    ]
    console.print(f"[bold]kvstore demo[/bold]: data dir {path}, tiers {','.join(t.value for t in tiers)}")
    console.print(f"layout {layout.describe()}, {layout.bytes_per_token} KV bytes per token")

    started = time.perf_counter()
    with TieredStore(layout, config) as store:
        new = sum(store.store(tokens, kv).num_new_chunks for tokens, kv in zip(documents, kvs, strict=True))
        store.flush()
    console.print(
        f"1. stored {_NUM_DOCUMENTS} documents x {_DOCUMENT_TOKENS} tokens: {count_text(new, 'new chunk')} "
        f"({time.perf_counter() - started:.2f} s, written through to disk)"
    )

    console.print("2. closed the store: everything is on disk; reopening (a restart)")
    with TieredStore(layout, config) as store:
        identical = _walk_reopened(console, store, _Documents(tokens=documents, kvs=kvs), rng)
    console.print("6. kvstore inspect --data-dir", path)
    render_summary(console, summarize_data_dir(path))
    return identical


@dataclass(frozen=True, slots=True, kw_only=True)
class _Documents:
    """The demo's documents: their tokens and the KV stored for each (in the same order)."""

    tokens: list[npt.NDArray[np.int64]]
    kvs: list[torch.Tensor]


def _walk_reopened(console: Console, store: TieredStore, documents: _Documents, rng: np.random.Generator) -> bool:
    """Steps 3 to 5 on the reopened store: a prefix lookup, its retrieve, and a lookup of reordered documents;
    whether the retrieve was bit-identical."""
    import numpy as np
    import torch

    tiers = store.config.tiers
    question = rng.integers(0, 49_152, size=40)
    prompt = np.concatenate([documents.tokens[1], question])
    started = time.perf_counter()
    lookup = store.lookup(prompt)
    lookup_ms = (time.perf_counter() - started) * 1e3
    where = ", ".join(f"{t.value}: {lookup.num_tokens_in(t)}" for t in tiers if lookup.num_tokens_in(t))
    console.print(
        f"3. looked up a {len(prompt)}-token prompt (document 2 + a question): "
        f"{lookup.num_cached_tokens} tokens cached ({where}) in {lookup_ms:.2f} ms"
    )
    started = time.perf_counter()
    result = store.retrieve(lookup)
    retrieve_ms = (time.perf_counter() - started) * 1e3
    loaded = result.num_prefix_tokens
    identical = torch.equal(result.kv[:, :, :loaded], documents.kvs[1][:, :, :loaded])
    kv_bytes = result.kv.numel() * result.kv.element_size()
    console.print(
        f"4. retrieved {loaded} tokens ({size_text(kv_bytes)}) in {retrieve_ms:.1f} ms; "
        f"bit-identical to what was stored: {'yes' if identical else '[red]NO[/red]'}"
    )
    again = store.lookup(prompt)
    console.print(
        f"   promoted on hit: the same lookup now finds {again.num_tokens_in(TierName.CPU)} tokens in the cpu tier"
    )
    store.release(again)
    system_prompt = rng.integers(0, 49_152, size=30)
    reordered = np.concatenate([system_prompt, documents.tokens[2], documents.tokens[0], question])
    with store.session() as session:
        plan = session.lookup(reordered)
        blended = [segment for segment in plan.segments if not segment.exact]
        console.print(
            f"5. a {len(reordered)}-token prompt (system prompt + documents 3 and 1 + question): "
            f"{len(blended)} blend segments cover {sum(s.num_tokens for s in blended)} tokens at new positions; "
            f"{sum(gap.num_tokens for gap in plan.gaps)} tokens to compute"
        )
    return identical
