"""``kvstore serve``: one process that owns a ``TieredStore`` and serves it over ZeroMQ to engines.

- ``protocol``, ``messages``, ``wire_values``, ``fields``, ``errors``: the wire format, strictly validated.
- ``shm``, ``cuda_ipc``: bulk KV by reference (shared memory on the same host, CUDA IPC for GPU tensors).
- ``handlers``: what each operation does to the store; ``clients``: what each client holds.
- ``loop``: the ROUTER socket, worker pools and janitor; ``app``: start-up and shutdown of the whole server.
- ``settings``, ``host_facts``, ``ownership``: flags and config file, checks before start-up, ``serve.json``.
- ``metrics``: Prometheus ``/metrics`` and ``/healthz``.
- ``hits``, ``document_hits``, ``document_hits_file``, ``document_report``: lookup hits per tier and chunk, hits per
  stored document (kept in the data dir across restarts) and the ``documents`` report of ``kvstore inspect``.

The client end is ``kvstore.Client`` (``kvstore/client.py``).
"""

from kvstore.server.app import ServerAddress, background_server, run_server
from kvstore.server.document_report import DocumentsReport, TierChunks, TopDocument
from kvstore.server.errors import ErrorCode
from kvstore.server.protocol import Limits, Op
from kvstore.server.settings import ServeFlags, ServerSettings, resolve_settings
from kvstore.server.wire_values import ChunkInfo, ClientSummary, ServerHealth, ServerHello, ServerInfo

__all__ = [
    "ChunkInfo",
    "ClientSummary",
    "DocumentsReport",
    "ErrorCode",
    "Limits",
    "Op",
    "ServeFlags",
    "ServerAddress",
    "ServerHealth",
    "ServerHello",
    "ServerInfo",
    "ServerSettings",
    "TierChunks",
    "TopDocument",
    "background_server",
    "resolve_settings",
    "run_server",
]
