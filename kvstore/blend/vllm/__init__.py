"""CacheBlend inside vLLM, all of it: what the connector decides per request, the contract it reaches the engine
through, and the layerwise pass on the modules of the model a vLLM worker loaded.

The connector (``kvstore.connectors.vllm``) imports the light modules here and nothing else of ``kvstore.blend``;
nothing here imports the connector (``tests/test_layering.py``):

- ``hook``: the contract (``BlendEngine``, its context, ``BlendOutcome``) and the registry the plugin fills;
- ``request_choice``: whether and how one request is blended (its ``kv_transfer_params`` over the deployment's);
- ``span``: how much of a prompt a pass computes;
- ``gate``: whether the pass is expected to beat vLLM's own prefill of the span.

The engine side, loaded only in a worker whose connector blends:

- ``plugin``: the ``vllm.general_plugins`` entry point; registers the engine with ``hook``.
- ``model_lookup``: finds the worker's loaded model (no patch to vLLM) and refuses models the pass cannot run.
- ``llama_stack``: ``VllmLlamaStack``, vLLM's Llama modules as a ``LayerStack``.
- ``rope_gate``: the RoPE gate on vLLM's own rotary embedding.
- ``engine``: ``VllmBlendEngine``, one pass per request, written into vLLM's paged blocks by the connector's writer.
- ``tensor_parallel``: the ranks of a tensor-parallel engine agreeing on a pass, and the lead's plan they share.

Only ``plugin`` and the light modules may be imported outside a vLLM worker without vLLM installed.
"""

__all__: list[str] = []
