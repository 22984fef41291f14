from __future__ import annotations

import pytest

from kvstore.config import StoreConfig, parse_size, parse_tiers
from kvstore.errors import ConfigError
from kvstore.tiers.base import TierName


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GiB", 8 * 2**30),
        ("512MiB", 512 * 2**20),
        ("2GB", 2 * 10**9),
        ("1.5g", 1_500_000_000),
        ("4096", 4096),
        (" 3 kib ", 3072),
        ("0", 0),
        ("100PiB", 100 * 2**50),
        ("2EB", 2 * 10**18),
        ("0.5KiB", 512),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(("text", "bytes_said"), [("0.25", "0.25 bytes"), ("1.5", "1.5 bytes"), ("0.1KiB", "102.4")])
def test_a_fractional_byte_count_is_refused_not_rounded_down(text: str, bytes_said: str) -> None:
    with pytest.raises(ConfigError, match=f"{bytes_said}.*not a whole number of bytes"):
        parse_size(text)


@pytest.mark.parametrize("text", ["", "lots", "-1GiB", "8 parsecs", "1e9"])
def test_parse_size_refuses_what_is_not_a_size(text: str) -> None:
    with pytest.raises(ConfigError, match="not a size"):
        parse_size(text)


def test_parse_tiers() -> None:
    assert parse_tiers("gpu,cpu,disk") == (TierName.GPU, TierName.CPU, TierName.DISK)
    assert parse_tiers(" CPU , disk ") == (TierName.CPU, TierName.DISK)
    assert parse_tiers("disk") == (TierName.DISK,)


@pytest.mark.parametrize(
    ("text", "message"),
    [("", "at least one"), ("cpu,cpu", "twice"), ("disk,gpu", "out of order"), ("cpu,ssd", "one of gpu, cpu, disk")],
)
def test_parse_tiers_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_tiers(text)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"chunk_size": 0}, "chunk_size"),
        ({"cpu_capacity_bytes": -1}, "negative"),
        ({"disk_codec_threads": 0}, "at least 1"),
        ({"tiers": ()}, "at least one"),
        ({"tiers": ("cpu", "dsk")}, "one of gpu, cpu, disk"),
        ({"chunk_size": 1.5}, "whole number"),
        ({"cpu_capacity_bytes": True}, "whole number"),
        ({"disk_capacity_bytes": 2.0**30}, "whole number"),
    ],
)
def test_store_config_validates(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        StoreConfig(**changes)  # type: ignore[arg-type]


def test_store_config_accepts_strings_for_tiers_and_paths() -> None:
    config = StoreConfig(tiers=("cpu",), data_dir="somewhere")  # type: ignore[arg-type]
    assert config.tiers == (TierName.CPU,) and str(config.data_dir) == "somewhere"
