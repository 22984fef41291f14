"""``kvstore serve``: one process that owns a ``TieredStore`` and serves it over ZeroMQ to engines.

- ``handlers``: what each operation does to the store; ``clients``: what each client holds;
- ``loop``: the ROUTER socket, worker pools and janitor; ``app``: start-up and shutdown of the whole server;
- ``serve_sources``, ``serve_flags``, ``settings``, ``host_facts``, ``store_host``: flags, environment and config
  file, the checks before start-up (those needing no torch first), the one store and its layout (``serve.json``,
  where a running server is found, is ``kvstore.data_dir.server_record``);
- ``metrics``: Prometheus ``/metrics`` and ``/healthz``; ``kv_events``: the residency as vLLM KV events for routers;
- ``usage``: what lookups used, per chunk, per stored document (kept in the data dir across restarts) and per plan
  (``UsageLedger``, the one vocabulary of hits).

The wire format both ends speak is ``kvstore.wire``; the client end is ``kvstore.Client`` (``kvstore/client.py``).
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
