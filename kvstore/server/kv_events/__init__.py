"""KV events: the store's residency published in vLLM's wire format, for KV-aware routers (``docs/routing.md``).

- ``encoding``: vLLM's ``KVEventBatch`` and its events as msgpack bytes, the ``medium`` of each tier;
- ``options``: where events go and how they are batched (``kvstore serve --kv-events``);
- ``publisher``: the thread that hears the tiers' residency changes and publishes, replays and snapshots;
- ``consumer``: a reference consumer, what a router does with the events (``docs/routing.md`` shows it).
"""

from __future__ import annotations

__all__: list[str] = []
