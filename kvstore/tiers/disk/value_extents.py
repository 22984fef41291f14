"""Does every value in ``data.mdb``'s trees lie inside the file? A walk of the tree pages with plain reads.

LMDB takes a leaf node's data size on trust, and py-lmdb touches every page of a value it hands out (to fault it in
without the GIL): a flipped bit in the size of a big value (one on overflow pages) makes that value run past the end
of the file, and the first read of it is a SIGBUS that kills the process with no message (random bit flips find
it; tests/integration/test_damaged_data_dir.py). A page number past the last page is safe (LMDB says
page not found), so only sizes need checking: a big value must end inside the file, an inline one inside its page.

Page layout (mdb.c, native byte order): ``mp_pgno`` (u64), ``mp_pad`` (u16), ``mp_flags`` (u16), ``mp_lower`` and
``mp_upper`` (u16), then ``mp_lower - 16`` bytes of u16 node offsets. A node: ``mn_lo``, ``mn_hi``, ``mn_flags``,
``mn_ksize`` (u16 each), the key, the data. In a branch node ``lo | hi << 16 | flags << 32`` is the child page; in a
leaf node ``lo | hi << 16`` is the data size, and a big value's data is its first overflow page number (u64).

Reads only the tree pages, never the big values: at a million chunks that is ~330,000 leaf pages of the meta records
(they hold their values inline), so the walk is compiled and runs over a read-only map of the file (4.2 s in Python
pages and ``struct``, every start of a 1M-chunk data dir). The map covers the pages the newest commit names, which
the caller has checked the file holds. Pure function; thread-safe.
"""

from __future__ import annotations

import mmap
import sys

import numpy as np
from numba import njit, types

__all__ = ["value_past_end"]

_HEADER_BYTES = 16
_NODE_HEADER_BYTES = 8
_BRANCH, _LEAF = 0x01, 0x02
_BIG_VALUE, _SUB_DATABASE, _DUPLICATES = 0x01, 0x02, 0x04
_ROOT_OFFSET = 40  # md_root within an MDB_db record
_NO_ROOT = 2**64 - 1  # P_INVALID: an empty tree
_PAGES = types.Array(types.uint8, 1, "C", readonly=True)
_FOUND = types.UniTuple(types.int64, 5)  # type: ignore[no-untyped-call]
_STACK = types.Array(types.uint64, 1, "C")
_FOUND_NOTHING, _NODE_PAST_PAGE, _BIG_KEY_PAST_PAGE, _BIG_VALUE_PAST_FILE, _INLINE_PAST_PAGE = range(5)


def value_past_end(fd: int, page_size: int, last_page: int, main_root: int) -> str | None:
    """The first value that runs past its page or the file, described in one line, or ``None``.

    Args:
        fd: ``data.mdb`` open for reading, at least ``(last_page + 1) * page_size`` bytes long.
        page_size: the meta page's page size in bytes.
        last_page: the newest meta page's last page in use (the file holds at least that many pages).
        main_root: the newest meta page's main tree root (it holds the sub-databases' records).
    """
    pages = np.frombuffer(mmap.mmap(fd, (last_page + 1) * page_size, access=mmap.ACCESS_READ), dtype=np.uint8)
    found = _walk(pages, page_size, last_page, main_root, sys.byteorder == "little")  # unmapped with ``pages``
    kind, page_number, offset, size, first_page = (int(value) for value in found)
    if kind == _NODE_PAST_PAGE:
        return f"page {page_number:,} has a node at byte {offset:,}, past the page's end"
    if kind == _BIG_KEY_PAST_PAGE:
        return f"page {page_number:,} has a node at byte {offset:,} whose key runs past the page"
    if kind == _BIG_VALUE_PAST_FILE:
        return (
            f"a value's size in the leaf node at byte {offset:,} of page {page_number:,} "
            f"({size:,} bytes from page {first_page:,}) runs past the end of the file"
        )
    if kind == _INLINE_PAST_PAGE:
        return f"the value of the leaf node at byte {offset:,} of page {page_number:,} runs past its page"
    return None


