"""Where a server publishes its KV events and how it batches them (``kvstore serve --kv-events``), and what it
published (the ``kvstore_kv_events_*`` metrics)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KVEventOptions", "KVEventStats"]


@dataclass(frozen=True, slots=True, kw_only=True)
class KVEventOptions:
    """Where and how events go.

    Args:
        endpoint: the PUB socket: bound when it names no host (``tcp://*:5557``) or is ``ipc://`` / ``inproc://``,
            else connected (to a router that binds, as llm-d's does), as vLLM does.
        replay_endpoint: the ROUTER socket for replay and snapshot requests, always bound; ``None``: none.
        topic: the first frame of every message.
        buffer_steps: batches kept for replay.
        buffer_bytes: the most bytes those batches may hold, the oldest going first (``--kv-events-replay-mib``).
        max_events: the most events in one batch.
        interval_s: how long changes wait to join a batch (``--kv-events-interval-ms``): a router sees a change at
            most this much later. A batch has a fixed cost (waking, taking the GIL back from the server's request
            threads, a numpy pass per tier and block shape, the send): fewer, larger batches cost the publisher's
            thread about a third less CPU at 50 ms than at 20 ms (docs/benchmarks.md, "KV events").
    """

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    buffer_bytes: int = 256 << 20
    max_events: int = 1000
    interval_s: float = 0.05

    @property
    def binds(self) -> bool:
        """Whether the PUB socket binds ``endpoint`` (vLLM's rule: a wildcard host or a local transport binds, a
        named host is connected to, and events sent before a subscriber binds there are dropped)."""
        endpoint = self.endpoint
        return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


@dataclass(frozen=True, slots=True, kw_only=True)
class KVEventStats:
    """What a publisher did since it started.

    Args:
        batches: batches published (snapshot answers not counted).
        events: events published, by type (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``).
        queued: residency changes heard and not yet published.
        requests: replay socket requests answered, by kind (``replay``, ``snapshot``, ``invalid``).
        cpu_s: CPU time the publisher's thread has spent (encoding, sending, answering requests): what publishing
            costs the server, as of the thread's last pass (at most ``interval_s`` ago while it runs).
    """

    batches: int
    events: dict[str, int]
    queued: int
    requests: dict[str, int]
    cpu_s: float
