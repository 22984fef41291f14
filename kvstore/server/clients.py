"""Who is connected, and what each client holds: open plans, sessions, shared-memory segments.

The store pins a plan's chunks until the plan is retrieved or released or its session ends; over a network a
client can vanish without doing any of that. So the server keeps, per client, the plans and segments it holds,
and takes them back when the client says goodbye, when its process dies (local clients: its pid is checked by the
janitor every second), or when a plan outlives ``plan_ttl_s`` unretrieved (remote clients can only be timed out);
a remote client idle that long with nothing held is forgotten too (it says hello again if it comes back).

Plans are owned: a plan id is served only to the client whose lookup made it (ids are sequential, so guessable).
Sessions are per client: the store sees ``<client id>/<session id>``, so two clients may both call theirs
``"session-1"``.

A plan shared by ``readers`` ranks (the ranks of a tensor- or pipeline-parallel engine each retrieve their layers and
KV heads of the plan their scheduler pinned) leaves its owner's table at its first retrieve and stays open, pins
held, until all ``readers`` have retrieved or released it and no retrieve of it is still copying (``begin_shared`` /
``end_shared``); then it is handed back for the store to release. Counting readers, rather than the parts' cells,
serves ranks that hold the same part (KV heads replicated over more ranks than there are heads, an MLA latent every
rank loads whole). A rank that never comes (it died) leaves the plan to the plan TTL.

A lent plan (``TieredStore.lend``: the client copies the chunks out of the shared cpu arena itself) is one of those
readers copying from its lend until it returns the plan (``begin_loan`` / ``end_loan``), whatever its ``readers``:
so the plan cannot expire under the copy. The client's loans are returned for it when it departs.

Threads: any. ``_clients_lock`` guards ``_clients`` and everything inside each ``ClientState``; it is never held
while calling the store.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvstore.pids import pid_alive
from kvstore.plan import LookupPlan
from kvstore.wire.error_codes import ErrorCode, RequestError
from kvstore.wire.values import ClientSummary

__all__ = ["ClientRegistry", "ClientState", "Departure", "OpenPlan", "store_session_id"]

MAX_SEGMENTS_PER_CLIENT = 64
MAX_SEGMENTS_PER_PROCESS = 256
"""Over all the client ids one process registers: ids are free, so a cap per id alone bounds nothing."""
MAX_SEGMENTS_TOTAL = 8192
"""Every segment is one mapping of the server's; Linux allows a process 65,530 (``vm.max_map_count``), and the
server needs the rest for LMDB, thread stacks and torch: near the limit it cannot even start a thread."""


def store_session_id(client_id: str, session_id: str) -> str:
    """The store's name for a client's session."""
    return f"{client_id}/{session_id}"


@dataclass(slots=True)
class OpenPlan:
    """A plan a client looked up and has not retrieved or released yet."""

    plan: LookupPlan
    session_id: str | None
    opened_s: float


@dataclass(slots=True)
class ClientState:
    """One registered client; mutated only under the registry's lock."""

    client_id: str
    name: str
    pid: int
    local: bool
    has_layout: bool
    last_seen_s: float
    plans: dict[int, OpenPlan] = field(default_factory=dict)
    segments: dict[int, torch.Tensor] = field(default_factory=dict)
    next_segment_id: int = 1
    loans: set[tuple[str, int]] = field(default_factory=set)  # (owner, plan id) lent and not yet returned

    def sessions(self) -> set[str]:
        return {open_plan.session_id for open_plan in self.plans.values() if open_plan.session_id is not None}


@dataclass(slots=True)
class _SharedPlan:
    """A plan some of whose readers retrieved or released it: how many are done, and the retrieves still copying."""

    open_plan: OpenPlan
    readers: int
    done: int = 0
    in_flight: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Departure:
    """What a departed client still held, for the caller to give back to the store."""

    client_id: str
    sessions: tuple[str, ...]
    loose_plans: tuple[LookupPlan, ...]


