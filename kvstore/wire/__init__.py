"""The wire between ``kvstore.Client`` and ``kvstore serve``: shared by both ends, importing neither.

- ``protocol``: ZeroMQ frames carrying msgpack headers (``Op``, ``Limits``);
- ``error_codes``: the error of a reply, and the exception a handler raises to send one;
- ``fields``: strict, typed reads of a decoded map (the only place wire values become Python values);
- ``messages``: each operation's arguments;
- ``values``: plans, store results, stats and the server's descriptions;
- ``documents``: the ``documents`` operation's report;
- ``address``: server URLs, the one check of what a client may be pointed at;
- ``shm``: bulk KV by reference in sealed memfd segments on the same host, and a server's lent arena mapped;
- ``lent_kv``: a lent plan's chunks as views of that arena, for the caller's one copy;
- ``client_segments``: a client's own segments (a reusable scratch segment, buffers handed to the caller);
- ``cuda_ipc``: bulk KV as CUDA tensors shared by IPC handle;
- ``connection``: the client end of the socket.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from kvstore.wire.documents import DocumentsReport, TierChunks, TopDocument
    from kvstore.wire.error_codes import ErrorCode
    from kvstore.wire.protocol import Limits, Op
    from kvstore.wire.values import ChunkInfo, ClientSummary, ServerHealth, ServerHello, ServerInfo

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "kvstore.wire.documents": ("DocumentsReport", "TierChunks", "TopDocument"),
        "kvstore.wire.error_codes": ("ErrorCode",),
        "kvstore.wire.protocol": ("Limits", "Op"),
        "kvstore.wire.values": ("ChunkInfo", "ClientSummary", "ServerHealth", "ServerHello", "ServerInfo"),
    },
)
__all__ = [
    "ChunkInfo",
    "ClientSummary",
    "DocumentsReport",
    "ErrorCode",
    "Limits",
    "Op",
    "ServerHealth",
    "ServerHello",
    "ServerInfo",
    "TierChunks",
    "TopDocument",
]
