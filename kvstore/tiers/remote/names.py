"""The names of kvstore's keys in Valkey: one namespace per deployment, one slot per chunk, directory shards spread.

::

    <namespace>:kv:<layout>:{<chunk key, 32 hex>}        a chunk's value (remote_value.py)
    <namespace>:dir:<layout>:{d<NN>}                      a shard of the content directory (a stream, directory.py)
    <namespace>:epoch:<layout>                            a random value the first host sets (tier.py: resets)

``<layout>`` is 16 hex digits of a hash of the model's KV layout, the chunk size and (when not ``fixed``) the cut
rule: deployments of different models, chunk sizes or cut rules sharing one Valkey never see each other's chunks
(their prefix keys differ anyway; the tag also keeps an operator's ``SCAN`` readable). The ``{...}`` hash tag puts
everything named after one chunk in one cluster slot (what a chunk may gain later, such as a lease, lands beside its
value), and spreads chunks over all slots, since chunk keys are uniformly random. The directory's shards carry tags
``{d00}``, ``{d01}``, ... so they spread over the masters of a cluster too.

Pure functions and immutable values; thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from kvstore.chunking import Chunking
from kvstore.keys import PrefixKey
from kvstore.layout import KVLayout
from kvstore.remote_address import check_namespace

__all__ = ["RemoteNames"]


@dataclass(frozen=True, slots=True)
class RemoteNames:
    """Key names of one deployment and model layout.

    Args:
        namespace: the deployment's prefix (``kvstore.remote_address.check_namespace``).
        layout_tag: 16 hex digits identifying the layout and chunk size (``for_layout``).
        num_directory_shards: streams the content directory is spread over.
    """

    namespace: str
    layout_tag: str
    num_directory_shards: int = 16

    @classmethod
    def for_layout(
        cls,
        namespace: str,
        layout: KVLayout,
        chunk_size: int,
        *,
        chunking: Chunking = Chunking.FIXED,
        num_directory_shards: int = 16,
    ) -> RemoteNames:
        """The names for one layout, chunk size and cut rule (``fixed`` keeps the tag it always had, so a fleet's
        stored chunks stay found across this change; another rule is another fleet: its chunks and directory runs
        were cut another way, and a host reading them would index chunks its own prompts are never cut into)."""
        rule = b"" if chunking is Chunking.FIXED else chunking.value.encode()
        tag = xxhash.xxh3_64_hexdigest(bytes(layout.namespace) + chunk_size.to_bytes(4, "little") + rule)
        return cls(check_namespace(namespace), tag, num_directory_shards)

    def chunk(self, key: PrefixKey) -> bytes:
        """The key of a chunk's value."""
        return f"{self.namespace}:kv:{self.layout_tag}:{{{key.hex()}}}".encode()

    def epoch(self) -> bytes:
        """The key whose value changes when the remote lost its data (restarted empty, flushed)."""
        return f"{self.namespace}:epoch:{self.layout_tag}".encode()

    def directory_shard(self, shard: int) -> bytes:
        """The key of one directory shard."""
        return f"{self.namespace}:dir:{self.layout_tag}:{{d{shard:02d}}}".encode()

    def directory_shards(self) -> list[bytes]:
        return [self.directory_shard(shard) for shard in range(self.num_directory_shards)]

    def shard_of(self, key: PrefixKey) -> int:
        """The directory shard a run starting with chunk ``key`` is published to (keys are uniformly random)."""
        return key[0] % self.num_directory_shards
