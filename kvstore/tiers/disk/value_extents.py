"""Does every value in ``data.mdb``'s trees lie inside the file? A walk of the tree pages with plain reads.

LMDB takes a leaf node's data size on trust, and py-lmdb touches every page of a value it hands out (to fault it in
without the GIL): a flipped bit in the size of a big value (one on overflow pages) makes that value run past the end
of the file, and the first read of it is a SIGBUS that kills the process with no message (issue 27, found by
random bit flips; tests/integration/test_damaged_data_dir.py). A page number past the last page is safe (LMDB says
page not found), so only sizes need checking: a big value must end inside the file, an inline one inside its page.

Page layout (mdb.c, native byte order): ``mp_pgno`` (u64), ``mp_pad`` (u16), ``mp_flags`` (u16), ``mp_lower`` and
``mp_upper`` (u16), then ``mp_lower - 16`` bytes of u16 node offsets. A node: ``mn_lo``, ``mn_hi``, ``mn_flags``,
``mn_ksize`` (u16 each), the key, the data. In a branch node ``lo | hi << 16 | flags << 32`` is the child page; in a
leaf node ``lo | hi << 16`` is the data size, and a big value's data is its first overflow page number (u64).

Reads only the tree pages (about one page per hundred values), never the values. Pure function; thread-safe.
"""

from __future__ import annotations

import os
import struct

__all__ = ["value_past_end"]

_HEADER_BYTES = 16
_NODE_HEADER_BYTES = 8
_BRANCH, _LEAF = 0x01, 0x02
_BIG_VALUE, _SUB_DATABASE, _DUPLICATES = 0x01, 0x02, 0x04
_ROOT_OFFSET = 40  # md_root within an MDB_db record
_NO_ROOT = 2**64 - 1  # P_INVALID: an empty tree


def value_past_end(fd: int, page_size: int, last_page: int, main_root: int) -> str | None:
    """The first value that runs past its page or the file, described in one line, or ``None``.

    Args:
        fd: ``data.mdb`` open for reading.
        page_size: the meta page's page size in bytes.
        last_page: the newest meta page's last page in use (the file holds at least that many pages).
        main_root: the newest meta page's main tree root (it holds the sub-databases' records).
    """
    file_bytes = (last_page + 1) * page_size
    roots = [main_root]
    seen: set[int] = set()
    while roots:
        page_number = roots.pop()
        if page_number > last_page or page_number in seen:
            continue  # LMDB reports a page past the last as not found, without touching it
        seen.add(page_number)
        page = os.pread(fd, page_size, page_number * page_size)
        _, _, flags, lower, _ = struct.unpack_from("=QHHHH", page)
        if not flags & (_BRANCH | _LEAF) or lower > page_size:
            continue  # not a tree page: LMDB says so itself ("page was wrong type")
        for index in range((lower - _HEADER_BYTES) // 2):
            (offset,) = struct.unpack_from("=H", page, _HEADER_BYTES + 2 * index)
            if offset + _NODE_HEADER_BYTES > page_size:
                return f"page {page_number:,} has a node at byte {offset:,}, past the page's end"
            low, high, node_flags, key_bytes = struct.unpack_from("=HHHH", page, offset)
            data_at = offset + _NODE_HEADER_BYTES + key_bytes
            if flags & _BRANCH:
                roots.append(low | high << 16 | node_flags << 32)
                continue
            size = low | high << 16
            if node_flags & _BIG_VALUE:
                if data_at + 8 > page_size:
                    return f"page {page_number:,} has a node at byte {offset:,} whose key runs past the page"
                (first_page,) = struct.unpack_from("=Q", page, data_at)
                end = first_page * page_size + _HEADER_BYTES + size
                if first_page <= last_page and end > file_bytes:
                    return (
                        f"a value's size in the leaf node at byte {offset:,} of page {page_number:,} "
                        f"({size:,} bytes from page {first_page:,}) runs past the end of the file"
                    )
            elif data_at + size > page_size:
                return f"the value of the leaf node at byte {offset:,} of page {page_number:,} runs past its page"
            elif node_flags & _SUB_DATABASE and not node_flags & _DUPLICATES and size >= _ROOT_OFFSET + 8:
                (sub_root,) = struct.unpack_from("=Q", page, data_at + _ROOT_OFFSET)
                if sub_root != _NO_ROOT:
                    roots.append(sub_root)
    return None
