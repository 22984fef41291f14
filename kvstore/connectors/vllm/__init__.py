"""kvstore's vLLM KV connector: ``KVStoreConnector`` (``kv_connector_module_path: "kvstore.connectors.vllm"``).

- ``connector``: the class vLLM builds, which checks the engine and forwards to one half;
- ``engine_facts``: what the connector reads from the engine's ``VllmConfig``, checked at start;
- ``scheduler_side``: the EngineCore half: lookups, loads and blend passes to queue, answers to vLLM;
- ``request_record``: one ``RequestRecord`` per request, its phase explicit;
- ``request_misses``: why a request's looked-up tokens were not served, adding up exactly;
- ``hit_sources``: the tiers a hit's tokens come from, as vLLM counts cache sources;
- ``worker_side``: a worker's half: loads, blend passes and set-up;
- ``prompt_saves``: a worker's saves, from the step that completes a prompt's prefill to the store;
- ``span_writer``: a blend pass's span written into a request's paged blocks;
- ``worker_stats``: a worker's transfer counters;
- ``parallel``: the part of every chunk each rank of a tensor- or pipeline-parallel engine moves;
- ``kv_groups``: vLLM's KV cache groups (full attention, sliding windows), and which blocks a sliding window frees;
- ``cache_shapes``: the KV cache shapes a worker accepts (plain K/V, fp8 K/V, an MLA latent);
- ``checkpoint_scales``: an fp8 engine's KV scales, read from its checkpoint's files before any model loads;
- ``metadata``: what the halves tell each other every step, and the stats they keep.

Blending's decisions, contract and engine are ``kvstore.blend.vllm``.
"""

from kvstore.connectors.vllm.connector import KVStoreConnector

__all__ = ["KVStoreConnector"]
