"""The chunks a data dir held at open and that nobody has used since: arrays, not an object per chunk.

An object per chunk would make most of the cost of opening a data dir of a million chunks: a million ``IndexEntry``
objects in an ``OrderedDict``, and the garbage collections they set off. ``RecoveredRows`` keeps those chunks in
numpy arrays, one row per chunk, plus a dict from key to row; ``DiskState`` keeps only the chunks used since the
open (written, read) as objects, in its LRU ``OrderedDict``. A recovered chunk that is read moves there.

LRU order is exact: the rows are ordered by last access at open (ties in key order, as the records come), and every
chunk used since the open is more recent than every row still here, so the index's order is "rows in last-access
order, then its ``OrderedDict``" -- the order one ``OrderedDict`` filled in last-access order at open would have.
Victims are taken from the least recently used end (``_head`` skips rows already gone).

Invariants: ``_row_of`` maps exactly the rows still here (``_present``); ``_pins`` holds the pin count of present,
pinned rows only.

Threads: none of its own; its owner (``DiskState``) calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvstore.keys import PrefixKey

__all__ = ["RecoveredChunks", "RecoveredRows"]

_WALK_ROWS = 256  # rows converted to Python ints at a time while walking the LRU order


@dataclass(frozen=True, slots=True, kw_only=True)
class RecoveredChunks:
    """Chunks read from a data dir's meta records at open, one array element per chunk (any order).

    Args:
        keys: each chunk's prefix key.
        num_tokens: tokens in the chunk.
        raw_bytes: uncompressed KV bytes.
        stored_bytes: bytes the chunk occupies in LMDB values.
        num_frames: codec frames.
        frame_bytes: raw bytes per frame.
        last_access_ns: last hit or write, ns since the epoch.
    """

    keys: list[PrefixKey]
    num_tokens: npt.NDArray[np.int64]
    raw_bytes: npt.NDArray[np.int64]
    stored_bytes: npt.NDArray[np.int64]
    num_frames: npt.NDArray[np.int64]
    frame_bytes: npt.NDArray[np.int64]
    last_access_ns: npt.NDArray[np.uint64]

    def __post_init__(self) -> None:
        num_chunks = len(self.keys)
        for name in ("num_tokens", "raw_bytes", "stored_bytes", "num_frames", "frame_bytes", "last_access_ns"):
            assert getattr(self, name).shape == (num_chunks,), f"RecoveredChunks.{name}: one element per key"

    def __len__(self) -> int:
        return len(self.keys)

    @staticmethod
    def concatenate(parts: Sequence[RecoveredChunks]) -> RecoveredChunks:
        """The chunks of ``parts``, one after the other."""

        def joined(name: str) -> npt.NDArray[np.int64]:
            return np.concatenate([getattr(part, name) for part in parts] or [np.zeros(0, dtype=np.int64)])

        return RecoveredChunks(
            keys=[key for part in parts for key in part.keys],
            num_tokens=joined("num_tokens"),
            raw_bytes=joined("raw_bytes"),
            stored_bytes=joined("stored_bytes"),
            num_frames=joined("num_frames"),
            frame_bytes=joined("frame_bytes"),
            last_access_ns=np.concatenate(
                [part.last_access_ns for part in parts] or [np.zeros(0, dtype=np.uint64)]
            ).astype(np.uint64, copy=False),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RecoveredRow:
    """One recovered chunk's sizes (``RecoveredRows.take`` returns it when the chunk leaves)."""

    num_tokens: int
    raw_bytes: int
    stored_bytes: int
    num_frames: int
    frame_bytes: int
    last_access_ns: int
    num_pins: int


