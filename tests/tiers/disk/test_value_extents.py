"""value_past_end over hand-built LMDB pages: each way a tree page can send a read past its page or the file."""

from __future__ import annotations

import os
import struct
from pathlib import Path

from kvstore.tiers.disk.value_extents import value_past_end

PAGE = 4096
NUM_PAGES = 6


def _page(number: int, flags: int, nodes: list[bytes]) -> bytes:
    """A tree page holding ``nodes`` packed from its end, their offsets after the header."""
    body = bytearray(PAGE)
    offsets = []
    upper = PAGE
    for node in nodes:
        upper -= len(node) + len(node) % 2
        body[upper : upper + len(node)] = node
        offsets.append(upper)
    lower = 16 + 2 * len(offsets)
    struct.pack_into("=QHHHH", body, 0, number, 0, flags, lower, upper)
    for index, offset in enumerate(offsets):
        struct.pack_into("=H", body, 16 + 2 * index, offset)
    return bytes(body)


def _node(key: bytes, size: int, flags: int, data: bytes) -> bytes:
    return struct.pack("=HHHH", size & 0xFFFF, size >> 16, flags, len(key)) + key + data


def _branch_node(key: bytes, child: int) -> bytes:
    return struct.pack("=HHHH", child & 0xFFFF, (child >> 16) & 0xFFFF, child >> 32, len(key)) + key


def _sub_database(name: bytes, root: int) -> bytes:
    record = bytearray(48)
    struct.pack_into("=Q", record, 40, root)
    return _node(name, 48, 0x02, bytes(record))


def _file(tmp_path: Path, leaf_nodes: list[bytes]) -> int:
    """Pages 0-1 metas (unread), 2 the main tree (one sub-database), 3 its branch root, 4 a leaf, 5 overflow."""
    pages = [bytes(PAGE), bytes(PAGE), _page(2, 0x02, [_sub_database(b"payload", 3)])]
    pages += [_page(3, 0x01, [_branch_node(b"", 4), _branch_node(b"k", 99)]), _page(4, 0x02, leaf_nodes)]
    pages.append(bytes(PAGE))
    path = tmp_path / "data.mdb"
    path.write_bytes(b"".join(pages))
    return os.open(path, os.O_RDONLY)


def _check(tmp_path: Path, leaf_nodes: list[bytes]) -> str | None:
    fd = _file(tmp_path, leaf_nodes)
    try:
        return value_past_end(fd, PAGE, NUM_PAGES - 1, main_root=2)
    finally:
        os.close(fd)


def test_values_inside_the_file_pass(tmp_path: Path) -> None:
    big = _node(b"big", PAGE - 16, 0x01, struct.pack("=Q", 5))  # page 5 to the file's end exactly
    assert _check(tmp_path, [_node(b"small", 5, 0, b"hello"), big]) is None


def test_a_big_value_past_the_file_is_named(tmp_path: Path) -> None:
    big = _node(b"big", PAGE - 15, 0x01, struct.pack("=Q", 5))
    reason = _check(tmp_path, [big])
    assert reason is not None and "page 4" in reason and "runs past the end of the file" in reason


def test_a_big_value_on_a_page_past_the_last_is_left_to_lmdb(tmp_path: Path) -> None:
    """LMDB answers page-not-found for it without touching memory."""
    assert _check(tmp_path, [_node(b"big", 1 << 30, 0x01, struct.pack("=Q", NUM_PAGES))]) is None


def test_an_inline_value_past_its_page_is_named(tmp_path: Path) -> None:
    reason = _check(tmp_path, [_node(b"small", PAGE, 0, b"hello")])
    assert reason is not None and "runs past its page" in reason


def test_a_node_offset_past_the_page_is_named(tmp_path: Path) -> None:
    fd = _file(tmp_path, [_node(b"small", 5, 0, b"hello")])
    os.close(fd)
    path = tmp_path / "data.mdb"
    with open(path, "r+b") as data_file:
        data_file.seek(4 * PAGE + 16)
        data_file.write(struct.pack("=H", PAGE - 4))
    fd = os.open(path, os.O_RDONLY)
    try:
        reason = value_past_end(fd, PAGE, NUM_PAGES - 1, main_root=2)
    finally:
        os.close(fd)
    assert reason is not None and "past the page's end" in reason


def test_a_big_values_key_past_its_page_is_named(tmp_path: Path) -> None:
    reason = _check(tmp_path, [_node(b"big", 100, 0x01, b"")])  # packed last: its page number lies past the page
    assert reason is not None and "whose key runs past the page" in reason


def test_a_child_that_is_not_a_tree_page_is_left_to_lmdb(tmp_path: Path) -> None:
    """LMDB says "page was wrong type" for it; the walk does not descend (page 5 is no tree page)."""
    fd = _file(tmp_path, [_node(b"small", 5, 0, b"hello")])
    try:
        assert value_past_end(fd, PAGE, NUM_PAGES - 1, main_root=5) is None
    finally:
        os.close(fd)


def test_a_deep_wide_tree_is_walked_whole(tmp_path: Path) -> None:
    """Three branch pages of 400 children each, the one real child last (walked first): the walk's stack holds
    more pages than it starts with, and the damaged leaf under them is still found."""
    junk = [_branch_node(b"", 1000 + index) for index in range(399)]  # past the last page: left to LMDB
    pages = [bytes(PAGE), bytes(PAGE), _page(2, 0x02, [_sub_database(b"meta", 3)])]
    pages += [_page(number, 0x01, [*junk, _branch_node(b"", number + 1)]) for number in (3, 4, 5)]
    pages.append(_page(6, 0x02, [_node(b"small", PAGE, 0, b"hello")]))
    path = tmp_path / "data.mdb"
    path.write_bytes(b"".join(pages))
    fd = os.open(path, os.O_RDONLY)
    try:
        reason = value_past_end(fd, PAGE, len(pages) - 1, main_root=2)
    finally:
        os.close(fd)
    assert reason is not None and "of page 6 runs past its page" in reason
