"""KV events: the store's residency published in vLLM's wire format, for KV-aware routers (``docs/routing.md``)."""
