"""``PromptSaves``: a worker's saves, from the step that completes a prompt's prefill to the store (and, for a model
with sliding-window layers whose prefill runs over several steps, from the steps after which vLLM would free a block
the prompt's save still needs: the scheduler side decides, ``SaveSpec``).

Leaving each attention layer (``layer_computed``) counts that layer as computed for every save of the step; after
the forward pass (``finish_step``) the KV of the chunks the store lacks is gathered out of the blocks of every layer
at once into a staging tensor (``PagedChunk.gather_all``; with several KV cache groups each layer from its own
group's blocks, ``GroupCopies``), which goes to the store on the save thread. A save that fails is logged and dropped
(a later prompt misses, nothing else).

Where the gather runs. On a CUDA cache it is launched on the engine's stream within the step (the host only
launches it). On a CPU cache it is the engine thread's own work, a strided copy of the prompt's KV (about 15 ms
a 1,000-token SmolLM2 prompt alone, 30 ms or more inside a busy engine, where K's blocks are stored transposed), and
the step's first token waited for it: so it runs on a gather thread, after the step has answered, and the next step
waits for it before its forward (``new_step``, called when vLLM binds that step's metadata). The blocks may belong to
another request in the next step (a finished request's are freed when its step ends), but nothing writes them before
that forward: vLLM never waits to free them, and a miss's first token no longer pays for its save.

Staging never asks the store anything on the engine's thread: on the cpu it takes a kept shared-memory buffer the
server reads directly (a buffer taken with no request), else plain memory, after which the save thread maps a
shared buffer of that size for the next saves. A prefill engine (``kv_producer``) waits for its saves within the
step, so its answer means the prompt is in the store.

Threads: ``layer_computed``, ``finish_step`` and ``new_step`` run on vLLM's model-runner thread; a CPU cache's
gathers on the one gather thread; ``_store`` on the one save thread, with its own ``StoreLink``. The pending saves
and the gathers' futures are the engine thread's alone; the buffers are a ``LoadBuffers`` (locked inside), the
counters a ``WorkerStats``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.client import Client
from kvstore.connectors.group_copies import BoundCopies, GroupCopies
from kvstore.connectors.load_buffers import LoadBuffers
from kvstore.connectors.paged import PagedLayers
from kvstore.connectors.store_link import StoreLink
from kvstore.connectors.vllm.metadata import SaveSpec
from kvstore.connectors.vllm.parallel import RankPart
from kvstore.connectors.vllm.worker_stats import WorkerStats

__all__ = ["PromptSaves"]

logger = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class _PendingSave:
    spec: SaveSpec
    staging: torch.Tensor
    copy: BoundCopies  # the staging bound to the request's blocks (of every group), gathered once every layer is
    # computed
    num_layers_computed: int = 0


class PromptSaves:
    """One worker's saves (the module docstring).

    Args:
        link: the save thread's link to the store.
        layers: the engine's registered layers (this rank's part).
        copies: those layers by KV cache group (each copied through its own group's blocks).
        rank: this worker's part of every chunk.
        stats: the worker's counters.
        wait_for_saves: finish each step only once its saves are in the store.
    """

    def __init__(
        self,
        link: StoreLink,
        layers: PagedLayers,
        copies: GroupCopies,
        rank: RankPart,
        stats: WorkerStats,
        *,
        wait_for_saves: bool,
    ) -> None:
        self._link = link
        self._layers = layers
        self._copies = copies
        self._rank = rank
        self._stats = stats
        self._wait_for_saves = wait_for_saves
        self._device = layers[0].cache.device
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvstore-save")
        # a CPU cache's gathers leave the step's path, except a prefill engine's (its step ends with its saves stored)
        self._gather_pool = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvstore-gather")
            if self._device.type == "cpu" and not wait_for_saves
            else None
        )
        self._gathers: list[concurrent.futures.Future[None]] = []  # the last step's, waited for before the next forward
        self._buffers = LoadBuffers()  # taken on the engine thread without a request, kept by the save thread
        self._pending: list[_PendingSave] = []
        self._futures: list[concurrent.futures.Future[None]] = []

    def new_step(self) -> None:
        """Before a step's forward: the last step's gathers are done (its blocks may be another request's in this
        step), and its pending saves forgotten (a save is gathered after its step or dropped)."""
        if self._gathers:
            concurrent.futures.wait(self._gathers)  # _gather_then_store never raises
            self._gathers = []
        self._pending = []

    def layer_computed(self, layer: int, specs: Sequence[SaveSpec]) -> None:
        """The forward left layer ``layer`` (the first one stages the step's ``specs``)."""
        if layer == 0:
            self._pending = [self._new_save(spec) for spec in specs]
        for save in self._pending:
            if save.num_layers_computed == layer:  # else a layer was skipped: the save is dropped
                save.num_layers_computed += 1

    def finish_step(self) -> None:
        """After the forward: gather every complete save and send it on the save thread."""
        for save in self._pending:
            if save.num_layers_computed != len(self._layers):
                logger.warning(
                    "request %s: only %d layers were saved; not stored", save.spec.request_id, save.num_layers_computed
                )
            elif self._gather_pool is not None:
                self._gathers.append(self._gather_pool.submit(self._gather_then_store, save))
            else:
                save.copy.gather_all()
                self._futures.append(self._pool.submit(self._store, save))
        self._pending = []
        if self._wait_for_saves:  # _store never raises, and its link gives up after the transfer timeout
            concurrent.futures.wait(self._futures)
        self._futures = [future for future in self._futures if not future.done()]

    def close(self) -> None:
        """Finish the gathers and saves in flight (the caller closes the link)."""
        if self._gather_pool is not None:
            self._gather_pool.shutdown(wait=True)
        self._pool.shutdown(wait=True)

    def _new_save(self, spec: SaveSpec) -> _PendingSave:
        """Staging for a save: on the cpu, a kept shared-memory buffer the server reads directly (as a contiguous
        view of exactly the save's tokens: gather and store take exactly them). On the engine thread, so it never
        asks the server anything: without a kept buffer large enough it stages in plain memory, and the save thread
        keeps a shared one of that size for the next saves."""
        num_tokens = spec.end - spec.start
        staging = None
        client = self._link.current_client() if self._device.type == "cpu" else None
        if client is not None:
            staging = self._buffers.take(client, num_tokens, create=False, exact=True, part=self._rank.part)
        if staging is None:
            shape = self._rank.shape
            staging = torch.empty(shape.chunk_shape(num_tokens), dtype=shape.dtype.torch_dtype, device=self._device)
        copy = self._copies.bind(spec.group_block_ids, staging, load=False)
        return _PendingSave(spec=spec, staging=staging, copy=copy)

    def _gather_then_store(self, save: _PendingSave) -> None:
        """On the gather thread: copy the save out of its blocks, then hand it to the save thread; a failure is
        logged, never raised."""
        try:
            with torch.inference_mode():  # as vLLM's step ran: its staging was made there, an inference tensor
                save.copy.gather_all()
        except Exception:  # the gather thread's boundary: a lost save is a later miss, never a failed step
            logger.exception("request %s: gathering its prompt's KV failed; not stored", save.spec.request_id)
            self._buffers.give_back(save.staging)
            return
        self._pool.submit(self._store, save)

    def _store(self, save: _PendingSave) -> None:
        """Send a gathered prompt to the store (on the save thread); a failure is logged, never raised."""
        spec = save.spec
        part = self._rank.part
        started = time.perf_counter()
        try:
            stored = self._link.call(
                "save", lambda client: client.store(spec.token_ids, save.staging, start=spec.start, part=part)
            )
        except Exception:  # the save thread's boundary: a lost save is a later miss, never a failed step
            logger.exception("request %s: storing its prompt failed", spec.request_id)
            stored = None
        finally:
            self._buffers.give_back(save.staging)  # ignored unless it is a kept buffer
        if stored is None:
            return
        num_tokens = spec.end - spec.start
        if self._device.type == "cpu" and not self._buffers.holds(save.staging):
            self._keep_buffer(num_tokens)
        leads = self._rank.leads  # requests and tokens once per engine; bytes (this rank's part) on every rank
        self._stats.record(
            saves=int(leads),
            saved_tokens=num_tokens if leads else 0,
            saved_bytes=self._rank.shape.chunk_bytes(num_tokens),
            save_seconds=time.perf_counter() - started if leads else 0.0,
        )

    def _keep_buffer(self, num_tokens: int) -> None:
        """On the save thread: map a shared buffer of ``num_tokens`` for the next save of that size to stage in."""

        def keep(client: Client) -> None:
            self._buffers.give_back(self._buffers.take(client, num_tokens, exact=True, part=self._rank.part))

        self._link.call("buffer", keep)
