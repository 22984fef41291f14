"""``kvstore.Client``: a running ``kvstore serve`` behind the same surface as ``TieredStore``.

Over 600 lines on purpose: one class whose methods mirror ``TieredStore``'s, each with its contract in its docstring;
its bulk paths read the client's segments and the server's features, which a re-hello replaces, so they
stay beside them.

    with Client("tcp://127.0.0.1:5555", layout) as client:   # hello: registers the layout
        client.store(tokens, kv)                              # StoreResult
        with client.session() as session:
            plan = session.lookup(prompt)                     # LookupPlan: segments, gaps, plan_id
            result = session.retrieve(plan)                   # RetrieveResult: result.kv

Bulk KV takes the cheapest path the server offers: on the same host through shared memory (the client copies a
plain tensor into its scratch segment once, the server makes the tier copy; a tensor made by ``buffer()`` moves no
bytes on the client side at all), through CUDA IPC for CUDA tensors when server and client share a GPU host, and
inline in the message otherwise (remote clients).

Failures are the store's errors (``InvalidInputError``, ``LayoutMismatchError``, ``ConfigError`` for a plan
already retrieved, ...) plus ``ServerUnavailableError`` when no server answers within the timeout and
``ServerBusyError`` when it refuses new work. A server that restarted is detected (``not_registered``) and the
client says hello again and retries the request once; plans and buffers from before the restart are gone.

Threads: a client may be shared by threads; requests are serialised on one socket (``_request_lock``). For
parallel requests use one client per thread. A session ended by garbage collection while this thread is inside a
request is sent just before the next request.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from types import TracebackType

import numpy as np
import numpy.typing as npt
import torch

from kvstore.config import check_byte_count, tier_name
from kvstore.errors import (
    CapacityError,
    InvalidInputError,
    KVStoreError,
    ProtocolError,
    ServerUnavailableError,
    StorageError,
)
from kvstore.keys import PrefixKey, as_token_array, checked_keys
from kvstore.kv_part import KVPart
from kvstore.layout import KVLayout
from kvstore.pids import pid_alive
from kvstore.plan import UNPINNED_PLAN_ID, LookupPlan, RetrieveProgress, RetrieveResult, StoreResult
from kvstore.session import Session
from kvstore.stats import StoreStats
from kvstore.tiers.base import TierName
from kvstore.wire.client_segments import ClientSegments
from kvstore.wire.connection import Connection
from kvstore.wire.cuda_ipc import export_cuda_tensor
from kvstore.wire.documents import DocumentsArgs, DocumentsReport
from kvstore.wire.error_codes import ErrorCode, exception_for
from kvstore.wire.fields import Fields
from kvstore.wire.lent_kv import LentKV, lent_kv
from kvstore.wire.messages import (
    AttachArgs,
    BulkRef,
    ChunkArgs,
    CudaIpcBulk,
    DetachArgs,
    EvictArgs,
    HelloArgs,
    InlineBulk,
    LendArgs,
    LookupArgs,
    PlanArgs,
    RetrieveArgs,
    SessionArgs,
    ShmBulk,
    StoreArgs,
)
from kvstore.wire.protocol import Op, Reply
from kvstore.wire.shm import MappedArena, OwnedSegment, host_id, map_lent_arena, shm_available
from kvstore.wire.values import (
    ChunkInfo,
    RetrievedSegments,
    ServerHealth,
    ServerHello,
    ServerInfo,
    decode_stats,
    decode_store_result,
    loan_from_wire,
    plan_from_wire,
)

__all__ = ["Client"]

logger = logging.getLogger(__name__)

_Request = Callable[[], tuple[dict[str, object], memoryview | None]]


class Client:
    """A connection to a ``kvstore serve`` process.

    Args:
        url: the server's address (``kvstore serve`` prints it).
        layout: the model's KV layout; ``None`` makes an admin client (stats, info, evict, chunk, health, flush).
        timeout_s: how long to wait for any reply.
        connect_timeout_s: how long the first hello may take.
        transport: ``"auto"`` (shared memory when on the server's host, else inline), ``"shm"`` or ``"inline"``.
        name: shown by ``kvstore inspect --url``.
        server_pid: the server's process id, when the caller knows it (a server it started, on this host): a
            request to a server that has exited then fails at once instead of after ``timeout_s``.

    Raises:
        ServerUnavailableError: no server answered the hello.
        LayoutMismatchError: the server serves another layout.
    """

    def __init__(
        self,
        url: str = "tcp://127.0.0.1:5555",
        layout: KVLayout | None = None,
        *,
        timeout_s: float = 60.0,
        connect_timeout_s: float = 5.0,
        transport: str = "auto",
        name: str | None = None,
        server_pid: int | None = None,
    ) -> None:
        if transport not in ("auto", "shm", "inline"):
            raise InvalidInputError(f"transport {transport!r} must be auto, shm or inline")
        self.url = url
        self.layout = layout
        self.timeout_s = timeout_s
        self._transport = transport
        self._name = name or f"python pid {os.getpid()}"
        self._request_lock = threading.Lock()
        self._lock_owner: int | None = None
        self._deferred_sessions: list[str] = []
        self._closed = False
        self._connection = Connection(url, functools.partial(pid_alive, server_pid) if server_pid else None)
        self._client_id: str | None = None
        self._segments: ClientSegments | None = None
        self._inline_noted = False
        self._lent_arena: MappedArena | None = None  # the server's arena, once mapped
        self._lent_arena_failed = False
        try:
            with self._locked():
                self.server = self._hello(connect_timeout_s)
        except BaseException:
            self._connection.close()
            raise
        self._shm = self._choose_shm()
        if self._shm:
            assert layout is not None, "shared memory is only chosen for a client with a layout"
            self._segments = ClientSegments(layout, self._attach, self._detach)

    @property
    def client_token(self) -> str:
        """The server's secret name for this connection: another client of the same server given it may retrieve or
        release this client's plans (``retrieve(..., owner=token)``); a reconnected client has a new one."""
        assert self._client_id is not None, "hello sets the token before the client is handed out"
        return self._client_id

    @property
    def shares_memory(self) -> bool:
        """Whether KV moves through shared memory (``buffer()`` works): the server is on this host."""
        return self._segments is not None

    # -- plumbing ----------------------------------------------------------------------------------------------

    def _locked(self) -> _RequestLock:
        return _RequestLock(self)

    def _hello(self, timeout_s: float) -> ServerHello:
        args = HelloArgs(
            layout_json=self.layout.to_json() if self.layout is not None else None,
            client_name=self._name,
            pid=os.getpid(),
            host_id=host_id(),
        )
        reply = self._connection.request(Op.HELLO, None, args.to_wire(), None, timeout_s)
        hello = ServerHello.from_wire(self._result(reply))
        self._client_id = hello.client_id
        return hello

    def _choose_shm(self) -> bool:
        if self.layout is None or self._transport == "inline":
            return False
        usable = self.server.features.shm and self.server.host_id == host_id() and shm_available()
        if self._transport == "shm" and not usable:
            raise ServerUnavailableError(
                f"transport='shm' but the server at {self.url} is not on this host (or has no /dev/shm); use 'auto'"
            )
        return usable

    def _result(self, reply: Reply) -> Fields:
        if not reply.ok:
            raise exception_for(reply.error_code, reply.error_message)
        assert reply.result is not None, "decode_reply returned an ok reply without a result"
        return reply.result

    def _call(self, op: Op, build: _Request, timeout_s: float | None = None) -> Reply:
        """Send a request built by ``build`` (rebuilt after a re-hello: bulk references change) under the lock."""
        with self._locked():
            self._send_deferred()
            return self._call_locked(op, build, timeout_s)

    def _call_locked(self, op: Op, build: _Request, timeout_s: float | None = None) -> Reply:
        if self._closed:
            raise ServerUnavailableError("this Client was closed; create a new one")
        for attempt in range(2):
            args, payload = build()
            reply = self._connection.request(op, self._client_id, args, payload, timeout_s or self.timeout_s)
            if reply.ok or reply.error_code != ErrorCode.NOT_REGISTERED or attempt:
                return reply
            logger.info("server at %s does not know this client (it restarted?): saying hello again", self.url)
            self.server = self._hello(self.timeout_s)
            if self._segments is not None:
                self._segments.forget_server()
        raise AssertionError("unreachable: the second attempt always returns")

    def _simple(self, op: Op, args: dict[str, object] | None = None, timeout_s: float | None = None) -> Fields:
        return self._result(self._call(op, lambda: (args or {}, None), timeout_s))

    def _send_deferred(self) -> None:
        while self._deferred_sessions:
            args = SessionArgs(session_id=self._deferred_sessions.pop()).to_wire()
            self._call_locked(Op.END_SESSION, _fixed(args))

    def _attach(self, segment: OwnedSegment) -> int:
        assert segment.fd is not None, "a segment is attached once, while its descriptor is open"
        try:
            args = AttachArgs(name=segment.name, nbytes=segment.nbytes, fd=segment.fd).to_wire()
            fields = self._result(self._call_locked(Op.ATTACH, lambda: (args, None)))
            segment_id = fields.required_int("segment_id", 1, 2**31 - 1)
            fields.finish()
            return segment_id
        finally:
            segment.close_fd()  # the server holds its own mapping; a failed attach leaves only ours

    def _detach(self, segment_id: int) -> None:
        try:
            self._call_locked(Op.DETACH, lambda: (DetachArgs(segment_id=segment_id).to_wire(), None))
        except KVStoreError as exc:
            logger.debug("detach of segment %d failed: %s", segment_id, exc)

    def _require_layout(self) -> KVLayout:
        if self.layout is None:
            raise InvalidInputError("this is an admin Client (no layout); pass layout= to store or look up KV")
        return self.layout

    # -- bulk --------------------------------------------------------------------------------------------------

    def _shape_layout(self, part: KVPart | None) -> KVLayout:
        """The layout that shapes a call's KV: the client's, or a part's slice of it (checked to lie inside)."""
        layout = self._require_layout()
        if part is None:
            return layout
        part.check(layout)
        return part.shape_layout(layout)

    def _bulk_for_store(self, kv: torch.Tensor, num_tokens: int, layout: KVLayout) -> tuple[BulkRef, memoryview | None]:
        if kv.device.type == "cuda" and self.server.features.cuda_ipc and self._shm:
            return CudaIpcBulk(handle=export_cuda_tensor(kv)), None
        if self._segments is not None:
            region = self._segments.region_of(kv, num_tokens, layout)
            if region is not None:
                return region, None
            try:
                scratch, segment_id = self._segments.scratch(layout.chunk_bytes(num_tokens))
            except (StorageError, CapacityError) as exc:  # no memfd here, or the server maps as many as it may
                self._note_inline(exc)
            else:
                nbytes = layout.chunk_bytes(num_tokens)
                view = scratch[:nbytes].view(layout.dtype.torch_dtype).view(layout.chunk_shape(num_tokens))
                view.copy_(kv)
                return _shm(segment_id, nbytes), None
        data = kv.detach().to("cpu").contiguous()
        return InlineBulk(), memoryview(data.view(torch.uint8).numpy().data) if data.numel() else memoryview(b"")

    # -- the TieredStore surface -------------------------------------------------------------------------------

    def store(
        self,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        kv: torch.Tensor,
        *,
        durable: bool = False,
        start: int = 0,
        part: KVPart | None = None,
    ) -> StoreResult:
        """``TieredStore.store`` on the server; ``durable=True`` returns once the chunks are committed and synced
        to disk (the acknowledgement survives a crash of the server).

        With ``start`` (in ``[0, len(tokens)]``), ``kv`` is the KV of ``tokens[start:]`` only, ``[num_layers, 2,
        len(tokens) - start, num_kv_heads, head_dim]``, and only those bytes travel; the chunks that begin before
        ``start`` are not written (the caller knows the server holds them).

        With ``part`` (a tensor- or pipeline-parallel rank's layers and global KV heads), ``kv`` is that part only,
        ``[part layers, 2, tokens, part heads, head_dim]``: the server assembles each chunk from its parts and
        commits it whole once every part has arrived (``durable`` then covers the chunks this call completed). The
        result counts the chunks committed by this call; a chunk still waiting for other parts is not stored yet.
        """
        layout = self._shape_layout(part)
        token_array = as_token_array(tokens)
        if not 0 <= start <= len(token_array):
            raise InvalidInputError(f"store start={start} must lie in [0, len(tokens)={len(token_array)}]")
        num_tokens = len(token_array) - start
        layout.check_kv(kv, num_tokens)
        wire_part = None if part is None or part.is_whole(self._require_layout()) else part

        def build() -> tuple[dict[str, object], memoryview | None]:
            bulk, payload = self._bulk_for_store(kv, num_tokens, layout)
            args = StoreArgs(tokens=token_array, bulk=bulk, durable=durable, start=start, part=wire_part)
            return args.to_wire(), payload

        reply = self._call(Op.STORE, build)
        if start and not reply.ok and "unknown field(s) 'start'" in reply.error_message:
            raise ProtocolError(
                f"the server at {self.url} (version {self.server.server_version}) predates store(start=); upgrade "
                "it, or send the KV of every token with start=0"
            )
        return decode_store_result(self._result(reply))

    def lookup(
        self,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        *,
        session_id: str | None = None,
        blend: bool | None = None,
        timeout_s: float | None = None,
        pin: bool = True,
        repeat: bool = False,
        partial: bool = True,
    ) -> LookupPlan:
        """``TieredStore.lookup`` on the server: the plan's chunks stay pinned there until retrieve, release or
        the session's end (or the client's death or goodbye). ``timeout_s`` (default: the client's) bounds the wait
        for this reply alone: a lookup is quick, so a caller on an engine's path may give up on a hung server sooner
        than on a long transfer. ``pin=False`` only looks: the server drops the pins before it answers, and the plan
        (``plan_id`` ``UNPINNED_PLAN_ID``) cannot be retrieved; releasing it is a no-op (no round trip).
        ``repeat=True``: this request's prompt was looked up before; the server plans it but does not count it again
        in its hit and miss figures (``kvstore inspect``), which count requests. ``partial``: the plan may hold
        slices of stored chunks (``Segment.is_slice``), where the server plans them (its hello's
        ``partial_segments``; a server from before them plans none)."""
        self._require_layout()
        args = LookupArgs(
            tokens=as_token_array(tokens),
            session_id=session_id,
            blend=blend,
            pin=pin,
            repeat=repeat,
            partial=partial and self.server.partial_segments,
        ).to_wire()
        return plan_from_wire(self._simple(Op.LOOKUP, args, timeout_s))

    def retrieve(
        self,
        plan: LookupPlan,
        out: torch.Tensor | None = None,
        *,
        device: str | torch.device = "cpu",
        progress: RetrieveProgress | None = None,
        memory_only: bool = False,
        owner: str | None = None,
        start: int = 0,
        part: KVPart | None = None,
        readers: int = 1,
    ) -> RetrieveResult:
        """``TieredStore.retrieve`` on the server. ``out`` made by ``buffer()`` (or a CUDA tensor, with CUDA IPC)
        is written by the server directly; otherwise the KV lands in the scratch segment and is copied out.

        The server moves the KV in one piece, so ``progress`` hears of the segments and of every layer at once,
        after the whole retrieve.

        ``owner``: the ``client_token`` of the client that looked the plan up, when that is another client (one
        process pins, another loads: a vLLM scheduler and its worker); the KV still lands in this client's memory.
        ``start``: the tokens ``[0, start)`` are the caller's already (an engine's own prefix cache); only
        ``[start, plan.end)`` is moved, and ``out`` holds just those.
        ``part``: only this part of every chunk (a tensor- or pipeline-parallel rank's layers and global KV heads) is
        moved, and ``out`` (and the result's KV) is shaped by it. ``readers``: the plan is handed to that many ranks,
        each of which retrieves it (or releases it with the same ``readers``); it stays pinned until all have."""
        layout = self._shape_layout(part)
        wire_part = None if part is None or part.is_whole(self._require_layout()) else part
        if not 0 <= start <= plan.end:
            raise InvalidInputError(f"retrieve start {start} is outside the plan's [0, {plan.end}]")
        needed = plan.end - start
        if out is not None and (out.dim() != 5 or out.shape[2] < needed):
            raise InvalidInputError(
                f"out shape {list(out.shape)} cannot hold the plan's {needed} tokens; "
                f"expected {list(layout.chunk_shape(needed))} (or more tokens)"
            )
        if out is not None:
            layout.check_kv(out[:, :, :needed], needed)
        staged: list[torch.Tensor] = []

        def build() -> tuple[dict[str, object], memoryview | None]:
            staged.clear()
            bulk = self._bulk_for_retrieve(out, needed, staged, layout)
            args = RetrieveArgs(
                plan_id=plan.plan_id,
                bulk=bulk,
                memory_only=memory_only,
                owner=owner,
                start=start,
                part=wire_part,
                readers=readers,
            )
            return args.to_wire(), None

        reply = self._call(Op.RETRIEVE, build)
        loaded = RetrievedSegments.from_wire(self._result(reply))
        kv = self._landed_kv(max(0, loaded.end - start), out, device, staged, reply.payload, layout)
        if progress is not None:
            progress.segments_loaded(loaded.segments)
            for layer in range(layout.num_layers):
                progress.layer_queued(layer)
        return RetrieveResult(
            segments=loaded.segments, num_query_tokens=loaded.num_query_tokens, kv=kv, start=start, misses=loaded.misses
        )

    def _bulk_for_retrieve(
        self, out: torch.Tensor | None, needed: int, staged: list[torch.Tensor], layout: KVLayout
    ) -> BulkRef:
        if out is not None and out.device.type == "cuda" and self.server.features.cuda_ipc and self._shm:
            return CudaIpcBulk(handle=export_cuda_tensor(out))
        if self._segments is not None:
            if out is not None and (region := self._segments.region_of(out, needed, layout)) is not None:
                return region
            try:
                scratch, segment_id = self._segments.scratch(layout.chunk_bytes(needed))
            except (StorageError, CapacityError) as exc:  # no memfd here, or the server maps as many as it may
                self._note_inline(exc)
            else:
                # The server lays the scratch out for the plan's length, layer-major; the reply may serve fewer
                # tokens, and those are the first tokens of every layer in this shape, not the first bytes.
                nbytes = layout.chunk_bytes(needed)
                staged.append(scratch[:nbytes].view(layout.dtype.torch_dtype).view(layout.chunk_shape(needed)))
                return _shm(segment_id, nbytes)
        return InlineBulk()

    def _note_inline(self, exc: KVStoreError) -> None:
        """Say once (then at debug level) that KV goes inline because no shared segment could be had."""
        level = logging.DEBUG if self._inline_noted else logging.WARNING
        self._inline_noted = True
        logger.log(level, "shared memory unavailable (%s); moving KV inline", exc)

    def _landed_kv(
        self,
        end: int,
        out: torch.Tensor | None,
        device: str | torch.device,
        staged: list[torch.Tensor],
        payload: memoryview | None,
        layout: KVLayout,
    ) -> torch.Tensor:
        """The retrieved KV as the caller wants it (``end`` tokens from the retrieve's start, shaped by ``layout``):
        a view of ``out``, or a new tensor on ``device``."""
        if staged:  # the server wrote into the scratch segment, laid out for the plan's length
            source = staged[0][:, :, :end]
        elif payload is not None:  # inline
            if len(payload) != layout.chunk_bytes(end):
                raise InvalidInputError(f"inline reply has {len(payload)} bytes for {end} tokens")
            if payload.readonly:  # ZeroMQ frames are writable; anything else gets one copy (torch needs writable)
                payload = memoryview(bytearray(payload))
            raw = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
            source = raw.view(layout.dtype.torch_dtype).view(layout.chunk_shape(end))
        else:  # written in place (a buffer region or a CUDA tensor)
            assert out is not None, "the server wrote in place but there is no out tensor"
            return out[:, :, :end]
        if out is not None:
            out[:, :, :end].copy_(source)
            return out[:, :, :end]
        if payload is not None and torch.device(device).type == "cpu":
            return source  # the reply frame's memory is this tensor's own
        return source.to(device, copy=True)

    def lend(
        self,
        plan: LookupPlan,
        *,
        owner: str | None = None,
        start: int = 0,
        part: KVPart | None = None,
        readers: int = 1,
    ) -> LentKV | None:
        """Have the server lend the plan's chunks from ``start`` instead of copying them (``TieredStore.lend``): views
        of its shared cpu arena, mapped read-only, for the caller's one copy. ``None`` when the server does not lend
        (no shared arena, another host, a chunk outside the cpu tier): the plan is untouched, retrieve it instead.
        Once lent, the plan stays pinned until ``return_loan`` (with the same ``owner``), which counts as one of
        its ``readers`` retrieving it. Arguments as for ``retrieve``."""
        layout = self._require_layout()
        if self.server.lent_arena is None or self._segments is None or self._lent_arena_failed:
            return None
        if not 0 <= start <= plan.end:
            raise InvalidInputError(f"lend start {start} is outside the plan's [0, {plan.end}]")
        wire_part = None if part is None or part.is_whole(layout) else part
        args = LendArgs(plan_id=plan.plan_id, owner=owner, start=start, part=wire_part, readers=readers).to_wire()
        loan = loan_from_wire(self._simple(Op.LEND, args), start)
        if loan is None:
            return None
        try:
            return lent_kv(self._mapped_arena(), loan, layout, part)
        except StorageError as exc:  # the arena cannot be mapped here: retrieve from now on
            logger.warning("cannot read the server's cpu tier directly (%s); loads are copied by the server", exc)
            self.return_loan(plan, owner=owner)
            return None
        except InvalidInputError:
            self.return_loan(plan, owner=owner)
            raise

    def _mapped_arena(self) -> MappedArena:
        """The server's arena, mapped once per server (a restarted server has another)."""
        arena = self.server.lent_arena
        assert arena is not None, "a server lends only when its hello names its arena"
        if self._lent_arena is None or self._lent_arena.name != arena.name:
            try:
                self._lent_arena = map_lent_arena(arena.name, arena.nbytes, arena.pid, arena.fd)
            except StorageError:
                self._lent_arena_failed = True  # another pid namespace, most likely: retrieve from now on
                raise
        return self._lent_arena

    def return_loan(self, plan: LookupPlan, *, owner: str | None = None) -> None:
        """Hand back a lent plan (``lend``) once its KV is copied: the views must not be read after this."""
        self._simple(Op.RETURN, PlanArgs(plan_id=plan.plan_id, owner=owner).to_wire())

    def release(self, plan: LookupPlan, *, owner: str | None = None, readers: int = 1) -> None:
        """Drop the pins of a plan that will not be retrieved. Idempotent. ``owner``: as for ``retrieve``.
        ``readers``: the plan is shared by that many ranks (``retrieve(readers=)``) and this one will not retrieve
        it; the pins go once every reader has retrieved or released it."""
        if plan.plan_id == UNPINNED_PLAN_ID:
            return
        try:
            self._simple(Op.RELEASE, PlanArgs(plan_id=plan.plan_id, owner=owner, readers=readers).to_wire())
        except KVStoreError as exc:
            if "already retrieved or released" not in str(exc):
                raise

    def end_session(self, session_id: str) -> None:
        """Release every plan of a session that was not retrieved or released. Idempotent."""
        if self._closed:
            return
        if self._lock_owner == threading.get_ident():  # garbage collection inside one of our requests
            self._deferred_sessions.append(session_id)
            return
        self._simple(Op.END_SESSION, SessionArgs(session_id=session_id).to_wire())

    def session(self, session_id: str | None = None) -> Session:
        """A session whose end (``close``, a ``with`` block, or garbage collection) releases its plans."""
        return Session(self, session_id)

    def buffer(self, num_tokens: int, *, part: KVPart | None = None) -> torch.Tensor:
        """A KV tensor ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]`` in shared memory the server maps:
        storing from it, or retrieving into it, copies nothing on the client side. With ``part`` it is shaped by
        the part (``[part layers, 2, num_tokens, part heads, head_dim]``), for stores and retrieves of that part.

        Raises:
            ServerUnavailableError: the server is not on this host (no shared memory).
        """
        layout = self._shape_layout(part)
        if self._segments is None:
            raise ServerUnavailableError(f"buffers need shared memory with the server, and {self.url} is remote")
        segments = self._segments
        with self._locked():
            return segments.new_buffer(num_tokens, layout)

    def release_buffer(self, buffer: torch.Tensor) -> bool:
        """Stop sharing a ``buffer()`` with the server (its memory goes once the caller drops the tensor too);
        ``False`` when it is not one of this client's buffers."""
        segments = self._segments
        if segments is None:
            return False
        with self._locked():
            return segments.release_buffer(buffer)

    def flush(self) -> None:
        """Block until every pending disk write on the server is committed and synced."""
        self._simple(Op.FLUSH)

    def stats(self) -> StoreStats:
        """The server store's ``StoreStats``."""
        return decode_stats(self._simple(Op.STATS))

    def evict(self, keys: Sequence[PrefixKey]) -> int:
        """Drop chunks from every tier (pinned copies stay); returns the chunk copies dropped."""
        fields = self._simple(Op.EVICT, EvictArgs(keys=tuple(checked_keys(keys))).to_wire())
        num_evicted = fields.required_int("num_evicted", 0, 2**63 - 1)
        fields.finish()
        return num_evicted

    def evict_bytes(self, num_bytes: int, tier: TierName | str) -> int:
        """Free ``num_bytes`` of one tier (``"cpu"`` or ``TierName.CPU``), least recently used first; returns
        bytes freed."""
        check_byte_count(num_bytes)
        fields = self._simple(Op.EVICT, EvictArgs(num_bytes=num_bytes, tier=tier_name(tier)).to_wire())
        freed = fields.required_int("freed_bytes", 0, 2**63 - 1)
        fields.finish()
        return freed

    def chunk(self, key: PrefixKey) -> ChunkInfo:
        """Which tiers hold a chunk, and how many lookups planned it."""
        return ChunkInfo.from_wire(self._simple(Op.CHUNK, ChunkArgs(key=key).to_wire()))

    def documents(self, top: int = 10) -> DocumentsReport:
        """The ``top`` (1..1000) most-hit stored documents and the tiers holding them (``kvstore inspect``).

        Raises:
            ProtocolError: the server predates document hit counts (it answers ``unknown_op``).
        """
        reply = self._call(Op.DOCUMENTS, lambda: (DocumentsArgs(top=top).to_wire(), None))
        if not reply.ok and reply.error_code == ErrorCode.UNKNOWN_OP:
            raise ProtocolError(
                f"the server at {self.url} (version {self.server.server_version}) does not count document hits; "
                "upgrade it to a kvstore with the documents operation"
            )
        return DocumentsReport.from_wire(self._result(reply))

    def health(self, timeout_s: float = 5.0) -> ServerHealth:
        """The server's status (no layout needed)."""
        return ServerHealth.from_wire(self._simple(Op.HEALTH, timeout_s=timeout_s))

    def info(self) -> ServerInfo:
        """The server's settings, layout, clients and most-hit chunks."""
        return ServerInfo.from_wire(self._simple(Op.INFO))

    def close(self, *, goodbye: bool = True) -> None:
        """Say goodbye (the server releases this client's plans and segments) and close. Idempotent.

        ``goodbye=False`` closes at once, for a server known to be gone (the server then releases what this client
        held when it notices the client's process or idle time, as for a client that died)."""
        if self._closed:
            return
        try:
            if goodbye:
                with self._locked():
                    self._send_deferred()
                    self._call_locked(Op.GOODBYE, lambda: ({}, None), min(self.timeout_s, 2.0))
        except KVStoreError as exc:
            logger.debug("goodbye to %s failed: %s", self.url, exc)
        finally:
            self._closed = True
            if self._segments is not None:
                self._segments.close()
            self._connection.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def _fixed(args: dict[str, object]) -> _Request:
    """A request builder that always sends ``args`` (no bulk to re-resolve after a re-hello)."""
    return lambda: (args, None)


def _shm(segment_id: int, nbytes: int) -> BulkRef:
    return ShmBulk(segment_id=segment_id, offset=0, nbytes=nbytes)


class _RequestLock:
    """The client's request lock, remembering its owner thread (so a GC-time ``end_session`` can defer)."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def __enter__(self) -> None:
        me = threading.get_ident()  # before acquiring: nothing between acquire and the owner's assignment allocates
        self._client._request_lock.acquire()
        self._client._lock_owner = me

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._client._lock_owner = None
        self._client._request_lock.release()
