"""kvstore's vLLM KV connector: ``KVStoreConnector`` (``kv_connector_module_path: "kvstore.connectors.vllm"``).

- ``connector``: the class vLLM builds, which checks the engine and forwards to one half (``engine_facts``: what it
  reads from the engine's config);
- ``scheduler_side``: the EngineCore half; one ``RequestRecord`` per request (``request_record``), its miss reasons
  (``request_misses``) and the tiers its hit came from (``hit_sources``);
- ``worker_side``: a worker's half (loads and blend passes); ``prompt_saves`` (its saves), ``span_writer`` (a blend
  pass's span into the blocks), ``worker_stats``, ``parallel`` (a rank's part of every chunk), ``cache_shapes``
  (the KV cache shapes and block format it accepts);
- ``metadata``: what the halves tell each other every step, and the stats.

Blending's decisions, contract and engine are ``kvstore.blend.vllm``.
"""

from kvstore.connectors.vllm.connector import KVStoreConnector

__all__ = ["KVStoreConnector"]
