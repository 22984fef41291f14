"""The remote tier: chunks and a fleet-wide content directory in Valkey (or Redis), shared by many hosts."""

from kvstore.tiers.remote.address import RemoteAddress, parse_remote_url
from kvstore.tiers.remote.directory import DirectoryRun
from kvstore.tiers.remote.link import RemoteLink
from kvstore.tiers.remote.names import DEFAULT_NAMESPACE, RemoteNames
from kvstore.tiers.remote.tier import RemoteTier

__all__ = [
    "DEFAULT_NAMESPACE",
    "DirectoryRun",
    "RemoteAddress",
    "RemoteLink",
    "RemoteNames",
    "RemoteTier",
    "parse_remote_url",
]
