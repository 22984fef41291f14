"""CacheBlend inside vLLM: the layerwise pass on the modules of the model a vLLM worker loaded.

- ``plugin``: the ``vllm.general_plugins`` entry point; registers the engine with the connector's blend hook.
- ``model_lookup``: finds the worker's loaded model (no patch to vLLM) and refuses models the pass cannot run.
- ``llama_stack``: ``VllmLlamaStack``, vLLM's Llama modules as a ``LayerStack``.
- ``rope_gate``: the RoPE gate on vLLM's own rotary embedding.
- ``engine``: ``VllmBlendEngine``, one pass per request, written into vLLM's paged blocks.

Only ``plugin`` may be imported outside a vLLM worker without vLLM installed.
"""

__all__: list[str] = []
