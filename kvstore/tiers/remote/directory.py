"""The fleet-wide content directory: which chunks some host wrote to the remote, and what their contents hash to.

Every host publishes one record per run of chunks it wrote (a stored sequence, or the part of it that was new): the
chunks' keys, the run's source position and each chunk's content hashes (fingerprint, verification hash and length,
``kvstore.content.index.ChunkContents``), never tokens or KV. Records go to ``num_directory_shards`` Valkey streams
(``RemoteNames.directory_shard``), picked by the run's first key, so a cluster spreads them over its masters. Every
host reads every shard from where it left off (``DirectoryFeed``) and feeds what it reads to its own content index
and its set of remotely held keys: a lookup never asks Valkey anything, the local index is the fast path and a cache
of the directory. Streams are capped (``XADD MAXLEN ~``): the directory forgets its oldest runs first, as Valkey's
LRU forgets the oldest chunks.

Record layout (little-endian)::

    offset   size   field
    0        4      magic b"KVD\\x01"
    4        1      fingerprint bits of the publisher's index (0: no content hashes, the run serves prefix lookups only)
    5        3      reserved, zero
    8        4      number of chunks n
    12       4      reserved, zero
    16       8      source start of the run's first chunk (chunk i starts where chunk i - 1 ends)
    24       8      publisher's host id (a host skips its own records)
    32       16*n   keys
    ..       8*n    fingerprints (u64)          \\
    ..       8*n    verification hashes (u64)    } absent when fingerprint bits is 0
    ..       2*n    lengths in tokens (u16)     /
    ..       8      xxh3_64 of everything before

A record that fails any check is skipped and counted, never fed to an index. So is a shard that is not a stream
(an operator's ``SET`` over it, another program's key): each read counts it as one bad record, it is logged once
until it reads as a stream again, and the other shards are read as usual (so that one such key does not fail every
read, on every host, 19 times a second). The shards are read per cluster master (``RemoteLink.call_keyed``): a
lost master hides its shards only.

Pure functions and one reader per host; ``DirectoryFeed`` is used by one thread at a time.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import redis
import xxhash

from kvstore.keys import KEY_BYTES, PrefixKey
from kvstore.tiers.remote.link import RemoteLink
from kvstore.tiers.remote.names import RemoteNames

__all__ = ["DirectoryFeed", "DirectoryRun", "decode_run", "encode_run"]

logger = logging.getLogger(__name__)

_MAGIC = b"KVD\x01"
_HEADER = struct.Struct("<4sB3xIIQQ")
_CHECKSUM = struct.Struct("<Q")
_FIELD = b"r"
_READ_BATCH = 2048  # records per shard per round trip
_MAX_ROUNDS = 64  # round trips one read_new may take (a host catching up on a large directory takes several calls)

_Entries = list[tuple[bytes, dict[bytes, bytes]]]


@dataclass(frozen=True, slots=True, kw_only=True)
class DirectoryRun:
    """A run of consecutive chunks of one stored sequence, as published.

    Attributes:
        keys: the chunks' prefix keys, in order.
        source_start: position of the first chunk in its sequence.
        fingerprint_bits: of the publisher's index; 0 when the run carries no content hashes.
        fingerprints: per chunk (empty when ``fingerprint_bits`` is 0).
        verifications: per chunk, xxh3_64 of its token bytes (idem).
        lengths: per chunk, its tokens (idem).
    """

    keys: tuple[PrefixKey, ...]
    source_start: int
    fingerprint_bits: int
    fingerprints: npt.NDArray[np.uint64]
    verifications: npt.NDArray[np.uint64]
    lengths: npt.NDArray[np.uint16]

    @property
    def has_contents(self) -> bool:
        return self.fingerprint_bits > 0


def encode_run(run: DirectoryRun, host_id: int) -> bytes:
    """One directory record."""
    count = len(run.keys)
    parts = [_HEADER.pack(_MAGIC, run.fingerprint_bits, count, 0, run.source_start, host_id), *run.keys]
    if run.has_contents:
        parts += [
            run.fingerprints.astype("<u8", copy=False).tobytes(),
            run.verifications.astype("<u8", copy=False).tobytes(),
            run.lengths.astype("<u2", copy=False).tobytes(),
        ]
    body = b"".join(parts)
    return body + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


def decode_run(value: bytes) -> tuple[int, DirectoryRun] | None:
    """``(publisher host id, run)``, or ``None`` for a record that fails any check."""
    if len(value) < _HEADER.size + _CHECKSUM.size:
        return None
    body_end = len(value) - _CHECKSUM.size
    (checksum,) = _CHECKSUM.unpack_from(value, body_end)
    if checksum != xxhash.xxh3_64_intdigest(memoryview(value)[:body_end]):
        return None
    magic, bits, count, reserved, source_start, host_id = _HEADER.unpack_from(value, 0)
    per_chunk = KEY_BYTES + (18 if bits else 0)
    if magic != _MAGIC or reserved or count == 0 or bits > 64 or body_end != _HEADER.size + per_chunk * count:
        return None
    keys_end = _HEADER.size + KEY_BYTES * count
    keys = tuple(PrefixKey(value[start : start + KEY_BYTES]) for start in range(_HEADER.size, keys_end, KEY_BYTES))
    if bits:
        fingerprints = np.frombuffer(value, dtype="<u8", count=count, offset=keys_end).astype(np.uint64)
        verifications = np.frombuffer(value, dtype="<u8", count=count, offset=keys_end + 8 * count).astype(np.uint64)
        lengths = np.frombuffer(value, dtype="<u2", count=count, offset=keys_end + 16 * count).astype(np.uint16)
    else:
        fingerprints = verifications = np.empty(0, dtype=np.uint64)
        lengths = np.empty(0, dtype=np.uint16)
    run = DirectoryRun(
        keys=keys,
        source_start=source_start,
        fingerprint_bits=bits,
        fingerprints=fingerprints,
        verifications=verifications,
        lengths=lengths,
    )
    return host_id, run


def publish_command(pipe: Any, names: RemoteNames, run: DirectoryRun, host_id: int, max_runs_per_shard: int) -> None:
    """Queue the ``XADD`` of one record on a pipeline (the remote tier's writer sends it after the run's chunks)."""
    shard = names.directory_shard(names.shard_of(run.keys[0]))
    pipe.xadd(shard, {_FIELD: encode_run(run, host_id)}, maxlen=max_runs_per_shard, approximate=True)


class DirectoryFeed:
    """Reads every shard of the directory from where this host left off.

    Args:
        link: the remote.
        names: the deployment's key names.
        host_id: this host's id (its own records are skipped: it knows its own chunks).
    """

    def __init__(self, link: RemoteLink, names: RemoteNames, host_id: int) -> None:
        self._link = link
        self._names = names
        self._host_id = host_id
        self._shards = names.directory_shards()
        self._cursors: dict[bytes, bytes] = dict.fromkeys(self._shards, b"0-0")
        self.num_records = 0
        self.num_bad_records = 0
        self._bad_shards: set[bytes] = set()  # shards that were not streams at their last read (logged once)

    def rewind(self) -> None:
        """Read every shard from its start again (the remote lost its data: the old positions mean nothing)."""
        self._cursors = dict.fromkeys(self._cursors, b"0-0")

    def read_new(self) -> list[DirectoryRun] | None:
        """Every record published since the last call (up to a bound per call), oldest first per shard.

        Returns ``None`` when the remote could not be read (an outage: the cursors stay, nothing is lost).
        """
        runs: list[DirectoryRun] = []
        for _ in range(_MAX_ROUNDS):
            unanswered: _Entries | redis.ResponseError | None = None  # the shard's master did not answer
            replies = self._link.call_keyed(
                self._shards, self._read_some, default=unanswered, what="read the content directory"
            )
            if all(reply is None for reply in replies):
                return runs or None
            full = False
            for shard, reply in zip(self._shards, replies, strict=True):
                entries = self._entries(shard, reply)
                full |= len(entries) >= _READ_BATCH
                for entry_id, fields in entries:
                    self._cursors[shard] = entry_id
                    self.num_records += 1
                    decoded = decode_run(fields.get(_FIELD, b""))
                    if decoded is None:
                        self.num_bad_records += 1
                    elif decoded[0] != self._host_id:
                        runs.append(decoded[1])
            if not full:
                break
        return runs

    def _read_some(self, client: Any, picked: list[int]) -> list[_Entries | redis.ResponseError | None]:
        """The new entries of each picked shard, or the error a shard of the wrong type gave."""
        pipe = client.pipeline(transaction=False)
        for index in picked:
            shard = self._shards[index]
            pipe.xread({shard: self._cursors[shard]}, count=_READ_BATCH)
        answers: list[_Entries | redis.ResponseError | None] = []
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, redis.ResponseError) and not isinstance(reply, redis.exceptions.ClusterError):
                answers.append(reply)  # this shard's own fault (WRONGTYPE): the caller skips it
            elif isinstance(reply, Exception):
                raise reply  # the server's or the network's: an outage of this master
            else:  # RESP2: [[stream name, [(id, {field: value}), ...]]], or nothing new
                answers.append(reply[0][1] if reply else [])
        return answers

    def _entries(self, shard: bytes, reply: _Entries | redis.ResponseError | None) -> _Entries:
        """A shard's new entries; none when its master did not answer or it is not a stream (counted, logged once)."""
        if not isinstance(reply, redis.ResponseError):
            if reply is not None and shard in self._bad_shards:
                self._bad_shards.discard(shard)
                logger.warning("remote directory shard %s is a stream again: read as usual", shard.decode())
            return reply or []
        self.num_bad_records += 1
        if shard not in self._bad_shards:
            self._bad_shards.add(shard)
            logger.warning(
                "remote directory shard %s cannot be read (%s): skipped, and counted as a bad record each read, "
                "until it is a stream again (delete the key); the other shards are read as usual",
                shard.decode(), str(reply).splitlines()[0][:120],
            )  # fmt: skip
        return []