@njit(types.int64(_PAGES, types.int64, types.int64, types.boolean), cache=True, nogil=True)
def _word(pages, at, num_bytes, little):  # type: ignore[no-untyped-def]
    """The unsigned integer of ``num_bytes`` bytes at ``at``, in the file's (the host's) byte order."""
    value = np.int64(0)
    for index in range(num_bytes):
        byte = pages[at + (index if little else num_bytes - 1 - index)]
        value |= np.int64(byte) << (8 * index)
    return value


@njit(_STACK(_STACK, types.int64, types.uint64), cache=True, nogil=True)
def _pushed(stack, depth, page_number):  # type: ignore[no-untyped-def]
    """``stack`` with ``page_number`` at ``depth`` (a copy twice as long when it is full)."""
    if depth == stack.shape[0]:
        grown = np.empty(2 * depth, dtype=np.uint64)
        grown[:depth] = stack
        stack = grown
    stack[depth] = page_number
    return stack


@njit(_FOUND(_PAGES, types.int64, types.int64, types.int64, types.boolean), cache=True, nogil=True)
def _walk(pages, page_size, last_page, main_root, little):  # type: ignore[no-untyped-def]
    """``(kind, page, node offset, value size, value's first page)`` of the first value found past its page or the
    file (``kind`` 0: none). A page past ``last_page`` is left to LMDB (it reports it as not found)."""
    file_bytes = (last_page + 1) * page_size
    seen = np.zeros(last_page + 1, dtype=np.bool_)
    stack = np.empty(1024, dtype=np.uint64)
    stack[0] = np.uint64(main_root)
    depth = 1
    while depth:
        depth -= 1
        if stack[depth] > np.uint64(last_page):
            continue
        page_number = np.int64(stack[depth])
        if seen[page_number]:
            continue
        seen[page_number] = True
        base = np.int64(page_number) * page_size
        flags = _word(pages, base + 10, 2, little)
        lower = _word(pages, base + 12, 2, little)
        if not flags & (_BRANCH | _LEAF) or lower > page_size:
            continue  # not a tree page: LMDB says so itself ("page was wrong type")
        for index in range((lower - _HEADER_BYTES) // 2):
            offset = _word(pages, base + _HEADER_BYTES + 2 * index, 2, little)
            if offset + _NODE_HEADER_BYTES > page_size:
                return _NODE_PAST_PAGE, page_number, offset, 0, 0
            low = _word(pages, base + offset, 2, little)
            high = _word(pages, base + offset + 2, 2, little)
            node_flags = _word(pages, base + offset + 4, 2, little)
            key_bytes = _word(pages, base + offset + 6, 2, little)
            data_at = offset + _NODE_HEADER_BYTES + key_bytes
            if flags & _BRANCH:
                stack = _pushed(stack, depth, np.uint64(low | high << 16 | node_flags << 32))
                depth += 1
                continue
            size = low | high << 16
            if node_flags & _BIG_VALUE:
                if data_at + 8 > page_size:
                    return _BIG_KEY_PAST_PAGE, page_number, offset, 0, 0
                first_page = np.uint64(_word(pages, base + data_at, 8, little))
                if first_page <= np.uint64(last_page):
                    value_end = np.int64(first_page) * page_size + _HEADER_BYTES + size
                    if value_end > file_bytes:
                        return _BIG_VALUE_PAST_FILE, page_number, offset, size, np.int64(first_page)
            elif data_at + size > page_size:
                return _INLINE_PAST_PAGE, page_number, offset, 0, 0
            elif node_flags & _SUB_DATABASE and not node_flags & _DUPLICATES and size >= _ROOT_OFFSET + 8:
                sub_root = np.uint64(_word(pages, base + data_at + _ROOT_OFFSET, 8, little))
                if sub_root != np.uint64(_NO_ROOT):
                    stack = _pushed(stack, depth, sub_root)
                    depth += 1
    return _FOUND_NOTHING, 0, 0, 0, 0

