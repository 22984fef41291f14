"""Strict, typed reads of one decoded msgpack map: the only place wire values become Python values.

Every field of every message passes through a ``Fields`` reader: it checks the exact type (a ``bool`` is not an
``int``, a ``str`` is not ``bytes``), the range or length, and -- when the reader is finished -- that no unknown
key was sent. A failed check raises ``RequestError`` with ``ErrorCode.INVALID_ARGUMENT`` and a one-line message
naming the field, what came and what was expected, so a bad message becomes an error reply, never an exception
that escapes a worker.

Why not a schema library: the messages are few and small, the checks must be exact (msgpack ints vs bools, bin vs
str) and cheap on the lookup path (a few microseconds), and each failure must name the field in the client's terms.

Pure functions and short-lived objects; thread-safe.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvstore.wire.error_codes import ErrorCode, RequestError

__all__ = ["Fields", "describe_type"]


def describe_type(value: object) -> str:
    """The msgpack name of a decoded value's type, for error messages."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, bytes | bytearray | memoryview):
        return "bin"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, dict):
        return "map"
    return type(value).__name__


class Fields:
    """Typed access to the fields of one map; ``finish()`` rejects keys nobody read.

    Args:
        raw: the decoded value that should be a map with string keys.
        where: how to name the map in messages (``"lookup args"``, ``"bulk"``).
    """

    def __init__(self, raw: object, where: str) -> None:
        if not isinstance(raw, dict):
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{where} must be a map, got {describe_type(raw)}")
        self._raw: Mapping[object, object] = raw
        self._where = where
        self._read: set[str] = set()

    def _fail(self, message: str) -> RequestError:
        return RequestError(ErrorCode.INVALID_ARGUMENT, f"{self._where}: {message}")

    def _take(self, name: str, optional: bool) -> object:
        self._read.add(name)
        if name not in self._raw:
            if optional:
                return None
            raise self._fail(f"missing field {name!r}")
        return self._raw[name]

    def has(self, name: str) -> bool:
        return name in self._raw

    def names(self) -> list[str]:
        """The map's keys, for a map keyed by data (a key that is not a string reads as a missing field)."""
        return [str(key) for key in self._raw]

    def int_(self, name: str, low: int, high: int, *, optional: bool = False) -> int | None:
        """An int in ``[low, high]``; ``None`` only when ``optional`` and absent or nil."""
        value = self._take(name, optional)
        if value is None and optional:
            return None
        if type(value) is not int:
            raise self._fail(f"field {name!r} must be an int, got {describe_type(value)}")
        if not low <= value <= high:
            raise self._fail(f"field {name!r}={value} is out of range [{low}, {high}]")
        return value

    def required_int(self, name: str, low: int, high: int) -> int:
        value = self.int_(name, low, high)
        assert value is not None, "Fields.int_ returned None for a required field"
        return value

    def float_(self, name: str, low: float, high: float) -> float:
        value = self._take(name, False)
        if type(value) not in (int, float):
            raise self._fail(f"field {name!r} must be a number, got {describe_type(value)}")
        number = float(value)  # type: ignore[arg-type]
        if not low <= number <= high:
            raise self._fail(f"field {name!r}={number} is out of range [{low}, {high}]")
        return number

    def bool_(self, name: str, *, optional: bool = False) -> bool | None:
        value = self._take(name, optional)
        if value is None and optional:
            return None
        if type(value) is not bool:
            raise self._fail(f"field {name!r} must be a bool, got {describe_type(value)}")
        return value

    def required_bool(self, name: str) -> bool:
        value = self.bool_(name)
        assert value is not None, "Fields.bool_ returned None for a required field"
        return value

    def str_(self, name: str, max_length: int, *, optional: bool = False, allow_empty: bool = False) -> str | None:
        value = self._take(name, optional)
        if value is None and optional:
            return None
        if type(value) is not str:
            raise self._fail(f"field {name!r} must be a str, got {describe_type(value)}")
        if len(value) > max_length:
            raise self._fail(f"field {name!r} is {len(value)} characters long, at most {max_length} allowed")
        if not value and not allow_empty:
            raise self._fail(f"field {name!r} is empty")
        return value

    def required_str(self, name: str, max_length: int) -> str:
        value = self.str_(name, max_length)
        assert value is not None, "Fields.str_ returned None for a required field"
        return value

    def bytes_(self, name: str, *, max_length: int, multiple_of: int = 1, exact_length: int | None = None) -> bytes:
        value = self._take(name, False)
        if type(value) is not bytes:
            raise self._fail(f"field {name!r} must be bin, got {describe_type(value)}")
        if exact_length is not None and len(value) != exact_length:
            raise self._fail(f"field {name!r} must be {exact_length} bytes, got {len(value)}")
        if len(value) > max_length:
            raise self._fail(f"field {name!r} is {len(value):,} bytes, at most {max_length:,} allowed")
        if len(value) % multiple_of:
            raise self._fail(f"field {name!r} is {len(value)} bytes, not a multiple of {multiple_of}")
        return value

    def list_(self, name: str, max_length: int) -> list[object]:
        value = self._take(name, False)
        if type(value) is not list:
            raise self._fail(f"field {name!r} must be an array, got {describe_type(value)}")
        if len(value) > max_length:
            raise self._fail(f"field {name!r} has {len(value):,} items, at most {max_length:,} allowed")
        return value

    def map_(self, name: str, where: str | None = None) -> Fields:
        """A nested map, as its own reader (finish it too)."""
        return Fields(self._take(name, False), where or f"{self._where}.{name}")

    def optional_map(self, name: str) -> Fields | None:
        """A nested map, or ``None`` when the field is absent or nil."""
        value = self._take(name, True)
        return None if value is None else Fields(value, f"{self._where}.{name}")

    def finish(self) -> None:
        """Reject any key that was sent but not read (a typo, or a field of another protocol version)."""
        unknown = [key for key in self._raw if key not in self._read]
        if unknown:
            shown = ", ".join(repr(key) for key in unknown[:5])
            raise self._fail(f"unknown field(s) {shown}; client and server speak different protocol versions?")
