"""The remote tier: chunks and a fleet-wide content directory in Valkey (or Redis), shared by many hosts.

Modules: ``address`` (the URL), ``names`` (key names), ``link`` (the connection and its outages), ``remote_value``
(a chunk as one value), ``directory`` (the fleet content directory), ``tier`` (``RemoteTier``). Names are exported
lazily, so reading a URL or a namespace does not load the client library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from kvstore.tiers.remote.address import RemoteAddress, parse_remote_url
    from kvstore.tiers.remote.directory import DirectoryRun
    from kvstore.tiers.remote.link import RemoteLink
    from kvstore.tiers.remote.names import DEFAULT_NAMESPACE, RemoteNames
    from kvstore.tiers.remote.tier import RemoteTier

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "kvstore.tiers.remote.address": ("RemoteAddress", "parse_remote_url"),
        "kvstore.tiers.remote.directory": ("DirectoryRun",),
        "kvstore.tiers.remote.link": ("RemoteLink",),
        "kvstore.tiers.remote.names": ("DEFAULT_NAMESPACE", "RemoteNames"),
        "kvstore.tiers.remote.tier": ("RemoteTier",),
    },
)
__all__ = [
    "DEFAULT_NAMESPACE",
    "DirectoryRun",
    "RemoteAddress",
    "RemoteLink",
    "RemoteNames",
    "RemoteTier",
    "parse_remote_url",
]
