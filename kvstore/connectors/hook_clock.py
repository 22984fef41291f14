"""Time an engine's own thread spends inside the connector's hooks: what the connector adds to a request's latency.

Transfers run on the connector's threads; what the engine waits for is the time its thread spends in the hooks
(a scheduler's lookup, a worker's per-layer gathers and scatters). ``HookClock`` adds that up per engine step. The
total is reported with the connector's stats (``on_path_ms``); with ``KVSTORE_CONNECTOR_TRACE=FILE`` each step also
appends a JSON line ``{"side": ..., "t": unix seconds at the step's end, "seconds": ...}`` to FILE, so a benchmark
that runs one request at a time attributes the time to its request (``kvstore bench vllm``). Off by default; the
clock itself costs two ``perf_counter`` calls per hook.

Threads: one clock per connector instance, used from the engine's thread only.
"""

from __future__ import annotations

import json
import logging
import os
import time
from types import TracebackType

__all__ = ["TRACE_ENV", "HookClock"]

logger = logging.getLogger(__name__)

TRACE_ENV = "KVSTORE_CONNECTOR_TRACE"
"""The environment variable naming the trace file (unset: no trace)."""


class HookClock:
    """``with clock:`` around each hook; ``end_step()`` once a step's hooks are done.

    Args:
        side: ``scheduler`` or ``worker`` (written into each trace line).
        environ: where ``KVSTORE_CONNECTOR_TRACE`` is read (the process environment by default).
    """

    def __init__(self, side: str, environ: dict[str, str] | None = None) -> None:
        self.side = side
        self._trace_path = (environ if environ is not None else os.environ).get(TRACE_ENV) or None
        self._step_seconds = 0.0
        self._entered = 0.0

    def __enter__(self) -> None:
        self._entered = time.perf_counter()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._step_seconds += time.perf_counter() - self._entered

    def end_step(self) -> float:
        """The seconds this step spent in hooks (traced when a trace file is set); starts the next step at 0."""
        seconds, self._step_seconds = self._step_seconds, 0.0
        if self._trace_path is not None and seconds:
            line = json.dumps({"side": self.side, "t": time.time(), "seconds": seconds})
            try:
                with open(self._trace_path, "a") as trace:
                    trace.write(line + "\n")
            except OSError as exc:
                logger.warning("cannot append to %s=%s (%s); tracing stops", TRACE_ENV, self._trace_path, exc)
                self._trace_path = None
        return seconds
