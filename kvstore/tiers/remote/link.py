"""The remote tier's connection to Valkey: a single node or a cluster, with short timeouts and outage handling.

The remote is an accelerator, never a dependency: when it is down, slow or refuses a command, every call returns its
"nothing" answer (a miss, a write not done) and the store goes on with its local tiers. So:

- **Timeouts.** Every socket operation is bounded by ``timeout_s`` (connect included) and the client library never
  retries on its own: no request waits on the remote longer than that per round trip.
- **Outages.** The first failed call opens an outage: one warning names the remote and the error; for
  ``retry_interval_s`` afterwards calls fail fast without touching the network (a dead host would otherwise cost
  every request one timeout); then one call probes. Once calls have succeeded for ``retry_interval_s`` without a
  failure the outage closes with one line saying how long it lasted and how many calls it failed; a failure
  before that (a cluster whose lost node still owns slots answers some calls and fails others) continues the same
  outage, so a flapping remote logs one line each way, not one per flap. A command the server refuses (out of
  memory under ``noeviction``, an ACL without the permission) is a failed call too, counted, but not an outage;
  each kind of refusal (``OOM``, ``NOPERM``, ...) is logged once per ``REFUSAL_QUIET_S``, with how many were
  refused since. A wrong password is an outage that says so.
- **Clean logs.** A logged error is one line of printable text without the command's arguments: the client
  library names a failed pipeline command with its arguments, chunk values included, which made ``grep`` take a
  log for binary.
- **Single node or cluster.** At the first successful connection the link asks the server (``INFO cluster``) and
  builds a ``redis.Redis`` or a slot-aware ``redis.cluster.RedisCluster``. Keys are named by ``RemoteNames`` so that
  what must share a slot does.
- **A breaker per master.** ``call_keyed`` splits its keys by the master that owns their slot and runs one call per
  master, each behind that master's own outage state: a lost master fails fast for its slots only, and the other
  masters' slots stay in use (the client library's own split would fail the whole pipeline for one dead node). The
  healthy masters answer only if the cluster allows it: Valkey's default ``cluster-require-full-coverage yes``
  refuses every command once a slot has no master; a cache cluster should set it to ``no``. ``call`` (a command
  naming no chunk, such as the epoch check) keeps the link's own outage state.

Threads: safe to share. The client library's pools are thread-safe; ``_state_lock`` guards the outage state.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore.remote_address import RemoteAddress

__all__ = ["RemoteLink", "RemoteLinkStats"]

logger = logging.getLogger(__name__)

_Answer = TypeVar("_Answer")

_NETWORK_ERRORS: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.ClusterDownError,  # before the refusals: it is a ResponseError too
    redis.exceptions.ClusterError,
    redis.exceptions.SlotNotCoveredError,
    OSError,
)
# Refused by a working server: ``ResponseError`` covers OOM, NOPERM, WRONGTYPE. Authentication failures are
# ``AuthenticationError`` (a ConnectionError): an outage, since nothing will work until the operator fixes it.
_REFUSALS: tuple[type[BaseException], ...] = (redis.ResponseError, redis.exceptions.DataError)
REFUSAL_QUIET_S = 60.0
_LOGGED_ERROR_CHARS = 200
_PIPELINE_COMMAND = re.compile(r"Command # \d+ \(.*?\) of pipeline caused error: ", re.DOTALL)


class RemoteLinkStats:
    """Counters of one link (read without a lock: each is a single int, written under ``_state_lock``)."""

    def __init__(self) -> None:
        self.calls = 0
        self.failed_calls = 0
        self.skipped_calls = 0  # failed fast during an outage, without a network round trip
        self.refused_calls = 0
        self.outages = 0


@dataclass
class _Breaker:
    """The outage state of the link, or of one cluster master (see the module docstring)."""

    label: str  # what the log lines name: the remote, or "<remote> master <host:port>"
    down_since: float | None = None
    up_since: float | None = None  # the first success of a closing outage
    next_probe: float = 0.0
    failed_in_outage: int = 0

    def fails_fast(self, now: float) -> bool:
        return self.down_since is not None and self.up_since is None and now < self.next_probe


class RemoteLink:
    """One client of a Valkey deployment, shared by the remote tier's readers, writers and directory.

    Args:
        address: the parsed URL.
        timeout_s: bound on every connect, read and write (seconds).
        retry_interval_s: during an outage, how long calls fail fast before one probes the remote again.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        address: RemoteAddress,
        *,
        timeout_s: float,
        retry_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.retry_interval_s = retry_interval_s
        self._clock = clock
        self._state_lock = threading.Lock()
        self._client: redis.Redis | redis.cluster.RedisCluster | None = None
        self._is_cluster = False
        self._breaker = _Breaker(address.describe())
        self._master_breakers: dict[str, _Breaker] = {}  # by "host:port" of a cluster master
        self.stats = RemoteLinkStats()
        self._refusals_logged: dict[str, tuple[float, int]] = {}  # kind -> (last logged at, refused since)
        self._closed = False

    @property
    def is_cluster(self) -> bool:
        """Whether the remote is a Valkey Cluster (known after the first successful call)."""
        return self._is_cluster

    @property
    def available(self) -> bool:
        """No outage of the link is open (a lost cluster master is an outage of its slots only)."""
        return self._breaker.down_since is None

    def call(self, operation: Callable[[Any], _Answer], *, default: _Answer, what: str) -> _Answer:
        """Run ``operation(client)``; on any remote failure return ``default`` instead (see the module docstring).

        Args:
            operation: uses the client (a ``redis.Redis`` or ``redis.cluster.RedisCluster``); may pipeline.
            default: the answer when the remote cannot give one (a miss, ``False``, an empty list).
            what: a few words for the log ("get 12 chunks").
        """
        return self._guarded(self._breaker, operation, default, what)

    def call_keyed(
        self,
        names: Sequence[bytes],
        operation: Callable[[Any, list[int]], list[_Answer]],
        *,
        default: _Answer,
        what: str,
    ) -> list[_Answer]:
        """One answer per key name: ``operation(client, indices)`` answers for ``names[i]`` of each index given.

        On a cluster it runs once per master owning some of the names, behind that master's breaker; the names of
        a master that failed, or fails fast, get ``default``. On a single node it is one ``call`` over all of them.
        Not yet connected, it connects first (behind the link's breaker), so the first call on a cluster is split
        too: one pipeline over every master would fail whole for one dead master.
        """
        answers = [default] * len(names)
        if not names:
            return answers
        if self._client is None:  # connect first: a cluster's first call is then split by master too
            self._guarded(self._breaker, lambda client: True, False, f"{what} (connect)")
        client = self._client
        if client is None:
            return answers
        if not isinstance(client, redis.cluster.RedisCluster):
            every = list(range(len(names)))
            got = self._guarded(self._breaker, lambda client: operation(client, every), None, what)
            return answers if got is None else got
        try:
            owners: dict[str, list[int]] = {}
            for index, name in enumerate(names):
                owner = client.get_node_from_key(name).name  # type: ignore[no-untyped-call]
                owners.setdefault(owner, []).append(index)
        except redis.RedisError as exc:  # no slot table (the library is rebuilding it): every name fails
            self._refused(exc, what)
            return answers
        for owner, picked in owners.items():
            with self._state_lock:
                breaker = self._master_breakers.setdefault(owner, _Breaker(f"{self.address.describe()} master {owner}"))
            got = self._guarded(breaker, _on(operation, picked), None, what)
            for index, answer in zip(picked, got or (), strict=False):
                answers[index] = answer
        return answers

    def _guarded(self, breaker: _Breaker, operation: Callable[[Any], _Answer], default: _Answer, what: str) -> _Answer:
        with self._state_lock:
            if self._closed:
                return default
            self.stats.calls += 1
            if breaker.fails_fast(self._clock()):
                self.stats.skipped_calls += 1
                breaker.failed_in_outage += 1
                return default
        try:
            client = self._client or self._connect()
            answer = operation(client)
        except _NETWORK_ERRORS as exc:
            self._fail(breaker, exc, what)
            return default
        except _REFUSALS as exc:
            self._refused(exc, what)
            return default
        except Exception as exc:  # a reply the client library could not handle: a failed call, never a crash
            self._refused(exc, what)
            return default
        self._succeed(breaker)
        return answer

    def _connect(self) -> redis.Redis | redis.cluster.RedisCluster:
        """Build the client: ask the node whether it is part of a cluster, then make the right kind."""
        options: dict[str, Any] = {
            "socket_timeout": self.timeout_s,
            "socket_connect_timeout": self.timeout_s,
            "retry": Retry(NoBackoff(), 0),
            "health_check_interval": 0,
        }
        url = self.address.client_url()
        probe = redis.Redis.from_url(url, **options)
        try:
            info = probe.info("cluster")
        finally:
            probe.close()
        client: redis.Redis | redis.cluster.RedisCluster
        if info.get("cluster_enabled"):
            if self.address.db:
                raise redis.exceptions.DataError("a Valkey Cluster has only database 0; drop the /N of the URL")
            client = redis.cluster.RedisCluster.from_url(url, **options)
        else:
            client = redis.Redis.from_url(url, **options)
        with self._state_lock:
            if self._client is None:
                self._client, self._is_cluster = client, bool(info.get("cluster_enabled"))
                logger.info(
                    "remote tier connected to %s (%s)",
                    self.address.describe(),
                    "cluster" if self._is_cluster else "single node",
                )
                return client
        client.close()
        return self._client

    def _refused(self, exc: BaseException, what: str) -> None:
        text = _one_line(exc)
        kind = f"{type(exc).__name__} {text.split(' ', 1)[0]}"  # e.g. "OutOfMemoryError OOM"
        with self._state_lock:
            self.stats.refused_calls += 1
            self.stats.failed_calls += 1
            now = self._clock()
            logged_at, since = self._refusals_logged.get(kind, (-REFUSAL_QUIET_S, 0))
            if now - logged_at < REFUSAL_QUIET_S:
                self._refusals_logged[kind] = (logged_at, since + 1)
                return
            self._refusals_logged[kind] = (now, 0)
        also = f"; {since} more refused since the last such line" if since else ""
        logger.warning(
            "remote tier %s refused %s (%s: %s)%s; said once a minute at most",
            self.address.describe(), what, type(exc).__name__, text, also,
        )  # fmt: skip

    def _fail(self, breaker: _Breaker, exc: BaseException, what: str) -> None:
        with self._state_lock:
            self.stats.failed_calls += 1
            breaker.failed_in_outage += 1
            breaker.next_probe = self._clock() + self.retry_interval_s
            breaker.up_since = None
            if breaker.down_since is not None:
                return
            breaker.down_since = self._clock()
            self.stats.outages += 1
        if isinstance(exc, redis.AuthenticationError):
            logger.warning(
                "remote tier %s refused authentication (%s): check the URL's user and KVSTORE_REMOTE_PASSWORD; "
                "serving from the local tiers, retrying every %.1f s",
                breaker.label, _one_line(exc), self.retry_interval_s,
            )  # fmt: skip
            return
        if breaker is not self._breaker:
            served = "its slots are served from the local tiers, the other masters' stay in use"
        elif self._is_cluster:  # a call over the whole cluster (the epoch check): the masters' keys go on per master
            served = "each master's keys stay in use while that master answers"
        else:
            served = "serving from the local tiers"
        logger.warning(
            "remote tier %s unreachable (%s: %s, during %s): %s, retrying every %.1f s",
            breaker.label, type(exc).__name__, _one_line(exc), what, served, self.retry_interval_s,
        )  # fmt: skip

    def _succeed(self, breaker: _Breaker) -> None:
        with self._state_lock:
            if breaker.down_since is None:
                return
            now = self._clock()
            if breaker.up_since is None:
                breaker.up_since = now
            if now - breaker.up_since < self.retry_interval_s:
                return  # closing: a failure now would continue this outage
            lasted = breaker.up_since - breaker.down_since
            failed = breaker.failed_in_outage
            breaker.down_since = breaker.up_since = None
            breaker.failed_in_outage = 0
        logger.warning(
            "remote tier %s reachable again after %.1f s (%d remote calls answered locally meanwhile)",
            breaker.label,
            lasted,
            failed,
        )

    def close(self) -> None:
        """Close the connections; later calls return their defaults. Idempotent."""
        with self._state_lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()


def _on(
    operation: Callable[[Any, list[int]], list[_Answer]], picked: list[int]
) -> Callable[[Any], list[_Answer] | None]:
    """``operation`` bound to one master's share of the names."""
    return lambda client: operation(client, picked)


def _one_line(exc: BaseException) -> str:
    """The error's message as one short line of printable text, without a pipeline command's arguments."""
    text = _PIPELINE_COMMAND.sub("", str(exc))
    printable = "".join(char if char.isascii() and char.isprintable() else " " for char in text).strip()
    return " ".join(printable.split())[:_LOGGED_ERROR_CHARS] or type(exc).__name__
