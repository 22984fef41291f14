"""``kvstore serve``: one process that owns a ``TieredStore`` and serves it over ZeroMQ to engines.

- ``app``: start-up and shutdown of the whole server (store, clients, handler, loop, metrics);
- ``loop``: the ROUTER socket's I/O thread, the two worker pools and the janitor;
- ``handlers``: what each operation does to the store: a request in, reply frames out;
- ``bulk_tensors``: the tensor a request's bulk reference names (a client's shared-memory segment, the inline
  payload, a CUDA IPC handle), checked against the layout, never copied;
- ``handlers_parts``: part stores (the ranks of a tensor- or pipeline-parallel engine) and the one assembly they fill;
- ``clients``: who is connected and what each client holds (open plans, sessions, shared-memory segments);
- ``chunk_assembly``: chunks assembled from the parts a tensor- or pipeline-parallel engine's ranks store;
- ``serve_sources``: the settings as given, and where each comes from (flags, environment, config file);
- ``serve_flags``: the settings merged and checked before torch, LMDB or the store is imported;
- ``settings``: the settings completed and checked against this machine and the data dir;
- ``host_facts``: what this machine has (CUDA, free RAM, device memory, disk), for those checks;
- ``store_host``: the server's one ``TieredStore`` and the rule that decides its layout;
- ``metrics``: Prometheus ``/metrics`` and ``/healthz``;
- ``kv_events``: the store's residency as vLLM KV events, for routers;
- ``usage``: what lookups used, per chunk, per stored document (kept across restarts) and per plan (``UsageLedger``).

``serve.json``, where a running server is found, is ``kvstore.data_dir.server_record``. The wire format both ends
speak is ``kvstore.wire``; the client end is ``kvstore.Client`` (``kvstore/client.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from kvstore.server.app import ServerAddress, background_server, run_server
    from kvstore.server.settings import ServeFlags, ServerSettings, resolve_settings

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "kvstore.server.app": ("ServerAddress", "background_server", "run_server"),
        "kvstore.server.settings": ("ServeFlags", "ServerSettings", "resolve_settings"),
    },
)
__all__ = ["ServeFlags", "ServerAddress", "ServerSettings", "background_server", "resolve_settings", "run_server"]
