"""Server URLs: the one check of what a client may be pointed at (``tcp://HOST:PORT`` or ``ipc://PATH``).

A bad URL is the caller's mistake, found before any socket exists, so it is a ``ConfigError`` with the form the
URL should take; a well-formed URL where nothing answers is a ``ServerUnavailableError``, found later.
"""

from __future__ import annotations

from kvstore.errors import ConfigError

__all__ = ["check_server_url"]

_EXAMPLE = "tcp://127.0.0.1:5555"


def check_server_url(url: object) -> str:
    """Return ``url`` when it names a server a client can connect to.

    Raises:
        ConfigError: not a string, another scheme, no host, or a port outside 1-65535.
    """
    if not isinstance(url, str):
        raise ConfigError(f"server URL {url!r} must be a string like {_EXAMPLE}")
    if url.startswith("ipc://"):
        if len(url) == len("ipc://"):
            raise ConfigError(f"server URL {url!r} names no socket path (ipc:///run/kvstore.sock)")
        return url
    if not url.startswith("tcp://"):
        raise ConfigError(f"server URL {url!r} must look like {_EXAMPLE}")
    host, colon, port = url[len("tcp://") :].rpartition(":")
    if not colon or not host:
        raise ConfigError(f"server URL {url!r} needs a host and a port, like {_EXAMPLE}")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"server URL {url!r} has port {port!r}; a port is a number in 1-65535")
    return url
