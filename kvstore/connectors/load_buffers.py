"""Shared-memory KV buffers that loads reuse, instead of one new buffer per load.

A load from a server on the same host is retrieved into a ``Client.buffer``: shared memory the server writes directly. A
new buffer is a new segment: creating and mapping one costs time, and the server's copy into its fresh pages, which it
faults in, costs several times a copy into a buffer used before (measured:
docs/design-notes.md#connectors-load-buffers). So each load takes a buffer from this pool and gives it back once its KV
is in the engine's blocks; the pool keeps them for the next load.

The pool holds at most as many buffers as loads ever ran at once (one or two in practice), each as large as the
largest load it served; a buffer too small for a load is released, not kept. Buffers belong to the client that made
them (the server maps them for that connection): a buffer of a client that is gone (the link reconnected) is
dropped.

Threads: ``take`` and ``give_back`` may be called from any thread.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from kvstore.client import Client
from kvstore.errors import KVStoreError
from kvstore.kv_part import KVPart

__all__ = ["LoadBuffers"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, eq=False)
class _Kept:
    """A buffer and the client whose connection maps it (compared by identity)."""

    client: Client
    buffer: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.buffer.shape[2])


class LoadBuffers:
    """Shared-memory KV buffers ``[num_layers, 2, tokens, num_kv_heads, head_dim]`` kept between loads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[_Kept] = []
        self._in_use: dict[int, _Kept] = {}

    def take(
        self,
        client: Client,
        num_tokens: int,
        *,
        create: bool = True,
        exact: bool = False,
        part: KVPart | None = None,
    ) -> torch.Tensor | None:
        """A buffer of ``client``'s with room for ``num_tokens`` (more, when a kept one is larger); ``None`` when the
        server is not on this host (the retrieve then brings the KV in its reply).

        With ``create=False`` only a kept buffer is taken and nothing else happens (``None`` when none fits): no
        request reaches the server, so an engine thread may call it whatever state the store is in.

        With ``exact=True`` the tensor handed out has exactly ``num_tokens`` (a save's staging: gather and
        ``Client.store`` take the KV of exactly its tokens): a kept buffer with room is reinterpreted over its first
        bytes as a contiguous ``[L, 2, num_tokens, H, D]`` (a slice of its token axis would not be contiguous), so one
        buffer as large as the longest save serves every shorter one without a new segment and its first touch.

        With ``part`` a new buffer is shaped by that part (a tensor- or pipeline-parallel rank's); a pool serves one
        rank, so its kept buffers all have that shape.

        Raises:
            KVStoreError: the server refused to map a new buffer, or did not answer.
        """

        def fits(kept: _Kept) -> bool:
            return kept.num_tokens >= num_tokens

        def handed_out(buffer: torch.Tensor) -> torch.Tensor:
            return _first_tokens(buffer, num_tokens) if exact else buffer

        chosen: _Kept | None = None
        if not create:
            with self._lock:
                fitting = [kept for kept in self._free if kept.client is client and fits(kept)]
                if not fitting:
                    return None
                chosen = min(fitting, key=lambda kept: kept.num_tokens)
                self._free.remove(chosen)
                self._in_use[_key(chosen.buffer)] = chosen
            return handed_out(chosen.buffer)
        unfit: list[_Kept] = []
        with self._lock:
            for kept in sorted(self._free, key=lambda kept: kept.num_tokens):
                if kept.client is not client:
                    self._free.remove(kept)  # its connection is gone: the server no longer maps it
                elif chosen is None and fits(kept):
                    chosen = kept
                elif chosen is None:
                    unfit.append(kept)  # too small: released, not kept
            for kept in unfit:
                self._free.remove(kept)
            if chosen is not None:
                self._free.remove(chosen)
                self._in_use[_key(chosen.buffer)] = chosen
        for kept in unfit:
            _release(kept)
        if chosen is not None:
            return handed_out(chosen.buffer)
        if not client.shares_memory:
            return None
        buffer = client.buffer(num_tokens, part=part)  # a server that does not answer is an outage for the link
        with self._lock:
            self._in_use[_key(buffer)] = _Kept(client, buffer)
        return buffer

    def give_back(self, buffer: torch.Tensor | None) -> None:
        """Keep a buffer from ``take`` for the next load (anything else, or ``None``, is ignored)."""
        if buffer is None:
            return
        with self._lock:
            kept = self._in_use.pop(_key(buffer), None)
            if kept is not None:
                self._free.append(kept)

    def holds(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer`` is one of the pool's (free or in use)."""
        key = _key(buffer)
        with self._lock:
            return key in self._in_use or any(_key(kept.buffer) == key for kept in self._free)

    @property
    def num_kept(self) -> int:
        """Buffers held, free or in use."""
        with self._lock:
            return len(self._free) + len(self._in_use)


def _first_tokens(buffer: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``buffer``'s first bytes as a contiguous ``[L, 2, num_tokens, H, D]`` (same storage: the server's region)."""
    layers, planes, _, heads, head_dim = buffer.shape
    shape = (layers, planes, num_tokens, heads, head_dim)
    return buffer.view(-1)[: layers * planes * num_tokens * heads * head_dim].view(shape)


def _key(buffer: torch.Tensor) -> int:
    """A buffer and every view of it share this (the address of their storage)."""
    return buffer.untyped_storage().data_ptr()


def _release(kept: _Kept) -> None:
    try:
        kept.client.release_buffer(kept.buffer)
    except KVStoreError as exc:  # the server is gone: it no longer maps the segment anyway
        logger.debug("releasing a load buffer: %s", exc)
