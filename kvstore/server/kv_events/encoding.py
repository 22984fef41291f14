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
- ``token_ids``: the chunk's tokens; ``block_size``: the store's chunk size (a last chunk may be shorter);
- ``medium``: the tier (``MEDIUMS``).

Token ids are the bulk of a stored event (256 of them a chunk by default), so they are encoded with numpy as
msgpack ``uint 32`` items (``0xce`` and 4 big-endian bytes): valid msgpack that every decoder reads as ints, built
in one vectorised step instead of an object per token.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import msgpack
import numpy as np

from kvstore.keys import PrefixKey
from kvstore.tiers.base import ChunkRecord, TierName

__all__ = ["MEDIUMS", "all_blocks_cleared", "batch", "block_removed", "blocks_resident", "blocks_stored"]

MEDIUMS = {TierName.GPU: "GPU", TierName.CPU: "CPU", TierName.DISK: "STORAGE", TierName.REMOTE: "REMOTE"}
"""``medium`` per tier: vLLM's own names for the gpu, cpu and disk levels (``MEDIUM_GPU``, ``MEDIUM_CPU``,
``MEDIUM_STORAGE``), and ``REMOTE`` for the tier a fleet shares."""

_UINT32_ITEM = np.dtype([("marker", "u1"), ("value", ">u4")])  # a msgpack "uint 32": 0xce, then big-endian
_KEY_BIN = b"\xc4\x10"  # msgpack bin 8 of 16 bytes: a chunk key


def blocks_stored(records: Sequence[ChunkRecord], block_size: int, mediums: Sequence[str]) -> list[bytes]:
    """One ``BlockStored`` event per record, in the medium at the same index: a map of the eight fields without a
    default, its fixed parts written once, the token ids of every record encoded in one numpy pass."""
    lengths = [record.num_tokens for record in records]
    items = np.empty(sum(lengths), dtype=_UINT32_ITEM)
    items["marker"] = 0xCE
    if records:
        items["value"] = np.concatenate([record.tokens for record in records])
    token_bytes = items.tobytes()
    tails: dict[str, bytes] = {}
    events = []
    offset = 0
    for record, length, medium in zip(records, lengths, mediums, strict=True):
        tail = tails.get(medium)
        if tail is None:
            tail = tails[medium] = _pack({"block_size": block_size, "lora_id": None, "medium": medium,
                                          "lora_name": None})[1:]  # fmt: skip
        parent = _KEY_BIN + record.parent_key if record.parent_key is not None else b"\xc0"
        token_ids = _array_header(length) + token_bytes[offset : offset + 5 * length]
        offset += 5 * length
        events.append(_STORED_HEAD + record.key + _PARENT_FIELD + parent + _TOKEN_IDS_FIELD + token_ids + tail)
    return events


def blocks_resident(keys: Sequence[PrefixKey], block_size: int, medium: str) -> list[bytes]:
    """``BlockStored`` events that say only that ``keys`` are resident: no token ids, no parent (a keys-only
    snapshot, built from keys alone)."""
    tail = _TOKEN_IDS_FIELD + b"\x90" + _pack({"block_size": block_size, "lora_id": None, "medium": medium,
                                                "lora_name": None})[1:]  # fmt: skip
    head = _STORED_HEAD
    no_parent = _PARENT_FIELD + b"\xc0"
    return [head + key + no_parent + tail for key in keys]


def block_removed(keys: Sequence[PrefixKey], medium: str) -> bytes:
    """One ``BlockRemoved`` event for ``keys`` of one tier."""
    return _pack({"type": "BlockRemoved", "block_hashes": list(keys), "medium": medium})


def all_blocks_cleared() -> bytes:
    """``AllBlocksCleared``: whatever a consumer holds of this publisher is gone (a start, a reset)."""
    return _pack({"type": "AllBlocksCleared"})


def batch(ts: float, events: Sequence[bytes]) -> bytes:
    """A ``KVEventBatch`` of encoded events: ``[ts, [events...]]``."""
    return b"\x92" + _pack(ts) + _array_header(len(events)) + b"".join(events)


def _pack(value: object) -> bytes:
    packed: bytes = msgpack.packb(value)
    return packed


_STORED_HEAD = b"\x88" + _pack("type") + _pack("BlockStored") + _pack("block_hashes") + b"\x91" + _KEY_BIN
_PARENT_FIELD = _pack("parent_block_hash")
_TOKEN_IDS_FIELD = _pack("token_ids")


def _array_header(length: int) -> bytes:
    if length < 16:
        return bytes([0x90 | length])
    if length < 1 << 16:
        return b"\xdc" + struct.pack(">H", length)
    return b"\xdd" + struct.pack(">I", length)
