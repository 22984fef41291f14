"""What the server does for each operation: a request in, reply frames out, never an exception.

``RequestHandler.handle`` parses the op's arguments, checks the client, runs the op against the store and encodes
the result. Every failure becomes an error reply: ``RequestError`` and kvstore errors by their code
(``errors.error_for``), anything else as ``internal`` after ``logger.exception`` (a server bug; counted in
``kvstore_requests_total{outcome="internal"}``).

Bulk KV (``bulk`` argument) is resolved to a tensor (``bulk_tensors``): a view of a client's shared-memory segment,
a view of the inline payload frame, or an opened CUDA IPC handle; the store then makes its one copy (into a tier on
store, into that tensor on retrieve). A store's result says what became of each chunk, so the document it names and
the engine's stored tokens are read from it, not asked of the tiers again.

Metrics (``metrics``) are fed here too, globally and per engine: a client with a layout counts under its hello
name (``ServerMetrics.add_client`` at hello, ``forget_client`` at its departure, whichever way it departs).

Chunks stored by parts (the ranks of a tensor- or pipeline-parallel engine: a store or retrieve with a ``part``) go
through ``PartStores`` (``handlers_parts``, over ``ChunkAssembly``): a part store's chunks are committed to the store
whole, once their last part arrives; a part retrieve copies only the part's slice of each chunk; a plan its
``readers`` ranks share stays pinned until each of them has retrieved or released it
(``ClientRegistry.begin_shared``); a lookup names the chunks waiting for parts ``incomplete``.

Usage (``kvstore.server.usage.UsageLedger``) is fed here: each store names a document, each lookup plan counts its
hits per chunk and per document. With a data dir document counts are loaded at start, saved by the janitor every
``documents_save_interval_s`` while they change, and saved at shutdown (``save_document_hits``).

Threads: any number of workers call ``handle`` concurrently; all state lives in the store, the client registry, the
usage ledger and the part stores, each with its own locks. ``janitor_pass`` runs on the janitor thread.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore.errors import ConfigError, KVStoreError
from kvstore.kv_part import KVPart
from kvstore.layout import KVLayout
from kvstore.plan import UNPINNED_PLAN_ID, LookupPlan
from kvstore.server.bulk_tensors import bulk_tensor, transport_of
from kvstore.server.clients import ClientRegistry, Departure, store_session_id
from kvstore.server.handlers_parts import PartStores, written_tokens
from kvstore.server.metrics import BulkTransfer, ServerMetrics
from kvstore.server.store_host import StoreHost
from kvstore.server.usage.documents import DocumentHits
from kvstore.server.usage.ledger import UsageLedger
from kvstore.store import TieredStore
from kvstore.tiers.base import TierName
from kvstore.wire.documents import DocumentsArgs, DocumentsReport
from kvstore.wire.error_codes import ErrorCode, RequestError, error_for
from kvstore.wire.messages import (
    AttachArgs,
    BulkRef,
    ChunkArgs,
    DetachArgs,
    EvictArgs,
    HelloArgs,
    InlineBulk,
    LendArgs,
    LookupArgs,
    PlanArgs,
    RetrieveArgs,
    SessionArgs,
    StoreArgs,
    layout_from_json,
)
from kvstore.wire.protocol import Limits, Op, Request, encode_error, encode_ok
from kvstore.wire.shm import open_segment
from kvstore.wire.values import (
    ChunkHits,
    ChunkInfo,
    LentArena,
    ServerFeatures,
    ServerHealth,
    ServerHello,
    ServerInfo,
    encode_loan,
    encode_plan,
    encode_retrieve_result,
    encode_stats,
    encode_store_result,
)

__all__ = ["ReplyFrames", "RequestHandler", "ServerIdentity"]

logger = logging.getLogger(__name__)

_NUM_TOP_CHUNKS = 20


@dataclass(frozen=True, slots=True)
class ReplyFrames:
    """A reply ready to send: the header and, for an inline retrieve, the KV bytes."""

    header: bytes
    payload: memoryview | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerIdentity:
    """What a server says about itself in hello, info and health replies."""

    version: str
    host_id: str
    pid: int
    started_s: float
    limits: Limits
    shm: bool
    data_dir: str | None


class RequestHandler:
    """Runs operations against the server's store.

    Args:
        host: owns the store (and decides its layout).
        clients: who is registered and what each holds.
        identity: version, host and limits for replies.
        metrics: where request figures go.
        is_serving: ``False`` once the server is stopping (health reports it).
        documents: the document hit counts (a fresh ``DocumentHits`` unless given).
        documents_save_interval_s: how often the janitor saves changed document hit counts into the data dir.
    """

    def __init__(
        self,
        host: StoreHost,
        clients: ClientRegistry,
        identity: ServerIdentity,
        metrics: ServerMetrics,
        is_serving: Callable[[], bool],
        *,
        documents: DocumentHits | None = None,
        documents_save_interval_s: float = 60.0,
    ) -> None:
        self._host = host
        self._clients = clients
        self._identity = identity
        self._metrics = metrics
        self._is_serving = is_serving
        self._num_requests = 0  # approximate under concurrency; only reported
        data_dir = Path(identity.data_dir) if identity.data_dir is not None else None
        self._usage = UsageLedger(data_dir, documents=documents, save_interval_s=documents_save_interval_s)
        self._parts = PartStores(host, self._usage, metrics)

    # -- entry point -------------------------------------------------------------------------------------------

    def handle(self, request: Request) -> ReplyFrames:
        """Answer one decoded request."""
        self._num_requests += 1
        op = request.op
        try:
            reply = self._dispatch(request)
        except RequestError as exc:
            return self.error_reply(op.value, request.request_id, exc)
        except KVStoreError as exc:
            return self.error_reply(op.value, request.request_id, error_for(exc))
        except Exception as exc:  # the request boundary: a bug must not kill the worker
            logger.exception("internal error in %s (request %d)", op.value, request.request_id)
            failure = RequestError(ErrorCode.INTERNAL, f"internal server error in {op.value}: {type(exc).__name__}")
            return self.error_reply(op.value, request.request_id, failure)
        self._metrics.requests.labels(op.value, "ok").inc()
        return reply

    def error_reply(self, op: str, request_id: int | None, error: RequestError) -> ReplyFrames:
        """An error reply, counted (also used by the I/O loop for requests that never reach a worker)."""
        self._metrics.requests.labels(op, error.code.value).inc()
        logger.debug("request %s %s failed: %s %s", op, request_id, error.code.value, error.message)
        return ReplyFrames(encode_error(request_id, error.code, error.message))

    def _dispatch(self, request: Request) -> ReplyFrames:
        op, args, client_id = request.op, request.args, request.client_id
        limits = self._identity.limits
        if request.payload is not None and op is not Op.STORE:
            raise RequestError(ErrorCode.MALFORMED, f"{op.value} takes no payload frame")
        if op is Op.HEALTH:
            args.finish()
            return self._ok(request, self.health().to_wire())
        if op is Op.HELLO:
            return self._ok(request, self._hello(HelloArgs.parse(args, limits)))
        needs_layout = op in (Op.STORE, Op.LOOKUP, Op.RETRIEVE, Op.LEND, Op.RETURN, Op.RELEASE, Op.END_SESSION)
        self._clients.touch(client_id, needs_layout=needs_layout)
        assert client_id is not None, "ClientRegistry.touch accepted a request without a client id"
        if op is Op.STORE:
            store_args = StoreArgs.parse(args, limits)
            if store_args.part is not None:
                return self._ok(request, self._store_part(client_id, store_args, store_args.part, request.payload))
            return self._ok(request, self._store(client_id, store_args, request.payload))
        if op is Op.LOOKUP:
            return self._ok(request, self._lookup(client_id, LookupArgs.parse(args, limits)))
        if op is Op.RETRIEVE:
            return self._retrieve(request, client_id, RetrieveArgs.parse(args, limits))
        if op is Op.LEND:
            return self._ok(request, self._lend(client_id, LendArgs.parse(args, limits)))
        if op is Op.RETURN:
            plan_args = PlanArgs.parse(args, limits)
            done = self._clients.end_loan(client_id, plan_args.owner or client_id, plan_args.plan_id)
            if done is not None:
                self._host.require().release(done.plan)
            return self._ok(request, {})
        if op is Op.RELEASE:
            plan_args = PlanArgs.parse(args, limits)
            owner = plan_args.owner or client_id
            if plan_args.readers > 1:  # one of the ranks sharing the plan will not retrieve it
                self._clients.begin_shared(owner, plan_args.plan_id, plan_args.readers)
                done = self._clients.end_shared(owner, plan_args.plan_id)
                if done is not None:
                    self._host.require().release(done.plan)
                return self._ok(request, {})
            open_plan = self._clients.take_plan(owner, plan_args.plan_id)
            self._host.require().release(open_plan.plan)
            return self._ok(request, {})
        if op is Op.END_SESSION:
            session_id = SessionArgs.parse(args, limits).session_id
            self._clients.take_session(client_id, session_id)
            self._host.require().end_session(store_session_id(client_id, session_id))
            return self._ok(request, {})
        if op is Op.EVICT:
            return self._ok(request, self._evict(EvictArgs.parse(args, limits)))
        if op is Op.CHUNK:
            key = ChunkArgs.parse(args, limits).key
            tiers = tuple(self._host.require().contains(key))
            return self._ok(request, ChunkInfo(key=key.hex(), tiers=tiers, hits=self._usage.chunk_hits(key)).to_wire())
        if op is Op.ATTACH:
            attach = AttachArgs.parse(args, limits)
            segment = open_segment(attach.name, attach.nbytes, attach.fd, self._clients.client_pid(client_id))
            return self._ok(request, {"segment_id": self._clients.add_segment(client_id, segment)})
        if op is Op.DOCUMENTS:
            return self._ok(request, self._top_documents(DocumentsArgs.parse(args, limits).top).to_wire())
        if op is Op.DETACH:
            detached = self._clients.remove_segment(client_id, DetachArgs.parse(args, limits).segment_id)
            return self._ok(request, {"detached": detached})
        args.finish()
        if op is Op.FLUSH:
            self._host.require().flush()
            return self._ok(request, {})
        if op is Op.STATS:
            store = self._host.store
            return self._ok(request, encode_stats(store.stats()) if store is not None else _empty_stats())
        if op is Op.INFO:
            return self._ok(request, self.info().to_wire())
        assert op is Op.GOODBYE, f"op {op} has no handler: add it to RequestHandler._dispatch"
        departure = self._clients.remove(client_id)
        if departure is not None:
            self.give_back(departure)
        return self._ok(request, {})

    def _ok(self, request: Request, result: dict[str, object]) -> ReplyFrames:
        return ReplyFrames(encode_ok(request.request_id, result))

    # -- operations --------------------------------------------------------------------------------------------

    def _hello(self, args: HelloArgs) -> dict[str, object]:
        layout = None
        if args.layout_json is not None:
            layout = self._host.register(layout_from_json(args.layout_json)).layout
        local = bool(args.host_id) and args.host_id == self._identity.host_id
        client_id = self._clients.register(args.client_name, args.pid, local, has_layout=layout is not None)
        if layout is not None:  # admin clients never store or look up: they take no engine label
            self._metrics.add_client(client_id, args.client_name)
        logger.info(
            "client %s registered: %s pid %d (%s)%s", client_id, args.client_name, args.pid,
            "local" if local else "remote", "" if layout is not None else ", admin",
        )  # fmt: skip
        return ServerHello(
            client_id=client_id,
            server_version=self._identity.version,
            layout=self._host.layout,
            chunk_size=self._host.config.chunk_size,
            chunk_separator=self._host.config.chunk_separator,
            chunking=self._host.config.chunking,
            partial_segments=True,
            tiers=self._host.tier_capacities(),
            features=self._features(),
            limits=self._identity.limits,
            host_id=self._identity.host_id,
            lent_arena=self._lent_arena() if local else None,
        ).to_wire()

    def _lent_arena(self) -> LentArena | None:
        """The store's shared cpu arena, for a client on this host to map (``None`` when there is none)."""
        store = self._host.store
        arena = store.shared_arena if store is not None else None
        if arena is None or arena.fd is None:
            return None
        return LentArena(name=arena.name, nbytes=arena.nbytes, pid=os.getpid(), fd=arena.fd)

    def _store(self, client_id: str, args: StoreArgs, payload: memoryview | None) -> dict[str, object]:
        store = self._host.require()
        started_s = time.perf_counter()
        num_tokens = args.num_bulk_tokens  # the bulk holds tokens[start:]
        kv = self._bulk_tensor(client_id, args.bulk, store.layout, num_tokens, payload)[:, :, :num_tokens]
        if args.durable and TierName.DISK not in store.config.tiers:
            raise ConfigError("durable=True needs a disk tier; this server keeps KV in memory only")
        result = store.store(args.tokens, kv, start=args.start)
        if args.durable:
            store.flush()
        # A document is what this call added: the chunks from start (the caller knows the head is held).
        chunks = result.chunks
        first_start = chunks[0].start if chunks else len(args.tokens)
        tail_bounds = [0, *(chunk.end - first_start for chunk in chunks)]
        self._usage.stored([chunk.key for chunk in chunks], args.tokens[first_start:], tail_bounds)
        num_new_tokens = written_tokens(result)
        transfer = BulkTransfer(
            transport=transport_of(args.bulk),
            seconds=time.perf_counter() - started_s,
            num_bulk_bytes=store.layout.chunk_bytes(num_tokens),
            num_tokens=num_new_tokens,
            num_bytes=store.layout.chunk_bytes(num_new_tokens),
        )
        self._metrics.observe_store(transfer, self._metrics.engine_of(client_id))
        return encode_store_result(result)

    def _store_part(
        self, client_id: str, args: StoreArgs, part: KVPart, payload: memoryview | None
    ) -> dict[str, object]:
        """A rank's part of a store (``handlers_parts``)."""
        layout = self._host.require().layout
        part.check(layout)
        started_s = time.perf_counter()
        num_tokens = args.num_bulk_tokens
        kv = self._bulk_tensor(client_id, args.bulk, part.shape_layout(layout), num_tokens, payload)
        result = self._parts.store(client_id, args, part, kv[:, :, :num_tokens], started_s=started_s)
        return encode_store_result(result)

    def _lookup(self, client_id: str, args: LookupArgs) -> dict[str, object]:
        store = self._host.require()
        started_s = time.perf_counter()
        session = store_session_id(client_id, args.session_id) if args.session_id is not None else None
        plan = store.lookup(
            args.tokens, session_id=session, blend=args.blend, repeat=args.repeat, partial=args.partial
        )
        if not args.pin:  # a look only: the pins go now, and the reply names no plan to retrieve or release
            store.release(plan)
            plan = dataclasses.replace(plan, plan_id=UNPINNED_PLAN_ID, prefetches=())
        elif not self._clients.add_plan(client_id, plan, args.session_id):
            store.release(plan)
            raise RequestError(ErrorCode.NOT_REGISTERED, "the client said goodbye during its lookup")
        plan = self._parts.name_incomplete(plan, args.tokens)
        engine = self._metrics.engine_of(client_id)
        if args.repeat:  # the request was counted at its first lookup
            self._metrics.observe_repeat_lookup(time.perf_counter() - started_s, engine)
        else:
            coverage = self._usage.planned(plan, args.tokens, store.config.chunk_size)
            self._metrics.observe_lookup(coverage, time.perf_counter() - started_s, engine)
        return encode_plan(plan, args.session_id)

    def _retrieve(self, request: Request, client_id: str, args: RetrieveArgs) -> ReplyFrames:
        store = self._host.require()
        started_s = time.perf_counter()
        owner, part, shared = args.owner or client_id, args.part, args.readers > 1
        if part is not None:
            part.check(store.layout)
        if shared:  # the ranks of a parallel engine each retrieve the plan: the pins go once all of them have
            plan = self._clients.begin_shared(owner, args.plan_id, args.readers).plan
        else:
            plan = self._clients.take_plan(owner, args.plan_id).plan  # the bulk is the caller's
        try:
            out = self._retrieve_target(client_id, args, store, plan)
            result = store.retrieve(
                plan, out, memory_only=args.memory_only, start=args.start, part=part, keep_pins=shared
            )
        except BaseException as exc:
            if not shared and not isinstance(exc, ConfigError):
                store.release(plan)  # the plan left the registry: its pins must not leak
            if isinstance(exc, ConfigError):  # its session ended between our registry and the store's ledger
                raise RequestError(ErrorCode.UNKNOWN_PLAN, str(exc)) from None
            raise
        finally:
            if shared and (done := self._clients.end_shared(owner, args.plan_id)) is not None:
                store.release(done.plan)
        if out is not None and out.device.type == "cuda":
            torch.cuda.synchronize(out.device)  # the client may use its tensor as soon as the reply arrives
        reply = encode_retrieve_result(result)
        num_loaded_tokens = result.num_cached_tokens
        shape = store.layout if part is None else part.shape_layout(store.layout)
        transfer = BulkTransfer(
            transport=transport_of(args.bulk),
            seconds=time.perf_counter() - started_s,
            num_bulk_bytes=shape.chunk_bytes(int(result.kv.shape[2])),
            num_tokens=num_loaded_tokens,
            num_bytes=shape.chunk_bytes(num_loaded_tokens),
        )
        self._metrics.observe_retrieve(transfer, self._metrics.engine_of(client_id))
        payload = None
        if isinstance(args.bulk, InlineBulk):
            kv = result.kv.contiguous()
            payload = memoryview(kv.view(torch.uint8).numpy().data) if kv.numel() else memoryview(b"")
        return ReplyFrames(encode_ok(request.request_id, reply), payload)

    def _lend(self, client_id: str, args: LendArgs) -> dict[str, object]:
        """Name where a plan's chunks lie in the shared cpu arena (``TieredStore.lend``), the plan kept pinned for the
        client until it returns it; ``{"lent": False}``, the plan untouched, when some chunk is elsewhere."""
        store = self._host.require()
        started_s = time.perf_counter()
        owner = args.owner or client_id
        if args.part is not None:
            args.part.check(store.layout)
        if store.shared_arena is None or not self._clients.is_local(client_id):
            return encode_loan(None)
        plan = self._clients.begin_loan(client_id, owner, args.plan_id, args.readers).plan
        loan = None
        try:
            loan = store.lend(plan, start=args.start)
        except ConfigError as exc:  # its session ended between our registry and the store's ledger
            raise RequestError(ErrorCode.UNKNOWN_PLAN, str(exc)) from None
        finally:
            if loan is None and (orphan := self._clients.cancel_loan(client_id, owner, args.plan_id)) is not None:
                store.release(orphan.plan)
        if loan is None:
            return encode_loan(None)
        shape = store.layout if args.part is None else args.part.shape_layout(store.layout)
        num_tokens = sum(segment.end - max(segment.start, args.start) for segment in loan.segments)
        transfer = BulkTransfer(
            transport="lent",
            seconds=time.perf_counter() - started_s,
            num_bulk_bytes=0,
            num_tokens=num_tokens,
            num_bytes=shape.chunk_bytes(num_tokens),
        )
        self._metrics.observe_retrieve(transfer, self._metrics.engine_of(client_id))
        return encode_loan(loan)

    def _retrieve_target(
        self, client_id: str, args: RetrieveArgs, store: TieredStore, plan: LookupPlan
    ) -> torch.Tensor | None:
        """Where a retrieve writes tokens ``[start, plan end)``: a client's region or tensor, or ``None`` (inline:
        the store allocates), shaped by the retrieve's part when it has one."""
        layout = store.layout if args.part is None else args.part.shape_layout(store.layout)
        if args.start > plan.end:
            raise RequestError(
                ErrorCode.INVALID_ARGUMENT, f"retrieve start {args.start} is past the plan's end ({plan.end})"
            )
        num_tokens = plan.end - args.start
        if isinstance(args.bulk, InlineBulk):
            limit = self._identity.limits.max_payload_bytes
            if layout.chunk_bytes(num_tokens) > limit:
                raise RequestError(
                    ErrorCode.TOO_LARGE,
                    f"the plan's KV is {layout.chunk_bytes(num_tokens):,} bytes, over the inline limit of {limit:,}; "
                    "retrieve through shared memory (same host) or look up a shorter prompt",
                )
            return None
        return self._bulk_tensor(client_id, args.bulk, layout, num_tokens, None)

    def _bulk_tensor(
        self, client_id: str, bulk: BulkRef, layout: KVLayout, num_tokens: int, payload: memoryview | None
    ) -> torch.Tensor:
        """The tensor ``bulk`` names (``bulk_tensors``); a shared-memory region lies in one of ``client_id``'s
        segments."""

        def segment_of(segment_id: int) -> torch.Tensor:
            return self._clients.segment(client_id, segment_id)

        return bulk_tensor(bulk, layout, num_tokens, payload, segment_of)

    def _evict(self, args: EvictArgs) -> dict[str, object]:
        store = self._host.require()
        if args.keys is not None:
            return {"num_evicted": store.evict(list(args.keys))}
        assert args.tier is not None and args.num_bytes is not None, "EvictArgs.parse left evict by bytes half-set"
        return {"freed_bytes": store.evict_bytes(args.num_bytes, args.tier)}

    # -- reports -----------------------------------------------------------------------------------------------

    def _top_documents(self, num_documents: int) -> DocumentsReport:
        """The most-hit documents, each with the tiers holding its chunks now."""
        store = self._host.store
        return self._usage.top_documents(num_documents, store.contains if store is not None else lambda key: [])

    def _features(self) -> ServerFeatures:
        config = self._host.config
        return ServerFeatures(
            blend=config.enable_blend,
            segmented_prefix=config.enable_segmented_prefix,
            dedup_content=config.enable_dedup_content,
            shm=self._identity.shm,
            cuda_ipc=torch.cuda.is_available(),
        )

    def health(self) -> ServerHealth:
        return ServerHealth(
            status="serving" if self._is_serving() else "stopping",
            uptime_s=time.monotonic() - self._identity.started_s,
            layout_registered=self._host.layout is not None,
            server_version=self._identity.version,
        )

    def info(self) -> ServerInfo:
        return ServerInfo(
            server_version=self._identity.version,
            pid=os.getpid(),
            uptime_s=time.monotonic() - self._identity.started_s,
            layout=self._host.layout,
            chunk_size=self._host.config.chunk_size,
            chunk_separator=self._host.config.chunk_separator,
            chunking=self._host.config.chunking,
            tiers=self._host.tier_capacities(),
            features=self._features(),
            data_dir=self._identity.data_dir,
            num_requests=self._num_requests,
            clients=self._clients.summaries(),
            top_chunks=tuple(
                ChunkHits(key=key.hex(), hits=count) for key, count in self._usage.top_chunks(_NUM_TOP_CHUNKS)
            ),
        )

    # -- giving back what departed clients held -----------------------------------------------------------------

    def give_back(self, departure: Departure) -> None:
        """Release a departed client's plans and end its sessions in the store."""
        self._metrics.forget_client(departure.client_id)
        store = self._host.store
        if store is None:
            return
        for session_id in departure.sessions:
            store.end_session(store_session_id(departure.client_id, session_id))
        for plan in departure.loose_plans:
            store.release(plan)

    def janitor_pass(self, plan_ttl_s: float) -> None:
        """Give back what clients whose process died hold, release plans older than ``plan_ttl_s``, forget
        remote clients idle that long, and save changed document hit counts every ``documents_save_interval_s``."""
        for departure in self._clients.remove_dead():
            logger.info(
                "client %s is gone (its process died): releasing %d sessions and %d plans",
                departure.client_id, len(departure.sessions), len(departure.loose_plans),
            )  # fmt: skip
            self.give_back(departure)
        for departure in self._clients.remove_idle(plan_ttl_s):
            self._metrics.forget_client(departure.client_id)
            logger.info("client %s idle for %.0f s holding nothing: forgotten", departure.client_id, plan_ttl_s)
        expired = self._clients.take_expired_plans(plan_ttl_s)
        store = self._host.store
        if expired and store is not None:
            logger.warning(
                "released %d plans neither retrieved nor released within %.0f s (plan TTL)", len(expired), plan_ttl_s
            )
            for open_plan in expired:
                store.release(open_plan.plan)
        self._parts.expire(plan_ttl_s)
        self._usage.save_if_due()  # last: a failed save (full disk) must not skip the rest of the pass

    def save_document_hits(self) -> None:
        """Save changed document hit counts into the data dir now (at shutdown); no-op without a data dir.

        Raises:
            StorageError: the file cannot be written.
        """
        self._usage.save()


def _empty_stats() -> dict[str, object]:
    return {"tiers": [], "num_open_plans": 0, "num_sessions": 0, "catalog": None}
