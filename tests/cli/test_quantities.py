"""One rule for sizes and counts in the ``kvstore`` command's output (issue 27: GiB in the banner, MiB in inspect,
"1 chunks")."""

from __future__ import annotations

import pytest

from kvstore.cli.quantities import count_text, size_text


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (512 << 20, "512.00 MiB"),
        ((1 << 30) - 1, "1,024.00 MiB"),
        (4 << 30, "4.00 GiB"),
        (100 << 50, "100.00 PiB"),
        (1 << 70, "1,024.00 EiB"),
    ],
)
def test_a_size_takes_the_largest_binary_unit_it_fills(num_bytes: int, text: str) -> None:
    assert size_text(num_bytes) == text


@pytest.mark.parametrize(("count", "text"), [(0, "0 chunks"), (1, "1 chunk"), (2, "2 chunks"), (1234, "1,234 chunks")])
def test_one_is_singular_and_everything_else_plural(count: int, text: str) -> None:
    assert count_text(count, "chunk") == text


def test_an_irregular_plural_is_given() -> None:
    assert count_text(1, "chunk copy", "chunk copies") == "1 chunk copy"
    assert count_text(3, "chunk copy", "chunk copies") == "3 chunk copies"
