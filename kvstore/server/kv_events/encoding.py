"""vLLM's KV event structs as msgpack bytes, without vLLM or msgspec.

vLLM publishes ``KVEventBatch`` (``vllm/distributed/kv_events.py``): a msgspec struct encoded as an array
``[ts, events]`` (``array_like``, ``data_parallel_rank`` omitted when unset), whose events are tagged structs
encoded as maps with a ``"type"`` key naming the class (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``).
A consumer decodes these bytes with vLLM's own ``msgspec.msgpack.Decoder(KVEventBatch)``; tests do exactly that.

What kvstore puts in them:

- ``block_hashes``: one 16-byte chunk key per event (``kvstore.keys``: ``key_i = xxh3_128(key_{i-1} || tokens of
  chunk i as little-endian uint32)``, ``key_{-1}`` the layout's namespace), as msgpack ``bin`` (vLLM's
  ``ExternalBlockHash`` is ``bytes | int``);
- ``parent_block_hash``: the previous chunk's key, ``None`` for a sequence's first chunk;
- ``token_ids``: the chunk's tokens; ``block_size``: the store's chunk size, the longest a chunk may be (a last
  chunk, one a separator cuts, and under ``--chunking content`` any chunk may be shorter: ``token_ids`` says);
- ``medium``: the tier (``MEDIUMS``).

Token ids are the bulk of a stored event (256 of them a chunk by default), so they are encoded with numpy as
msgpack ``uint 32`` items (``0xce`` and 4 big-endian bytes): valid msgpack that every decoder reads as ints. Stored
events of one block shape are the rows of one numpy array, every field written for all rows at once: a publisher
runs beside the store on its cores, and a Python step per event or per token would be most of its cost.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import cast

import msgpack
import numpy as np

from kvstore.keys import PrefixKey
from kvstore.tiers.base import ChunkRecord, ContentRecords, TierName

__all__ = [
    "MEDIUMS",
    "Change",
    "EncodedEvents",
    "all_blocks_cleared",
    "batch",
    "block_removed",
    "blocks_resident",
    "blocks_stored",
    "blocks_stored_batch",
    "encode_changes",
]

MEDIUMS = {TierName.GPU: "GPU", TierName.CPU: "CPU", TierName.DISK: "STORAGE", TierName.REMOTE: "REMOTE"}
"""``medium`` per tier: vLLM's own names for the gpu, cpu and disk levels (``MEDIUM_GPU``, ``MEDIUM_CPU``,
``MEDIUM_STORAGE``), and ``REMOTE`` for the tier a fleet shares."""

_ROWS_PER_PASS = 128
"""Events built per numpy pass: ~180 KB of rows at 256 tokens, reused memory (measured: a 1,000-row pass, 1.4 MB
of fresh pages, costs 3x as much a row on the dev VM)."""
_UINT32_ITEM = np.dtype([("marker", "u1"), ("value", ">u4")])  # a msgpack "uint 32": 0xce, then big-endian
_KEY_BIN = b"\xc4\x10"  # msgpack bin 8 of 16 bytes: a chunk key


Change = tuple[TierName, ChunkRecord | tuple[PrefixKey, ...]]
"""A tier's residency change as a publisher queues it: a chunk that became resident, or keys that stopped being."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EncodedEvents:
    """Encoded events for one batch: ``pieces`` to join (a piece may hold many events), how many of each type."""

    pieces: list[bytes]
    num_stored: int = 0
    num_removed: int = 0
    num_cleared: int = 0

    @property
    def num_events(self) -> int:
        return self.num_stored + self.num_removed + self.num_cleared


