"""The remote tier: chunks and a fleet-wide content directory in Valkey (or Redis), shared by many hosts.

- ``names``: the names of kvstore's keys in Valkey (namespace, layout tag, hash tags);
- ``link``: the connection to Valkey and its outages;
- ``remote_value``: a chunk as one Valkey value;
- ``directory``: the fleet content directory (which runs of chunks each host published);
- ``tier``: ``RemoteTier``, the shared tier the store's ``Fleet`` holds.

The URL and the namespace are configuration values (``kvstore.remote_address``). Names are exported lazily, so
importing one module does not load the client library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from kvstore.tiers.remote.directory import DirectoryRun
    from kvstore.tiers.remote.link import RemoteLink
    from kvstore.tiers.remote.names import RemoteNames
    from kvstore.tiers.remote.tier import RemoteTier

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "kvstore.tiers.remote.directory": ("DirectoryRun",),
        "kvstore.tiers.remote.link": ("RemoteLink",),
        "kvstore.tiers.remote.names": ("RemoteNames",),
        "kvstore.tiers.remote.tier": ("RemoteTier",),
    },
)
__all__ = ["DirectoryRun", "RemoteLink", "RemoteNames", "RemoteTier"]
