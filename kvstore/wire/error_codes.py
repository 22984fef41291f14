"""Error codes of the protocol, and the one exception a request handler raises to send an error reply.

Every error reply carries a code from ``ErrorCode`` and a one-line message. The server turns any failure while
handling a request into such a reply (``error_for``); the client turns the code back into the matching
``kvstore.errors`` class (``exception_for``), so a caller of ``kvstore.Client`` catches the same errors as a
caller of ``TieredStore``:

    code                  raised by the client as        meaning
    malformed             ProtocolError                  not msgpack, not a map, wrong frame count
    unsupported_version   ProtocolError                  the header's "v" is not this server's version
    unknown_op            ProtocolError                  no such operation
    invalid_argument      InvalidInputError              a field has the wrong type, range or size
    too_large             InvalidInputError              a frame or field is over its limit
    not_registered        (handled: re-handshake)        no hello yet, or the server restarted since
    layout_mismatch       LayoutMismatchError            the client's layout is not the server's
    unknown_plan          ConfigError                    plan retrieved/released already, or its session ended
    unknown_segment       ProtocolError                  a shared-memory segment id this client never attached
    config                ConfigError                    the request is valid but the server's setup refuses it
    capacity              CapacityError                  every tier is pinned full
    storage               StorageError                   the disk tier failed
    busy                  ServerBusyError                too many requests in flight; retry
    shutting_down         ServerUnavailableError         the server is stopping
    internal              KVStoreError                   a bug in the server (logged with its traceback)
"""

from __future__ import annotations

import enum

from kvstore.errors import (
    CapacityError,
    ConfigError,
    InvalidInputError,
    KVStoreError,
    LayoutMismatchError,
    ProtocolError,
    ServerBusyError,
    ServerUnavailableError,
    StorageError,
    StoreClosedError,
)

__all__ = ["ErrorCode", "RequestError", "error_for", "exception_for"]


class ErrorCode(enum.StrEnum):
    """Why a request failed (the ``code`` of an error reply)."""

    MALFORMED = "malformed"
    UNSUPPORTED_VERSION = "unsupported_version"
    UNKNOWN_OP = "unknown_op"
    INVALID_ARGUMENT = "invalid_argument"
    TOO_LARGE = "too_large"
    NOT_REGISTERED = "not_registered"
    LAYOUT_MISMATCH = "layout_mismatch"
    UNKNOWN_PLAN = "unknown_plan"
    UNKNOWN_SEGMENT = "unknown_segment"
    CONFIG = "config"
    CAPACITY = "capacity"
    STORAGE = "storage"
    BUSY = "busy"
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"


class RequestError(ProtocolError):
    """A request cannot be served; the server answers with ``code`` and ``message``.

    Args:
        code: the error code of the reply.
        message: one line naming the bad value, what was expected and what to change.
        request_id: the id to answer to, when the decoder got that far (``None``: the reply carries nil).
    """

    def __init__(self, code: ErrorCode, message: str, request_id: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


def error_for(exc: KVStoreError) -> RequestError:
    """The error reply for a kvstore error raised while serving a request."""
    if isinstance(exc, RequestError):
        return exc
    message = str(exc).replace("\n", " ")
    if isinstance(exc, InvalidInputError):
        return RequestError(ErrorCode.INVALID_ARGUMENT, message)
    if isinstance(exc, LayoutMismatchError):
        return RequestError(ErrorCode.LAYOUT_MISMATCH, message)
    if isinstance(exc, ConfigError):
        return RequestError(ErrorCode.CONFIG, message)
    if isinstance(exc, CapacityError):
        return RequestError(ErrorCode.CAPACITY, message)
    if isinstance(exc, StorageError):
        return RequestError(ErrorCode.STORAGE, message)
    if isinstance(exc, StoreClosedError):
        return RequestError(ErrorCode.SHUTTING_DOWN, message)
    return RequestError(ErrorCode.INTERNAL, message)


def exception_for(code: str, message: str) -> KVStoreError:
    """The client-side exception for an error reply (unknown codes from a newer server: ``ProtocolError``)."""
    text = f"server: {message}"
    classes: dict[str, type[KVStoreError]] = {
        ErrorCode.INVALID_ARGUMENT: InvalidInputError,
        ErrorCode.TOO_LARGE: InvalidInputError,
        ErrorCode.LAYOUT_MISMATCH: LayoutMismatchError,
        ErrorCode.UNKNOWN_PLAN: ConfigError,
        ErrorCode.CONFIG: ConfigError,
        ErrorCode.CAPACITY: CapacityError,
        ErrorCode.STORAGE: StorageError,
        ErrorCode.BUSY: ServerBusyError,
        ErrorCode.SHUTTING_DOWN: ServerUnavailableError,
        ErrorCode.INTERNAL: KVStoreError,
    }
    return classes.get(code, ProtocolError)(text)
