"""Read locks: which tier pins each open plan holds, grouped by the session that asked for it.

A lookup pins every chunk of its plan so a later retrieve finds it; the pins must come off exactly once, whether
the plan is retrieved, released, its session ends, the caller forgets it, or the store closes. ``PinLedger`` is
that bookkeeping and nothing else: the store asks it to open a plan with its pins, prefetches add pins to it,
and every way out *takes* the plan's pins (once) so the caller can unpin them::

    lookup -> open_plan(pins) --+--> retrieve / release -> take_plan(id)      -> unpin
                                +--> end_session(sid)   -> take_session(sid)  -> unpin
              prefetch lands -> add_pin(id, cpu)  (False once taken: the prefetcher unpins its own pin)

``kvstore.session.Session`` is the Python handle of a session: a context manager whose exit (or garbage
collection, for a caller that abandons it) ends the session, which takes its plans' pins here.

Threads: any number. ``_ledger_lock`` guards every dict and counter; it is never held while calling a tier.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.keys import PrefixKey
from kvstore.tiers.base import Tier

__all__ = ["Pin", "PinLedger"]

Pin = tuple[Tier, PrefixKey]
"""One pin held on a chunk in a tier."""


@dataclass(slots=True)
class _OpenPlan:
    session_id: str | None
    pins: list[Pin] = field(default_factory=list)


class PinLedger:
    """Pins of open plans, by plan id and by session."""

    def __init__(self) -> None:
        self._ledger_lock = threading.Lock()
        self._plans: dict[int, _OpenPlan] = {}
        self._sessions: dict[str, set[int]] = {}
        self._plan_ids = itertools.count(1)

    def open_plan(self, session_id: str | None, pins: Sequence[Pin]) -> int:
        """Record a new plan holding ``pins``; returns its id."""
        with self._ledger_lock:
            plan_id = next(self._plan_ids)
            self._plans[plan_id] = _OpenPlan(session_id=session_id, pins=list(pins))
            if session_id is not None:
                self._sessions.setdefault(session_id, set()).add(plan_id)
            return plan_id

    def add_pin(self, plan_id: int, pin: Pin) -> bool:
        """Give an open plan one more pin; ``False`` when the plan was already taken (the caller must unpin)."""
        with self._ledger_lock:
            plan = self._plans.get(plan_id)
            if plan is None:
                return False
            plan.pins.append(pin)
            return True

    def pins_of(self, plan_id: int) -> list[Pin] | None:
        """An open plan's pins, the plan left open (a retrieve of one part of it); ``None`` when it is closed."""
        with self._ledger_lock:
            plan = self._plans.get(plan_id)
            return None if plan is None else list(plan.pins)

    def take_plan(self, plan_id: int) -> list[Pin] | None:
        """Close a plan and hand back its pins; ``None`` when it was already closed."""
        with self._ledger_lock:
            plan = self._plans.pop(plan_id, None)
            if plan is None:
                return None
            if plan.session_id is not None:
                members = self._sessions.get(plan.session_id)
                if members is not None:
                    members.discard(plan_id)
                    if not members:
                        del self._sessions[plan.session_id]
            return plan.pins

    def take_session(self, session_id: str) -> list[Pin]:
        """Close every open plan of a session and hand back their pins."""
        with self._ledger_lock:
            plan_ids = self._sessions.pop(session_id, set())
            return [pin for plan_id in plan_ids for pin in self._plans.pop(plan_id).pins]

    def take_all(self) -> list[Pin]:
        """Close every open plan (store shutdown) and hand back all pins."""
        with self._ledger_lock:
            pins = [pin for plan in self._plans.values() for pin in plan.pins]
            self._plans.clear()
            self._sessions.clear()
            return pins

    @property
    def num_open_plans(self) -> int:
        with self._ledger_lock:
            return len(self._plans)

    @property
    def num_sessions(self) -> int:
        with self._ledger_lock:
            return len(self._sessions)
