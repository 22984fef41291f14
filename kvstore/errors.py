"""The one exception tree of kvstore.

Every error a user can see is a ``KVStoreError``; errors from lmdb, zstandard or torch are translated into
one of these where they enter (``raise ... from exc``), so callers catch one family::

    KVStoreError
    ├── ConfigError            bad setting or argument (a capacity below one chunk, a bad tier list, ...)
    │   └── InvalidInputError  bad data handed to the store (wrong shape, dtype, device, token count)
    ├── LayoutMismatchError    KV layout differs from the one a data dir or store was opened with
    ├── CapacityError          a tier cannot hold what was asked even after eviction (everything pinned)
    ├── StoreClosedError       the store (or tier) was used after close()
    ├── StorageError           the disk tier failed in a way that is not a miss (cannot open, disk error)
    ├── ProtocolError          a malformed message between client and server
    ├── ServerUnavailableError no kvstore server answered (not running, wrong --url, timed out, stopping)
    └── ServerBusyError        the server has too many requests in flight; retry

Expected outcomes are not errors: a miss, a full tier during a best-effort promotion or a chunk that failed
its checksum are returned as ``None``/``False`` and counted in stats.

Every message names the bad value, what was expected and what to change.
"""

from __future__ import annotations

__all__ = [
    "CapacityError",
    "ConfigError",
    "InvalidInputError",
    "KVStoreError",
    "LayoutMismatchError",
    "ProtocolError",
    "ServerBusyError",
    "ServerUnavailableError",
    "StorageError",
    "StoreClosedError",
]


class KVStoreError(Exception):
    """Base of every error kvstore raises on purpose."""


class ConfigError(KVStoreError, ValueError):
    """A setting or argument is out of range or inconsistent."""


class InvalidInputError(ConfigError):
    """Data handed to the store does not fit the layout (shape, dtype, device, token count)."""


class LayoutMismatchError(KVStoreError):
    """The KV layout differs from the one the data dir or store was created with."""


class CapacityError(KVStoreError):
    """A tier cannot make room: every resident chunk is pinned."""


class StoreClosedError(KVStoreError, RuntimeError):
    """The store or tier was used after ``close()``."""


class StorageError(KVStoreError, OSError):
    """The disk tier failed for a reason other than a miss (cannot open the data dir, I/O error)."""


class ProtocolError(KVStoreError):
    """A malformed or unexpected message between a client and the server."""


class ServerUnavailableError(KVStoreError, ConnectionError):
    """No kvstore server answered in time: it is not running, the URL is wrong, or it is shutting down."""


class ServerBusyError(KVStoreError):
    """The server refused a request because too many are in flight; retrying later is safe."""
