"""``kvstore serve``'s wire: ZeroMQ frames carrying strictly validated msgpack messages.

- ``protocol``: frames, headers, versions, limits; ``messages``: each operation's arguments; ``wire_values``:
  plans, stats and server descriptions on the wire; ``fields``: typed reads of decoded maps; ``errors``: the
  error codes of replies; ``cuda_ipc``: CUDA tensors shared by handle.
"""

from kvstore.server.errors import ErrorCode
from kvstore.server.protocol import PROTOCOL_VERSION, Limits, Op

__all__ = ["PROTOCOL_VERSION", "ErrorCode", "Limits", "Op"]
