"""The stored frame: how a chunk's KV is kept outside memory, shared by every tier that keeps it so.

- ``meta``: the chunk meta value (sizes, source position, tokens, parent key, checksum).
- ``codec``: a chunk's bytes as checksummed, zstd-compressed byte-plane frames.
- ``codec_pool``: the threads that encode and decode frames.
- ``host_copy``: copies between device tensors and host buffers around the codec.
- ``evicted``: a chunk handed from one tier to the one below it as stored.

The disk tier (LMDB) and the remote tier (Valkey) both store these frames; neither imports the other.
"""

__all__: list[str] = []
