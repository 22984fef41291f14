"""The layerwise blender on a tiny random Llama (llama3 RoPE) and on the real SmolLM2: exactness at ratio 1.0, plain
reuse at 0, the selection, decoding from its cache, storing, errors, pins, and the loader's overlap."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore import StoreConfig, TieredStore
from kvstore.blend import BlendConfig, DeviationMetric, LayerwiseBlender, RopeRotator
from kvstore.blend.llama_layers import LlamaStack
from kvstore.blend.selection import num_tokens_to_recompute
from kvstore.errors import ConfigError, InvalidInputError, LayoutMismatchError
from kvstore.layout import KVDtype, KVLayout
from kvstore.models import LoadedModel, RandomInitModel, random_init_model
from kvstore.tiers.base import TierName

CHUNK = 8
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the cpu twin runs everywhere)")


@pytest.fixture(scope="module")
def tiny() -> RandomInitModel:
    """4 layers, 4 query heads over 2 KV heads, head_dim 16, llama3 RoPE theta 5e5; float32."""
    return random_init_model("tiny-llama", dtype=torch.float32, seed=0)


def open_store(layout: KVLayout, path: Path, *tiers: TierName, chunk_size: int = CHUNK) -> TieredStore:
    config = StoreConfig(
        tiers=tiers or (TierName.CPU,),
        chunk_size=chunk_size,
        cpu_capacity_bytes=64 << 20,
        data_dir=path / "data",
        enable_blend=True,
    )
    return TieredStore(layout, config)


@pytest.fixture
def blender(tiny: RandomInitModel, tmp_path: Path) -> Iterator[LayerwiseBlender]:
    with open_store(tiny.layout, tmp_path) as store, LayerwiseBlender(tiny.model, store) as blender:
        yield blender


def documents(seed: int = 0, num: int = 3, length: int = 27) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, length).tolist() for _ in range(num)]


def multi_doc_prompt(docs: list[list[int]]) -> list[int]:
    """Preamble, the documents in reverse order with separators, a question: documents land at new offsets."""
    return [1, 2, 3, 4, 5] + docs[2] + [6] + docs[0] + [7, 8] + docs[1] + [9, 10, 11]


def warm(blender: LayerwiseBlender, docs: list[list[int]]) -> None:
    for doc in docs:
        blender.prefill(doc, mode="full")


def test_ratio_one_reproduces_full_prefill_on_a_tiny_llama(blender: LayerwiseBlender) -> None:
    docs = documents()
    warm(blender, docs)
    prompt = multi_doc_prompt(docs)
    full = blender.prefill(prompt, mode="full", store_result=False)
    blended = blender.prefill(prompt, store_result=False, config=BlendConfig(recompute_ratio=1.0))
    assert blended.plan.num_blend_tokens == 3 * 27 and blended.plan.num_exact_tokens == 0
    assert blended.num_recomputed_tokens == len(prompt)
    torch.testing.assert_close(blended.logits, full.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(blended.kv, full.kv, rtol=0, atol=1e-5)
    assert blended.timings.load_total_ms == 0.0  # ratio 1.0 never reads the cached blend KV: not even loaded


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_selecting_every_token_at_the_check_layer_also_reproduces_full_prefill(
    blender: LayerwiseBlender, attention: str
) -> None:
    """Just under 1.0 the pass narrows at the check layer (its attention and MLP run for the selected tokens only,
    later layers wait for their loaded KV layer by layer) yet every cached token is selected: a full prefill again."""
    docs = documents(4)
    warm(blender, docs)
    prompt = multi_doc_prompt(docs)
    full = blender.prefill(prompt, mode="full", store_result=False)
    config = BlendConfig(recompute_ratio=0.999, attention=attention)  # type: ignore[arg-type]
    blended = blender.prefill(prompt, store_result=False, config=config)
    assert blended.num_recomputed_tokens == len(prompt) and blended.timings.load_total_ms > 0
    torch.testing.assert_close(blended.logits, full.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(blended.kv, full.kv, rtol=0, atol=1e-5)


def test_ratio_one_with_an_exact_prefix_and_blend_segments_matches_full(blender: LayerwiseBlender) -> None:
    docs = documents(1)
    head = docs[0] + [5, 6, 7, 8, 9]  # 32 tokens: 4 whole chunks, stored as a prefix of the next prompt
    blender.prefill(head, mode="full")
    warm(blender, docs[1:])
    prompt = head + docs[2] + [1] + docs[1] + [2, 3]
    full = blender.prefill(prompt, mode="full", store_result=False)
    blended = blender.prefill(prompt, store_result=False, config=BlendConfig(recompute_ratio=1.0))
    assert blended.plan.num_exact_tokens == 32 and blended.plan.num_blend_tokens == 54
    assert blended.num_recomputed_tokens == len(prompt) - 32  # exact segments are never recomputed
    torch.testing.assert_close(blended.logits, full.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(blended.kv, full.kv, rtol=0, atol=1e-5)
    prefix = blender.prefill(prompt, mode="prefix", store_result=False)
    assert prefix.plan.num_exact_tokens == 32 and prefix.num_recomputed_tokens == len(prompt) - 32
    torch.testing.assert_close(prefix.logits, full.logits, rtol=0, atol=1e-5)


def test_ratio_zero_recomputes_only_gaps_and_the_last_token(blender: LayerwiseBlender, tiny: RandomInitModel) -> None:
    docs = documents(2)
    warm(blender, docs)
    stored = [blender.prefill(doc, mode="full", store_result=False).kv for doc in docs]
    prompt = multi_doc_prompt(docs)
    reused = blender.prefill(prompt, store_result=False, config=BlendConfig(recompute_ratio=0.0))
    assert reused.plan.num_gap_tokens == 11 and reused.num_recomputed_tokens == 11  # the last token is a gap
    rotator = RopeRotator(tiny.layout.rope, tiny.layout.head_dim)
    for doc_kv, start in ((stored[2], 5), (stored[0], 33), (stored[1], 62)):
        expected = doc_kv.clone()
        rotator.rotation(start).apply_to_kv(expected)
        torch.testing.assert_close(reused.kv[:, :, start : start + 27], expected, rtol=0, atol=1e-6)


def test_a_prompt_ending_in_cached_tokens_still_computes_its_last_token(blender: LayerwiseBlender) -> None:
    docs = documents(3)
    warm(blender, docs)
    prompt = [1, 2] + docs[0]
    reused = blender.prefill(prompt, store_result=False, config=BlendConfig(recompute_ratio=0.0))
    assert reused.plan.num_gap_tokens == 2 and reused.num_recomputed_tokens == 3


@pytest.mark.parametrize("deviation", list(DeviationMetric))
def test_the_ratio_selects_that_share_of_cached_tokens_plus_gaps_and_the_last(
    blender: LayerwiseBlender, deviation: DeviationMetric
) -> None:
    docs = documents(4)
    warm(blender, docs)
    prompt = multi_doc_prompt(docs)
    blended = blender.prefill(prompt, store_result=False, config=BlendConfig(deviation=deviation))
    assert blended.num_recomputed_tokens == num_tokens_to_recompute(0.15, 81) + 11 == 13 + 11
    full = blender.prefill(prompt, mode="full", store_result=False)
    assert not torch.equal(blended.logits, full.logits)  # an approximation, but a close one on this toy model
    assert torch.nn.functional.cosine_similarity(blended.logits, full.logits, dim=0) > 0.9


def test_decoding_continues_from_the_returned_cache(blender: LayerwiseBlender, tiny: RandomInitModel) -> None:
    docs = documents(5)
    warm(blender, docs)
    prompt = multi_doc_prompt(docs)
    with torch.inference_mode():
        reference = tiny.model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt) :]
    for output in (
        blender.prefill(prompt, mode="full", store_result=False),
        blender.prefill(prompt, store_result=False, config=BlendConfig(recompute_ratio=1.0)),
    ):
        first = int(output.logits.argmax())
        with torch.inference_mode():
            rest = tiny.model.generate(
                torch.tensor([[*prompt, first]]), cache=output.cache, max_new_tokens=5, do_sample=False
            )[0, len(prompt) + 1 :]
        assert [first, *rest.tolist()] == reference.tolist()


def test_a_stored_blended_prompt_is_an_exact_prefix_hit_next_time(blender: LayerwiseBlender) -> None:
    docs = documents(6)
    warm(blender, docs)
    prompt = multi_doc_prompt(docs)
    first = blender.prefill(prompt)  # blend at 0.15, then stored
    assert first.plan.num_blend_tokens == 81 and first.timings.store_ms > 0
    again = blender.prefill(prompt, store_result=False)
    assert again.plan.num_exact_tokens == len(prompt) and again.num_recomputed_tokens == 1
    torch.testing.assert_close(again.logits, first.logits, rtol=0, atol=1e-5)
    assert blender.store.stats().num_open_plans == 0


def test_cached_kv_in_a_bfloat16_layout_for_a_float32_model(tiny: RandomInitModel, tmp_path: Path) -> None:
    """Model and cache dtypes differ: the layers attend over float32 copies, the stored KV is bfloat16."""
    layout = KVLayout(
        model_id=tiny.layout.model_id, num_layers=4, num_kv_heads=2, head_dim=16, dtype=KVDtype.BFLOAT16,
        rope=tiny.layout.rope,
    )  # fmt: skip
    with open_store(layout, tmp_path, TierName.CPU, TierName.DISK) as store, \
            LayerwiseBlender(tiny.model, store) as blender:  # fmt: skip
        docs = documents(7)
        warm(blender, docs)
        prompt = multi_doc_prompt(docs)
        full = blender.prefill(prompt, mode="full", store_result=False)
        exact = blender.prefill(prompt, store_result=False, config=BlendConfig(recompute_ratio=1.0))
        assert exact.kv.dtype == torch.bfloat16 and exact.cache.layers[0].keys.dtype == torch.float32
        torch.testing.assert_close(exact.logits, full.logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(exact.kv, full.kv, rtol=0, atol=0)
        blended = blender.prefill(prompt, store_result=False)
        assert blended.num_recomputed_tokens == 24 and blended.plan.num_blend_tokens == 81


def test_every_path_releases_the_plan_even_when_the_model_fails(
    blender: LayerwiseBlender, tiny: RandomInitModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = documents(8)
    warm(blender, docs)
    prompt = multi_doc_prompt(docs)

    def broken(*args: object) -> None:
        raise RuntimeError("model failed")

    monkeypatch.setattr(tiny.model.model.layers[2].mlp, "forward", broken)  # both the blender's and HF's forward
    for mode in ("blend", "prefix"):
        with pytest.raises(RuntimeError, match="model failed"):
            blender.prefill(prompt, mode=mode, store_result=False)
        assert blender.store.stats().num_open_plans == 0
    session = blender.store.session()
    with pytest.raises(RuntimeError):
        blender.prefill(prompt, session=session, store_result=False)
    assert blender.store.stats().num_open_plans == 0


def test_loading_overlaps_the_layers_before_the_check_layer(
    blender: LayerwiseBlender, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The retrieve runs on the loader thread and can still be running while layer 0 computes: here it waits for
    layer 0 to start, which would deadlock (and time out) if the engine waited for the load first."""
    docs = documents(9)
    warm(blender, docs)
    layer_zero_started = threading.Event()
    retrieving_threads: list[str] = []
    store = blender.store
    original_retrieve = store.retrieve
    original_project = LlamaStack.project

    def retrieve(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        retrieving_threads.append(threading.current_thread().name)
        assert layer_zero_started.wait(timeout=20), "the engine waited for the load before computing layer 0"
        return original_retrieve(*args, **kwargs)  # type: ignore[arg-type]

    def project(self: LlamaStack, layer_idx: int, *args: object):  # type: ignore[no-untyped-def]
        if layer_idx == 0:
            layer_zero_started.set()
        return original_project(self, layer_idx, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "retrieve", retrieve)
    monkeypatch.setattr(LlamaStack, "project", project)
    output = blender.prefill(multi_doc_prompt(docs), store_result=False)
    assert retrieving_threads == ["kvstore-blend-load_0"]
    assert output.timings.load_total_ms > 0 and output.timings.total_ms >= output.timings.recompute_ms


def test_bad_inputs_are_refused_with_one_line_errors(tiny: RandomInitModel, tmp_path: Path) -> None:
    with open_store(tiny.layout, tmp_path) as store:
        with pytest.raises(ConfigError, match=r"recompute_ratio=1\.5 must be a fraction in \[0, 1\]"):
            BlendConfig(recompute_ratio=1.5)
        with pytest.raises(ConfigError, match=r"recompute_ratio=-0\.1"):
            BlendConfig(recompute_ratio=-0.1)
        with pytest.raises(ConfigError, match=r"check_layer=-1"):
            BlendConfig(check_layer=-1)
        with pytest.raises(ConfigError, match=r"check_layer=4 is beyond the model's 4 layers; use a layer in \[0, 3\]"):
            LayerwiseBlender(tiny.model, store, BlendConfig(check_layer=4))
        with LayerwiseBlender(tiny.model, store) as blender:
            with pytest.raises(ConfigError, match="mode='fast' is not one of full, prefix, blend"):
                blender.prefill([1, 2], mode="fast")
            with pytest.raises(InvalidInputError, match="the prompt is empty"):
                blender.prefill([])
            with pytest.raises(ConfigError, match="check_layer=9"):
                blender.prefill([1, 2], config=BlendConfig(check_layer=9))
    other = KVLayout(model_id=tiny.layout.model_id, num_layers=4, num_kv_heads=2, head_dim=16, dtype=KVDtype.FLOAT32)
    mismatch = r"does not fit the model: rope=.*layout_from_hf_config"
    with open_store(other, tmp_path / "other") as store, pytest.raises(LayoutMismatchError, match=mismatch):
        LayerwiseBlender(tiny.model, store)
    plain = StoreConfig(tiers=(TierName.CPU,), chunk_size=CHUNK, cpu_capacity_bytes=16 << 20)
    with TieredStore(tiny.layout, plain) as store, LayerwiseBlender(tiny.model, store) as blender:
        with pytest.raises(ConfigError, match="needs a store opened with StoreConfig\\(enable_blend=True\\)"):
            blender.prefill([1, 2, 3])
        assert blender.prefill([1, 2, 3], mode="prefix").plan.num_tokens == 3


def test_models_outside_the_llama_family_are_refused(tiny: RandomInitModel, tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, MistralConfig, MistralForCausalLM

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ConfigError, match="refusing to blend a 'gpt2' model: the layerwise blender runs Llama-family"):
        LlamaStack(gpt2)
    mistral = MistralForCausalLM(
        MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64, sliding_window=16)
    )  # fmt: skip
    with pytest.raises(ConfigError, match="sliding-window attention \\(sliding_window=16\\)"):
        LlamaStack(mistral)