def encode_changes(changes: Sequence[Change], block_size: int) -> EncodedEvents:
    """Changes as events that leave a consumer, applying them in order, with exactly the residency the changes
    leave.

    Events of different (tier, key) commute (a consumer's residency is a set of them), so the changes are cut into
    as few runs as possible in which no key is removed from a tier and then stored in it again; each run becomes
    its ``BlockStored`` events, built in one numpy pass per tier and block shape, followed by one ``BlockRemoved``
    per tier. A key removed and stored again starts a new run, so its two events keep their order.

    One pass over the changes with no call per change: the publisher runs this beside the server's request
    threads, where every Python step per change costs several times what it costs alone (they take the GIL and
    the caches)."""
    pieces: list[bytes] = []
    num_stored = num_removed = 0
    stored: dict[tuple[TierName, int, bool], list[ChunkRecord]] = {}  # (tier, token count, has a parent)
    removed: dict[TierName, list[PrefixKey]] = {}
    removed_sets: dict[TierName, set[PrefixKey]] = {}

    def end_run() -> None:
        nonlocal num_stored, num_removed
        for (tier, _, _), records in stored.items():
            pieces.extend(_group_events(records, block_size, MEDIUMS[tier]))
            num_stored += len(records)
        for tier, keys in removed.items():
            pieces.append(block_removed(keys, MEDIUMS[tier]))
        num_removed += len(removed)
        stored.clear()
        removed.clear()
        removed_sets.clear()

    for tier, change in changes:
        if type(change) is tuple:
            keys = removed.get(tier)
            if keys is None:
                removed[tier] = list(change)
                removed_sets[tier] = set(change)
            else:
                keys.extend(change)
                removed_sets[tier].update(change)
            continue
        record = cast(ChunkRecord, change)
        if removed_sets and record.key in removed_sets.get(tier, ()):
            end_run()
        group = (tier, len(record.tokens), record.parent_key is not None)
        records = stored.get(group)
        if records is None:
            stored[group] = [record]
        else:
            records.append(record)
    end_run()
    return EncodedEvents(pieces=pieces, num_stored=num_stored, num_removed=num_removed)


def blocks_stored(records: Sequence[ChunkRecord], block_size: int, medium: str) -> bytes:
    """``BlockStored`` events of ``records`` in ``medium``, joined (grouped by block shape: a consumer applies them
    in any order, each key being stored once). Each is a map of the eight fields without a default."""
    groups: dict[tuple[int, bool], list[ChunkRecord]] = {}
    for record in records:
        groups.setdefault((len(record.tokens), record.parent_key is not None), []).append(record)
    return b"".join(piece for group in groups.values() for piece in _group_events(group, block_size, medium))


def _group_events(records: list[ChunkRecord], block_size: int, medium: str) -> Iterator[bytes]:
    """Events of records of one block shape, ``_ROWS_PER_PASS`` rows per numpy pass."""
    for first in range(0, len(records), _ROWS_PER_PASS):
        yield _same_shape_events(records[first : first + _ROWS_PER_PASS], block_size, medium)


def _same_shape_events(records: Sequence[ChunkRecord], block_size: int, medium: str) -> bytes:
    """Events of records with one token count and all or none with a parent (``_rows``)."""
    num_tokens, has_parent = len(records[0].tokens), records[0].parent_key is not None
    keys = np.frombuffer(b"".join([record.key for record in records]), "V16")
    parents = np.frombuffer(b"".join([record.parent_key or b"" for record in records]), "V16") if has_parent else None
    tokens = np.concatenate([record.tokens for record in records]).reshape(-1, num_tokens) if num_tokens else None
    return _rows(keys, parents, tokens, num_tokens, block_size, medium)


def blocks_stored_batch(records: ContentRecords, first: int, stop: int, block_size: int, medium: str) -> bytes:
    """``BlockStored`` events of chunks ``first:stop`` of ``records`` in ``medium``, joined: a snapshot's, built
    from a tier's arrays with no object per chunk (grouped by block shape, as ``blocks_stored``)."""
    lengths = records.token_ends[first:stop] - records.token_starts[first:stop]
    parent_words = records.parent_words[first:stop].astype("<u8", copy=False)
    has_parent = parent_words.any(axis=1)
    keys = np.ascontiguousarray(records.key_words[first:stop], dtype="<u8").view("V16").reshape(-1)
    parents = np.ascontiguousarray(parent_words).view("V16").reshape(-1)
    starts = records.token_starts[first:stop]
    pieces = []
    for num_tokens in np.unique(lengths).tolist():
        for with_parent in (False, True):
            rows = np.flatnonzero((lengths == num_tokens) & (has_parent == with_parent))
            for pass_first in range(0, len(rows), _ROWS_PER_PASS):
                chosen = rows[pass_first : pass_first + _ROWS_PER_PASS]
                tokens = records.tokens[starts[chosen, None] + np.arange(num_tokens)] if num_tokens else None
                chosen_parents = parents[chosen] if with_parent else None
                pieces.append(_rows(keys[chosen], chosen_parents, tokens, num_tokens, block_size, medium))
    return b"".join(pieces)


def _rows(
    keys: np.ndarray,
    parents: np.ndarray | None,
    tokens: np.ndarray | None,
    num_tokens: int,
    block_size: int,
    medium: str,
) -> bytes:
    """Events of one block shape as the rows of one structured array: the fixed bytes copied from a template row,
    the keys, parents (``None``: no parent) and token ids ``[rows, num_tokens]`` written for all rows at once."""
    rows = np.repeat(_stored_template(num_tokens, parents is not None, block_size, medium), len(keys))
    rows["key"] = keys
    if parents is not None:
        rows["parent"] = parents
    if tokens is not None:
        rows["token_ids"]["value"] = tokens
    return rows.tobytes()


