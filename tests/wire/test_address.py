"""Server URLs: a mistake in one is the caller's, named at once; a well-formed URL where nothing listens is not."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore import Client
from kvstore.errors import ConfigError, ServerUnavailableError
from kvstore.wire.address import check_server_url


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("garbage", "must look like tcp://127.0.0.1:5555"),
        ("http://127.0.0.1:5555", "must look like"),
        ("tcp://127.0.0.1", "needs a host and a port"),
        ("tcp://:5555", "needs a host and a port"),
        ("tcp://127.0.0.1:99999", "a port is a number in 1-65535"),
        ("tcp://127.0.0.1:0", "a port is a number in 1-65535"),
        ("tcp://127.0.0.1:55x", "a port is a number in 1-65535"),
        ("ipc://", "names no socket path"),
        (5555, "must be a string"),
    ],
)
def test_a_bad_url_is_a_config_error_before_any_socket(url: object, says: str) -> None:
    started = time.monotonic()
    with pytest.raises(ConfigError, match=says) as raised:
        Client(url, connect_timeout_s=5)  # type: ignore[arg-type]
    assert time.monotonic() - started < 1, "no connection is tried"
    assert not isinstance(raised.value, ServerUnavailableError)
    assert "\n" not in str(raised.value), "one line"


def test_a_well_formed_url_where_nothing_listens_is_unavailable() -> None:
    with pytest.raises(ServerUnavailableError, match="no reply"):
        Client("tcp://127.0.0.1:1", connect_timeout_s=0.2)


@given(host=st.from_regex(r"[a-z0-9.\-]{1,20}", fullmatch=True), port=st.integers(1, 65535))
def test_every_host_and_port_in_range_is_accepted(host: str, port: int) -> None:
    url = f"tcp://{host}:{port}"
    assert check_server_url(url) == url


@given(port=st.integers().filter(lambda port: not 1 <= port <= 65535))
def test_every_port_out_of_range_is_refused(port: int) -> None:
    with pytest.raises(ConfigError):
        check_server_url(f"tcp://127.0.0.1:{port}")