def test_a_qwen2_model_with_projection_biases_blends_exactly(tmp_path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from kvstore.models import layout_from_hf_config

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=1024)  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    layout = layout_from_hf_config(model.config, model_id="test/qwen2", dtype=torch.float32)
    with open_store(layout, tmp_path) as store, LayerwiseBlender(model, store) as blender:
        docs = [doc[:20] for doc in documents(10, length=20)]
        docs = [[token % 128 for token in doc] for doc in docs]
        warm(blender, docs)
        prompt = multi_doc_prompt(docs)
        full = blender.prefill(prompt, mode="full", store_result=False)
        exact = blender.prefill(prompt, store_result=False, config=BlendConfig(recompute_ratio=1.0))
        assert exact.plan.num_blend_tokens == 60
        torch.testing.assert_close(exact.logits, full.logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
@pytest.mark.parametrize("tiers", [(TierName.GPU,), (TierName.CPU,), (TierName.DISK,)], ids=["gpu", "cpu", "disk"])
def test_the_blend_pass_on_each_tier_and_device(device: str, tiers: tuple[TierName, ...], tmp_path: Path) -> None:
    """The same logic on the CPU (the loader's thread, future and buffer) and on CUDA (its side stream, events)."""
    built = random_init_model("tiny-llama", dtype=torch.float32, device=device, seed=1)
    config = StoreConfig(tiers=tiers, chunk_size=CHUNK, cpu_capacity_bytes=16 << 20, gpu_capacity_bytes=16 << 20,
                         gpu_device=device, data_dir=tmp_path / "data", enable_blend=True)  # fmt: skip
    waits = BlendConfig(disk_policy="wait")  # reads from every tier, disk too (load_cost may skip a slow disk)
    with TieredStore(built.layout, config) as store, LayerwiseBlender(built.model, store, waits) as blender:
        docs = documents(11)
        warm(blender, docs)
        prompt = multi_doc_prompt(docs)
        full = blender.prefill(prompt, mode="full", store_result=False)
        exact = blender.prefill(prompt, store_result=False, config=BlendConfig(recompute_ratio=1.0))
        torch.testing.assert_close(exact.logits, full.logits, rtol=0, atol=1e-4)
        narrowed = blender.prefill(prompt, store_result=False, config=dataclasses.replace(waits, recompute_ratio=0.999))
        torch.testing.assert_close(narrowed.logits, full.logits, rtol=0, atol=1e-4)  # layered loads, narrowed attention
        blended = blender.prefill(prompt, store_result=False)
        assert blended.kv.device.type == device and blended.plan.num_blend_tokens == 81
        assert blended.num_recomputed_tokens == 24
        timings = blended.timings
        assert timings.load_total_ms > 0 and timings.recompute_ms > 0
        assert timings.total_ms == pytest.approx(
            timings.lookup_ms + timings.load_ms + timings.recompute_ms + timings.other_ms
        )
        assert store.stats().num_open_plans == 0


def test_the_real_model_blends_exactly_at_ratio_one_and_closely_at_the_default(
    smollm2: LoadedModel, tmp_path: Path
) -> None:
    """SmolLM2-135M, documents of real prose stored alone and queried in another order."""
    tokenizer = smollm2.tokenizer
    texts = [
        "The lighthouse keeper wrote in his log every evening, noting the ships that passed and the weather.",
        "Bees communicate the direction of flowers to the hive through a dance that encodes angle and distance.",
        "The access code for the Juniper archive is 4821, and only the head librarian may use it.",
    ]
    docs = [tokenizer.encode("\n\n" + " ".join([text] * 3), add_special_tokens=False) for text in texts]
    question = tokenizer.encode("\n\nWhat is the access code for the Juniper archive? The code is",
                                add_special_tokens=False)  # fmt: skip
    with open_store(smollm2.layout, tmp_path, chunk_size=16) as store, \
            LayerwiseBlender(smollm2.model, store) as blender:  # fmt: skip
        for doc in docs:
            blender.prefill(doc, mode="full")
        prompt = docs[2] + docs[0] + docs[1] + question
        full = blender.prefill(prompt, mode="full", store_result=False)
        exact = blender.prefill(prompt, store_result=False, config=BlendConfig(recompute_ratio=1.0))
        assert exact.plan.num_exact_tokens == len(docs[2])  # stored alone from position 0: a prefix hit
        assert exact.plan.num_blend_tokens > 0.5 * len(prompt)
        torch.testing.assert_close(exact.logits, full.logits, rtol=0, atol=1e-4)
        torch.testing.assert_close(exact.kv, full.kv, rtol=0, atol=1e-4)
        blended = blender.prefill(prompt, store_result=False)
        assert int(blended.logits.argmax()) == int(full.logits.argmax())
        full_log_p, blend_log_p = full.logits.double().log_softmax(-1), blended.logits.double().log_softmax(-1)
        assert float((full_log_p.exp() * (full_log_p - blend_log_p)).sum()) < 0.1