@functools.lru_cache(maxsize=1024)
def _stored_template(num_tokens: int, has_parent: bool, block_size: int, medium: str) -> np.ndarray:
    """One ``BlockStored`` row of a block shape, every fixed byte in place: ``head, key, parent field[, parent],
    token ids field and header, token items, tail`` (a packed structured dtype: no padding)."""
    tail = _pack({"block_size": block_size, "lora_id": None, "medium": medium, "lora_name": None})[1:]

    def constant(value: bytes) -> np.ndarray:
        return np.frombuffer(value, f"V{len(value)}")

    fixed = {
        "head": constant(_STORED_HEAD),
        "parent_field": constant(_PARENT_FIELD + (_KEY_BIN if has_parent else b"\xc0")),
        "token_ids_field": constant(_TOKEN_IDS_FIELD + _array_header(num_tokens)),
        "tail": constant(tail),
    }
    fields: list[tuple[str, object] | tuple[str, object, tuple[int]]] = [
        ("head", fixed["head"].dtype), ("key", "V16"), ("parent_field", fixed["parent_field"].dtype)
    ]  # fmt: skip
    if has_parent:
        fields.append(("parent", "V16"))
    fields.append(("token_ids_field", fixed["token_ids_field"].dtype))
    if num_tokens:
        fields.append(("token_ids", _UINT32_ITEM, (num_tokens,)))
    fields.append(("tail", fixed["tail"].dtype))
    template = np.zeros(1, np.dtype(fields))
    for name, value in fixed.items():
        template[name] = value
    if num_tokens:
        template["token_ids"]["marker"] = 0xCE
    return template


def blocks_resident(keys: Sequence[PrefixKey], block_size: int, medium: str) -> list[bytes]:
    """``BlockStored`` events that say only that ``keys`` are resident: no token ids, no parent (a keys-only
    snapshot, built from keys alone)."""
    tail = _TOKEN_IDS_FIELD + b"\x90" + _pack({"block_size": block_size, "lora_id": None, "medium": medium,
                                                "lora_name": None})[1:]  # fmt: skip
    head = _STORED_HEAD
    no_parent = _PARENT_FIELD + b"\xc0"
    return [head + key + no_parent + tail for key in keys]


def block_removed(keys: Sequence[PrefixKey], medium: str) -> bytes:
    """One ``BlockRemoved`` event for ``keys`` of one tier: ``{"type", "block_hashes", "medium"}``, the keys as
    ``bin`` items joined in one step."""
    hashes = _KEY_BIN + _KEY_BIN.join(keys) if keys else b""
    medium_field = _MEDIUM_FIELDS.get(medium) or _MEDIUM_FIELD + _pack(medium)
    return b"".join((_REMOVED_HEAD, _array_header(len(keys)), hashes, medium_field))


def all_blocks_cleared() -> bytes:
    """``AllBlocksCleared``: whatever a consumer holds of this publisher is gone (a start, a reset)."""
    return _pack({"type": "AllBlocksCleared"})


def batch(ts: float, pieces: Sequence[bytes], num_events: int) -> bytes:
    """A ``KVEventBatch`` ``[ts, [events...]]`` of ``num_events`` encoded events, joined in ``pieces``."""
    return b"".join((b"\x92", _pack(ts), _array_header(num_events), *pieces))


def _pack(value: object) -> bytes:
    packed: bytes = msgpack.packb(value)
    return packed


_STORED_HEAD = b"\x88" + _pack("type") + _pack("BlockStored") + _pack("block_hashes") + b"\x91" + _KEY_BIN
_PARENT_FIELD = _pack("parent_block_hash")
_REMOVED_HEAD = b"\x83" + _pack("type") + _pack("BlockRemoved") + _pack("block_hashes")
_MEDIUM_FIELD = _pack("medium")
_MEDIUM_FIELDS = {medium: _MEDIUM_FIELD + _pack(medium) for medium in MEDIUMS.values()}
_TOKEN_IDS_FIELD = _pack("token_ids")


def _array_header(length: int) -> bytes:
    if length < 16:
        return bytes([0x90 | length])
    if length < 1 << 16:
        return b"\xdc" + struct.pack(">H", length)
    return b"\xdd" + struct.pack(">I", length)
