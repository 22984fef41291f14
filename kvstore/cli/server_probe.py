"""Whether anything listens at a server URL, told at once: what ``kvstore inspect --url`` and ``kvstore evict --url``
check before they import the client and wait on a handshake.

Why: a ZeroMQ client cannot tell "connection refused" from "slow": it retries quietly until its hello times out, so
``kvstore inspect --url tcp://127.0.0.1:1`` took 8 s to say nothing answered. A plain TCP
connect is refused in microseconds when nothing listens, and a host name that does not resolve is known as soon as
the resolver answers; anything else (a listener, a slow network, a filtered port, ``ipc://``) is left to the client
and its timeouts.
"""

from __future__ import annotations

import socket

from kvstore.errors import ServerUnavailableError
from kvstore.wire.address import check_server_url

__all__ = ["check_listening"]

_PROBE_TIMEOUT_S = 1.0


def check_listening(url: str, flag: str = "--url") -> None:
    """Raise at once when ``url`` is malformed or its TCP port refuses connections.

    Raises:
        ConfigError: not a server URL (``check_server_url``).
        ServerUnavailableError: the host refused the connection (no server listens there), or its name is unknown.
    """
    check_server_url(url)
    if not url.startswith("tcp://"):
        return
    host, _, port = url[len("tcp://") :].rpartition(":")
    host = host.strip("[]")  # an IPv6 literal, tcp://[::1]:5555
    try:
        with socket.create_connection((host, int(port)), timeout=_PROBE_TIMEOUT_S):
            pass
    except ConnectionRefusedError:
        raise ServerUnavailableError(
            f"{flag} {url}: nothing listens there (connection refused); start kvstore serve, or find a running "
            "server's URL in its data dir's serve.json"
        ) from None
    except socket.gaierror as exc:
        raise ServerUnavailableError(
            f"{flag} {url}: unknown host {host!r} ({exc.strerror}); check the URL (a running server's is in its "
            "data dir's serve.json)"
        ) from None
    except OSError:
        return  # unreachable or slow: the client's own timeout says so
