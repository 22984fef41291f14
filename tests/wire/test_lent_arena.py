"""A server's shared arena as a client maps it: read-only, refused when it is not the named server's sealed memfd,
and its pages mapped ahead of a chunk's first read (``MappedArena.populate``), once per slot."""

from __future__ import annotations

import os

import pytest
import torch

from kvstore.errors import StorageError
from kvstore.tiers.memfd_arena import create_shared_arena
from kvstore.wire.shm import create_segment, map_lent_arena

_MIB = 2**20


def resident_bytes(name: str) -> int:
    """Resident bytes of this process's mappings of the memfd ``name`` (``/proc/self/smaps``)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if "-" in line.split()[0] and len(line.split()) >= 5:  # a mapping's header line
                inside = f"/memfd:{name}" in line
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def test_the_arena_maps_read_only_and_populates_a_chunk_once() -> None:
    arena = create_shared_arena(8 * _MIB)
    assert arena.fd is not None
    arena.tensor[: 4 * _MIB].fill_(7)  # what the server has written: two chunks of 2 MiB
    mapped = map_lent_arena(arena.name, arena.nbytes, os.getpid(), arena.fd)
    server_resident = resident_bytes(arena.name)  # the server's own mapping (this process is both here)
    mapped.populate(_MIB + 100, 2 * _MIB)  # a chunk not on a page edge
    added = resident_bytes(arena.name) - server_resident
    assert 2 * _MIB <= added < 3 * _MIB  # the chunk's pages (and a few around it), not the whole arena
    mapped.populate(_MIB + 100, 2 * _MIB)  # once per slot
    assert resident_bytes(arena.name) - server_resident == added
    assert torch.equal(mapped.tensor[_MIB : 3 * _MIB], torch.full((2 * _MIB,), 7, dtype=torch.uint8))
    with open("/proc/self/maps") as maps:
        permissions = {line.split()[1] for line in maps if f"/memfd:{arena.name}" in line}
    assert permissions == {"rw-s", "r--s"}  # the server's mapping, and the client's, which cannot write
    arena.close_fd()


def test_anything_but_the_named_servers_arena_is_refused() -> None:
    arena = create_shared_arena(_MIB)
    assert arena.fd is not None
    with pytest.raises(StorageError, match="is not kvstore-arena"):
        map_lent_arena(arena.name, arena.nbytes, os.getpid() + 1, arena.fd)  # another server's name
    with pytest.raises(StorageError, match="bytes, the client said"):
        map_lent_arena(arena.name, 2 * _MIB, os.getpid(), arena.fd)
    segment = create_segment(_MIB)  # a client segment: another name
    assert segment.fd is not None
    with pytest.raises(StorageError, match="not kvstore-arena"):
        map_lent_arena(segment.name, _MIB, os.getpid(), segment.fd)
    with pytest.raises(StorageError, match="the descriptor is"):
        map_lent_arena(arena.name, arena.nbytes, os.getpid(), segment.fd)  # the right name, another file
    segment.close_fd()
    arena.close_fd()
    with pytest.raises(StorageError, match="cannot open"):
        map_lent_arena(arena.name, arena.nbytes, os.getpid(), 999_999)