class RecoveredRows:
    """Recovered chunks not used since the open, in LRU order (rules in the module docstring). Not thread-safe.

    Args:
        chunks: what the meta records hold.
    """

    def __init__(self, chunks: RecoveredChunks) -> None:
        num_rows = len(chunks)
        self._keys = chunks.keys
        self._row_of = dict(zip(chunks.keys, range(num_rows), strict=True))
        assert len(self._row_of) == num_rows, "RecoveredRows: a key recovered twice (meta keys are unique in LMDB)"
        self._num_tokens = chunks.num_tokens
        self._raw_bytes = chunks.raw_bytes
        self._stored_bytes = chunks.stored_bytes
        self._num_frames = chunks.num_frames
        self._frame_bytes = chunks.frame_bytes
        self._last_access_ns = chunks.last_access_ns
        self._lru_rows = np.argsort(chunks.last_access_ns, kind="stable")
        self._head = 0  # every row of _lru_rows[:_head] is gone
        self._present = np.ones(num_rows, dtype=np.bool_)
        self._pins: dict[int, int] = {}
        self.total_stored_bytes = int(chunks.stored_bytes.sum())
        self.total_raw_bytes = int(chunks.raw_bytes.sum())

    def __len__(self) -> int:
        return len(self._row_of)

    def __contains__(self, key: object) -> bool:
        return key in self._row_of

    def contains_many(self, keys: list[PrefixKey]) -> npt.NDArray[np.bool_]:
        """Which of ``keys`` are here (a content-index rebuild asks for every chunk: no Python loop per key)."""
        return np.fromiter(map(self._row_of.__contains__, keys), dtype=np.bool_, count=len(keys))

    # -- one chunk ---------------------------------------------------------------------------------------------

    def num_tokens(self, key: PrefixKey) -> int | None:
        row = self._row_of.get(key)
        return None if row is None else int(self._num_tokens[row])

    def last_access_ns(self, key: PrefixKey) -> int | None:
        row = self._row_of.get(key)
        return None if row is None else int(self._last_access_ns[row])

    def num_pins(self, key: PrefixKey) -> int:
        row = self._row_of.get(key)
        return 0 if row is None else self._pins.get(row, 0)

    def pin(self, key: PrefixKey) -> tuple[int, int] | None:
        """Add a pin; returns the chunk's pins now and its stored bytes (one call: lookups pin every chunk they
        plan), ``None`` when it is not here."""
        row = self._row_of.get(key)
        if row is None:
            return None
        num_pins = self._pins.get(row, 0) + 1
        self._pins[row] = num_pins
        return num_pins, int(self._stored_bytes[row])

    def unpin(self, key: PrefixKey) -> tuple[int, int] | None:
        """Drop a pin; returns the chunk's pins now and its stored bytes, ``None`` when it is not here or was not
        pinned."""
        row = self._row_of.get(key)
        if row is None or row not in self._pins:
            return None
        num_pins = self._pins[row] - 1
        if num_pins:
            self._pins[row] = num_pins
        else:
            del self._pins[row]
        return num_pins, int(self._stored_bytes[row])

    def take(self, key: PrefixKey) -> RecoveredRow | None:
        """Remove a chunk (used, evicted or dropped) and return its sizes and pins; ``None`` when it is not here."""
        row = self._row_of.pop(key, None)
        if row is None:
            return None
        self._present[row] = False
        stored_bytes = int(self._stored_bytes[row])
        raw_bytes = int(self._raw_bytes[row])
        self.total_stored_bytes -= stored_bytes
        self.total_raw_bytes -= raw_bytes
        return RecoveredRow(
            num_tokens=int(self._num_tokens[row]),
            raw_bytes=raw_bytes,
            stored_bytes=stored_bytes,
            num_frames=int(self._num_frames[row]),
            frame_bytes=int(self._frame_bytes[row]),
            last_access_ns=int(self._last_access_ns[row]),
            num_pins=self._pins.pop(row, 0),
        )

    # -- in LRU order ------------------------------------------------------------------------------------------

    def iter_unpinned(self) -> Iterator[tuple[PrefixKey, int]]:
        """Each unpinned chunk still here, least recently used first, with its stored bytes (eviction candidates).

        Stop iterating before removing anything (collect the victims first, as ``DiskState.take_victims`` does).
        """
        self._skip_gone_head()
        position = self._head
        while position < self._lru_rows.shape[0]:
            rows = self._lru_rows[position : position + _WALK_ROWS]
            position += rows.shape[0]
            rows = rows[self._present[rows]]
            for row, stored_bytes in zip(rows.tolist(), self._stored_bytes[rows].tolist(), strict=True):
                if row not in self._pins:
                    yield self._keys[row], stored_bytes

    def keys(self) -> list[PrefixKey]:
        """The keys still here, least recently used first."""
        self._skip_gone_head()
        rows = self._lru_rows[self._head :]
        keys = self._keys
        return [keys[row] for row in rows[self._present[rows]].tolist()]

    def access_range_ns(self) -> tuple[int, int] | None:
        """Oldest and newest last access of the chunks still here; ``None`` when none is."""
        if not self._row_of:
            return None
        times = self._last_access_ns[self._present]
        return int(times.min()), int(times.max())

    def _skip_gone_head(self) -> None:
        """Move ``_head`` past the rows already gone at the least recently used end (victims usually come from
        there), so walks do not re-read them."""
        lru_rows, present = self._lru_rows, self._present
        while self._head < lru_rows.shape[0]:
            present_rows = present[lru_rows[self._head : self._head + _WALK_ROWS]]
            if present_rows.any():
                self._head += int(np.argmax(present_rows))  # the first row still here
                return
            self._head += present_rows.shape[0]
