"""Where the remote tier's Valkey (or Redis) is, and the namespace a deployment's keys live under: values that
configuration checks at start-up (``StoreConfig``), below the tier that connects to them.

Accepted forms, the same for a single node and for a cluster (the link detects which it is)::

    valkey://HOST[:PORT][/DB]           redis://...    plain TCP
    valkeys://HOST[:PORT][/DB]          rediss://...   TLS (query parameters such as ssl_ca_certs=... pass through)
    valkey://USER:PASSWORD@HOST:PORT    an ACL user (or only :PASSWORD@ for ``requirepass``)

A password on the command line shows in ``ps``; ``KVSTORE_REMOTE_PASSWORD`` (read by the CLI and the server) keeps it
off. Every defect is one ``ConfigError`` line naming the URL without its password.

Pure functions and immutable values; thread-safe.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass, field

from kvstore.errors import ConfigError

__all__ = ["DEFAULT_NAMESPACE", "DEFAULT_PORT", "RemoteAddress", "check_namespace", "parse_remote_url"]

DEFAULT_PORT = 6379
DEFAULT_NAMESPACE = "kvstore"
_NAMESPACE_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")
_PLAIN_SCHEMES = {"valkey": "redis", "redis": "redis"}
_TLS_SCHEMES = {"valkeys": "rediss", "rediss": "rediss"}


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoteAddress:
    """A parsed remote URL.

    Attributes:
        host: server name or address (the first node of a cluster: the others are discovered).
        port: TCP port.
        db: logical database (0 on a cluster, which has only that one).
        tls: connect with TLS.
        username: ACL user, when given.
        password: password, when given (never shown by ``describe`` or ``repr``).
        query: the URL's query string, handed to the client library (TLS files, for instance).
    """

    host: str
    port: int
    db: int = 0
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    query: str = ""

    def describe(self) -> str:
        """The URL without credentials, for logs and errors."""
        scheme = "valkeys" if self.tls else "valkey"
        user = f"{self.username}@" if self.username else ""
        database = f"/{self.db}" if self.db else ""
        return f"{scheme}://{user}{_bracketed(self.host)}:{self.port}{database}"

    def client_url(self) -> str:
        """The URL in the client library's own schemes (``redis://`` / ``rediss://``), credentials included."""
        scheme = "rediss" if self.tls else "redis"
        credentials = ""
        if self.username or self.password:
            user = urllib.parse.quote(self.username or "", safe="")
            secret = urllib.parse.quote(self.password or "", safe="")
            credentials = f"{user}:{secret}@" if self.password else f"{user}@"
        query = f"?{self.query}" if self.query else ""
        return f"{scheme}://{credentials}{_bracketed(self.host)}:{self.port}/{self.db}{query}"


def parse_remote_url(url: str, *, password: str | None = None) -> RemoteAddress:
    """Parse and check a remote URL.

    Args:
        url: ``valkey://``, ``valkeys://``, ``redis://`` or ``rediss://`` (see the module docstring).
        password: replaces the URL's password (from ``KVSTORE_REMOTE_PASSWORD``).

    Raises:
        ConfigError: an unknown scheme, no host, a bad port or database number.
    """
    try:
        parts = urllib.parse.urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"--remote-url {_without_password(url)!r}: {exc}; write e.g. valkey://HOST:6379") from None
    scheme = parts.scheme.lower()
    if scheme not in _PLAIN_SCHEMES and scheme not in _TLS_SCHEMES:
        raise ConfigError(
            f"--remote-url {_without_password(url)!r}: the scheme must be valkey://, valkeys:// (TLS), redis:// or "
            "rediss://"
        )
    if not parts.hostname:
        raise ConfigError(f"--remote-url {_without_password(url)!r} names no host; write e.g. valkey://HOST:6379")
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise ConfigError(f"--remote-url {_without_password(url)!r}: the path must be a database number, e.g. /0")
    return RemoteAddress(
        host=parts.hostname,
        port=port if port is not None else DEFAULT_PORT,
        db=int(path) if path else 0,
        tls=scheme in _TLS_SCHEMES,
        username=urllib.parse.unquote(parts.username) if parts.username else None,
        password=password if password is not None else _url_password(parts),
        query=parts.query,
    )


def _url_password(parts: urllib.parse.SplitResult) -> str | None:
    return urllib.parse.unquote(parts.password) if parts.password else None


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _without_password(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for error messages)."""
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.password is None:
            return url
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
    except ValueError:
        return "<unparsable URL>"


def check_namespace(namespace: str) -> str:
    """``namespace`` if it is 1-64 letters, digits, dots, dashes or underscores (no braces: they would move the
    cluster hash tag of every key named after it, ``kvstore.tiers.remote.names``)."""
    if not isinstance(namespace, str) or _NAMESPACE_PATTERN.fullmatch(namespace) is None:
        raise ConfigError(
            f"remote namespace {namespace!r} must be 1-64 letters, digits, '.', '-' or '_' (e.g. kvstore-prod)"
        )
    return namespace