class ClientRegistry:
    """The server's table of clients.

    Args:
        clock: monotonic seconds (tests replace it).
        pid_alive: whether a local client's process still exists (tests replace it).
        max_segments_per_process: segments all of one process's clients may hold together.
        max_segments_total: segments all clients may hold together.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        pid_alive: Callable[[int], bool] = pid_alive,
        *,
        max_segments_per_process: int = MAX_SEGMENTS_PER_PROCESS,
        max_segments_total: int = MAX_SEGMENTS_TOTAL,
    ) -> None:
        self._clients_lock = threading.Lock()
        self._clients: dict[str, ClientState] = {}
        self._shared: dict[tuple[str, int], _SharedPlan] = {}  # by (owner, plan id)
        self._clock = clock
        self._pid_alive = pid_alive
        self._max_segments_per_process = max_segments_per_process
        self._max_segments_total = max_segments_total

    def register(self, name: str, pid: int, local: bool, has_layout: bool) -> str:
        """A new client; returns its id (the token its requests carry)."""
        client_id = secrets.token_hex(8)
        with self._clients_lock:
            self._clients[client_id] = ClientState(
                client_id=client_id, name=name, pid=pid, local=local, has_layout=has_layout, last_seen_s=self._clock()
            )
        return client_id

    def touch(self, client_id: str | None, *, needs_layout: bool) -> None:
        """Check a request's client token (and that it registered a layout, for KV requests).

        Raises:
            RequestError: ``not_registered`` for an unknown token; ``config`` when a layout is needed.
        """
        if client_id is None:
            raise RequestError(ErrorCode.NOT_REGISTERED, "say hello first: this request carries no client token")
        with self._clients_lock:
            state = self._clients.get(client_id)
            if state is None:
                raise RequestError(
                    ErrorCode.NOT_REGISTERED,
                    f"unknown client {client_id!r:.40} (the server restarted, or the client said goodbye); say hello",
                )
            state.last_seen_s = self._clock()
            has_layout = state.has_layout
        if needs_layout and not has_layout:
            raise RequestError(
                ErrorCode.CONFIG, "this client registered no layout (an admin client); it cannot store or look up"
            )

    # -- plans -------------------------------------------------------------------------------------------------

    def add_plan(self, client_id: str, plan: LookupPlan, session_id: str | None) -> bool:
        """Record a client's new plan; ``False`` when the client is gone (the caller releases the plan)."""
        with self._clients_lock:
            state = self._clients.get(client_id)
            if state is None:
                return False
            state.plans[plan.plan_id] = OpenPlan(plan=plan, session_id=session_id, opened_s=self._clock())
            return True

    def take_plan(self, client_id: str, plan_id: int) -> OpenPlan:
        """Hand a client's plan over for retrieve or release (once).

        Raises:
            RequestError: ``unknown_plan`` when it is not this client's open plan.
        """
        with self._clients_lock:
            state = self._clients.get(client_id)
            open_plan = state.plans.pop(plan_id, None) if state is not None else None
        if open_plan is None:
            raise RequestError(
                ErrorCode.UNKNOWN_PLAN,
                f"plan {plan_id} was already retrieved or released (or its session ended, or it expired, or it is "
                "another client's); call lookup() again",
            )
        return open_plan

    def begin_shared(self, owner: str, plan_id: int, readers: int) -> OpenPlan:
        """Hand an owner's plan to one of its ``readers`` for a retrieve (or a release, with ``end_shared`` right
        after); the plan stays open (pinned) for the others until ``end_shared`` has heard from all of them.

        Raises:
            RequestError: ``unknown_plan`` when it is not the owner's open plan, or all its readers are done.
        """
        with self._clients_lock:
            shared = self._shared.get((owner, plan_id))
            if shared is None:
                state = self._clients.get(owner)
                open_plan = state.plans.pop(plan_id, None) if state is not None else None
                if open_plan is not None:
                    shared = _SharedPlan(open_plan=open_plan, readers=readers)
                    self._shared[(owner, plan_id)] = shared
            if shared is not None:
                shared.in_flight += 1
                return shared.open_plan
        raise RequestError(
            ErrorCode.UNKNOWN_PLAN,
            f"plan {plan_id} was already retrieved or released by its {readers} readers (or its session ended, or it "
            "expired, or it is another client's); call lookup() again",
        )

    def end_shared(self, owner: str, plan_id: int) -> OpenPlan | None:
        """One reader's retrieve (``begin_shared``) is over, or it will not retrieve; returns the plan when every
        reader is done and nothing is copying: the caller releases its pins."""
        with self._clients_lock:
            shared = self._shared.get((owner, plan_id))
            if shared is None:
                return None
            shared.in_flight -= 1
            shared.done += 1
            if shared.done < shared.readers or shared.in_flight:
                return None
            del self._shared[(owner, plan_id)]
            return shared.open_plan

    def begin_loan(self, client_id: str, owner: str, plan_id: int, readers: int) -> OpenPlan:
        """Open a lend of an owner's plan by ``client_id``: as a retrieve by one of its ``readers`` (``begin_shared``),
        recorded on the client until ``end_loan`` or ``cancel_loan``.

        Raises:
            RequestError: ``unknown_plan`` as ``begin_shared``; ``not_registered`` when the client is gone.
        """
        open_plan = self.begin_shared(owner, plan_id, readers)
        with self._clients_lock:
            state = self._clients.get(client_id)
            if state is not None:
                state.loans.add((owner, plan_id))
                return open_plan
        self.cancel_loan(client_id, owner, plan_id)
        raise RequestError(ErrorCode.NOT_REGISTERED, f"unknown client {client_id!r:.40}; say hello")

    def cancel_loan(self, client_id: str, owner: str, plan_id: int) -> OpenPlan | None:
        """A lend that lent nothing: the plan is as before ``begin_loan`` (back in its owner's table when no reader
        is done with it). Returns it when its owner is gone meanwhile (the caller releases it)."""
        with self._clients_lock:
            state = self._clients.get(client_id)
            if state is not None:
                state.loans.discard((owner, plan_id))
            shared = self._shared.get((owner, plan_id))
            if shared is None:
                return None
            shared.in_flight -= 1
            if shared.done or shared.in_flight:
                return None
            del self._shared[(owner, plan_id)]
            owner_state = self._clients.get(owner)
            if owner_state is None:
                return shared.open_plan
            owner_state.plans[plan_id] = shared.open_plan
            return None

    def end_loan(self, client_id: str, owner: str, plan_id: int) -> OpenPlan | None:
        """The client has copied what it was lent: one reader done (``end_shared``); returns the plan when it was the
        last (the caller releases it).

        Raises:
            RequestError: ``unknown_plan`` when the client holds no loan of that plan.
        """
        with self._clients_lock:
            state = self._clients.get(client_id)
            if state is None or (owner, plan_id) not in state.loans:
                raise RequestError(ErrorCode.UNKNOWN_PLAN, f"plan {plan_id} is not lent to this client")
            state.loans.discard((owner, plan_id))
        return self.end_shared(owner, plan_id)

    def take_session(self, client_id: str, session_id: str) -> list[OpenPlan]:
        """Forget a session's open plans (the caller ends the store's session, which releases them)."""
        with self._clients_lock:
            state = self._clients.get(client_id)
            if state is None:
                return []
            taken = [p for p in state.plans.values() if p.session_id == session_id]
            for open_plan in taken:
                del state.plans[open_plan.plan.plan_id]
            return taken

    def take_expired_plans(self, ttl_s: float) -> list[OpenPlan]:
        """Forget every plan older than ``ttl_s`` (the caller releases them); a shared plan expires too, unless one
        of its readers is copying."""
        deadline = self._clock() - ttl_s
        expired: list[OpenPlan] = []
        with self._clients_lock:
            for state in self._clients.values():
                old = [p for p in state.plans.values() if p.opened_s < deadline]
                for open_plan in old:
                    del state.plans[open_plan.plan.plan_id]
                expired += old
            for name, shared in list(self._shared.items()):
                if shared.open_plan.opened_s < deadline and not shared.in_flight:
                    del self._shared[name]
                    expired.append(shared.open_plan)
        return expired

    # -- segments ----------------------------------------------------------------------------------------------

    def is_local(self, client_id: str) -> bool:
        """Whether the client said hello from the server's host (unknown clients are not)."""
        with self._clients_lock:
            state = self._clients.get(client_id)
            return state is not None and state.local

    def client_pid(self, client_id: str) -> int:
        with self._clients_lock:
            state = self._clients.get(client_id)
            if state is None:
                raise RequestError(ErrorCode.NOT_REGISTERED, f"unknown client {client_id!r:.40}; say hello")
            if not state.local:
                raise RequestError(
                    ErrorCode.CONFIG, "shared memory is for clients on the server's host; send the KV inline"
                )
            return state.pid

    def add_segment(self, client_id: str, segment: torch.Tensor) -> int:
        """Keep a mapped segment for a client; returns its id.

        Raises:
            RequestError: ``capacity`` when the client, its process or the server holds as many segments as it may
                (the client then moves its KV inline), ``not_registered`` when the client is gone.
        """
        with self._clients_lock:
            state = self._clients.get(client_id)
            if state is None:
                raise RequestError(ErrorCode.NOT_REGISTERED, f"unknown client {client_id!r:.40}; say hello")
            if len(state.segments) >= MAX_SEGMENTS_PER_CLIENT:
                raise RequestError(
                    ErrorCode.CAPACITY,
                    f"a client may attach at most {MAX_SEGMENTS_PER_CLIENT} segments; detach one first",
                )
            of_process = sum(len(other.segments) for other in self._clients.values() if other.pid == state.pid)
            if of_process >= self._max_segments_per_process:
                raise RequestError(
                    ErrorCode.CAPACITY,
                    f"the clients of process {state.pid} hold {of_process} segments, the most one process may; "
                    "detach some (or send the KV inline)",
                )
            total = sum(len(other.segments) for other in self._clients.values())
            if total >= self._max_segments_total:
                raise RequestError(
                    ErrorCode.CAPACITY,
                    f"the server maps {total} segments, the most it may; send the KV inline until clients detach",
                )
            segment_id = state.next_segment_id
            state.next_segment_id += 1
            state.segments[segment_id] = segment
            return segment_id

    def segment(self, client_id: str, segment_id: int) -> torch.Tensor:
        """A client's mapped segment (the caller's reference keeps it mapped even if it is detached meanwhile).

        Raises:
            RequestError: ``unknown_segment``.
        """
        with self._clients_lock:
            state = self._clients.get(client_id)
            segment = state.segments.get(segment_id) if state is not None else None
        if segment is None:
            raise RequestError(
                ErrorCode.UNKNOWN_SEGMENT, f"segment {segment_id} is not attached by this client; attach it first"
            )
        return segment

    def remove_segment(self, client_id: str, segment_id: int) -> bool:
        with self._clients_lock:
            state = self._clients.get(client_id)
            return state is not None and state.segments.pop(segment_id, None) is not None

    # -- departures --------------------------------------------------------------------------------------------

    def remove(self, client_id: str) -> Departure | None:
        """Forget a client; returns what it held (``None`` when unknown)."""
        with self._clients_lock:
            state = self._clients.pop(client_id, None)
        if state is None:
            return None
        returned = [done.plan for loan in state.loans if (done := self.end_shared(*loan)) is not None]
        return Departure(
            client_id=client_id,
            sessions=tuple(sorted(state.sessions())),
            loose_plans=(*(p.plan for p in state.plans.values() if p.session_id is None), *returned),
        )

    def remove_dead(self) -> list[Departure]:
        """Forget local clients whose process is gone."""
        with self._clients_lock:
            candidates = [(s.client_id, s.pid) for s in self._clients.values() if s.local]
        dead = [client_id for client_id, pid in candidates if not self._pid_alive(pid)]
        return [departure for client_id in dead if (departure := self.remove(client_id)) is not None]

    def remove_idle(self, idle_s: float) -> list[Departure]:
        """Forget remote clients that hold no plans and sent nothing for ``idle_s`` (they may come back: their next
        request gets ``not_registered`` and the client says hello again). Keeps the table bounded."""
        deadline = self._clock() - idle_s
        with self._clients_lock:
            idle = [
                s.client_id for s in self._clients.values() if not s.local and not s.plans and s.last_seen_s < deadline
            ]
        return [departure for client_id in idle if (departure := self.remove(client_id)) is not None]

    def remove_all(self) -> list[Departure]:
        with self._clients_lock:
            client_ids = list(self._clients)
        return [departure for client_id in client_ids if (departure := self.remove(client_id)) is not None]

    # -- reporting ---------------------------------------------------------------------------------------------

    @property
    def num_clients(self) -> int:
        with self._clients_lock:
            return len(self._clients)

    def summaries(self) -> tuple[ClientSummary, ...]:
        with self._clients_lock:
            return tuple(
                ClientSummary(
                    client_id=s.client_id,
                    name=s.name,
                    pid=s.pid,
                    local=s.local,
                    num_open_plans=len(s.plans),
                    num_sessions=len(s.sessions()),
                    num_segments=len(s.segments),
                )
                for s in self._clients.values()
            )
