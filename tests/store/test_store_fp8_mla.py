"""fp8 and MLA KV through every tier of a real store: bytes come back exactly (LMCache once returned corrupted fp8 KV
from its CPU tier through a layout assumption), from memory, from disk (byte planes + zstd of 1-byte elements) and
after a restart."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore import KVLayout, TieredStore
from kvstore.tiers.base import TierName
from kvstore.tiers.frames.codec import FrameCodec, FrameStatus
from tests.factories import make_tokens, store_config

CHUNK = 8
FP8 = KVLayout(model_id="test/fp8", num_layers=3, num_kv_heads=2, head_dim=32, dtype="fp8_e4m3")
FP8_E5M2 = KVLayout(model_id="test/fp8", num_layers=3, num_kv_heads=2, head_dim=32, dtype="fp8_e5m2")
MLA = KVLayout.for_mla(model_id="test/mla", num_layers=2, kv_lora_rank=512, rope_dim=64)


def fp8_kv(layout: KVLayout, num_tokens: int, seed: int) -> torch.Tensor:
    """KV-like fp8 bytes (normal values quantised) with every byte value planted, NaN codes included."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(layout.chunk_shape(num_tokens), generator=generator)
    kv = values.to(layout.dtype.storage_dtype).view(torch.uint8).clone()
    kv.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    return kv


def mla_kv(num_tokens: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(MLA.chunk_shape(num_tokens), generator=generator).to(torch.bfloat16)


@pytest.mark.parametrize("layout", [FP8, FP8_E5M2, MLA], ids=["fp8_e4m3", "fp8_e5m2", "mla"])
def test_kv_comes_back_byte_for_byte_from_memory_disk_and_a_restart(tmp_path: Path, layout: KVLayout) -> None:
    num_tokens = 5 * CHUNK + 3
    tokens = make_tokens(num_tokens, seed=3)
    kv = mla_kv(num_tokens, 3) if layout.mla else fp8_kv(layout, num_tokens, 3)
    config = store_config(
        tmp_path, layout, CHUNK, gpu_chunks=2, cpu_chunks=2, tiers=(TierName.CPU, TierName.DISK)
    )  # two chunks in memory: the rest is read back from disk
    with TieredStore(layout, config) as store:
        store.store(tokens, kv)
        store.flush()
        plan = store.lookup(tokens)
        assert plan.num_cached_tokens == num_tokens and plan.num_tokens_in(TierName.DISK) > 0
        back = store.retrieve(plan).kv
        assert back.dtype == layout.dtype.torch_dtype and torch.equal(back.view(torch.uint8), kv.view(torch.uint8))
    with TieredStore(layout, config) as reopened:
        plan = reopened.lookup(tokens)
        assert plan.num_tokens_in(TierName.DISK) == num_tokens
        assert torch.equal(reopened.retrieve(plan).kv.view(torch.uint8), kv.view(torch.uint8))


def test_a_data_dir_of_fp8_kv_refuses_a_float_layout(tmp_path: Path) -> None:
    config = store_config(tmp_path, FP8, CHUNK, gpu_chunks=2, cpu_chunks=2, tiers=(TierName.CPU, TierName.DISK))
    with TieredStore(FP8, config) as store:
        store.store(make_tokens(CHUNK), fp8_kv(FP8, CHUNK, 1))
    float_layout = KVLayout(model_id="test/fp8", num_layers=3, num_kv_heads=2, head_dim=32, dtype="bfloat16")
    with pytest.raises(Exception, match="float8_e4m3"):
        TieredStore(float_layout, config)


def test_the_one_byte_codec_round_trips_fp8_kv_and_compresses_its_exponents() -> None:
    codec = FrameCodec(FP8.dtype.element_size_bytes)
    raw = fp8_kv(FP8, 256, 5).numpy().reshape(-1)
    encoded = codec.encode(raw)
    out = np.empty_like(raw)
    assert codec.decode_into(encoded, out) is FrameStatus.OK and np.array_equal(out, raw)
    assert len(encoded) < raw.shape[0]  # quantised normal values: few distinct bytes, zstd's entropy coding pays


@pytest.mark.parametrize(
    ("layout", "shown"),
    [
        (MLA, "2 layers x MLA latent 576 = 512 compressed + 64 rope, bfloat16"),
        (FP8, "3 layers x 2 kv heads x 32, float8_e4m3 scales k=1 v=1"),
    ],
    ids=["mla", "fp8"],
)
def test_inspect_describes_the_layout_as_it_is(
    tmp_path: Path, layout: KVLayout, shown: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.cli.test_cli import run

    config = store_config(tmp_path, layout, CHUNK, gpu_chunks=2, cpu_chunks=2, tiers=(TierName.CPU, TierName.DISK))
    kv = mla_kv(2 * CHUNK, 1) if layout.mla else fp8_kv(layout, 2 * CHUNK, 1)
    with TieredStore(layout, config) as store:
        store.store(make_tokens(2 * CHUNK), kv)
    code, out, _ = run(["inspect", "--data-dir", str(config.data_dir), "--json"], capsys)
    assert code == 0
    summary = json.loads(out)
    assert shown in summary["layout"] and summary["layout_namespace"] == layout.namespace.hex()
    assert summary["raw_bytes"] == layout.chunk_bytes(2 * CHUNK)


def test_the_standalone_blender_refuses_fp8_and_mla_layouts(tmp_path: Path) -> None:
    from kvstore.blend import LayerwiseBlender
    from kvstore.models.random_init import random_init_model

    tiny = random_init_model("tiny-llama", num_layers=2, dtype=torch.float32)
    fp8 = KVLayout(
        model_id=tiny.layout.model_id, num_layers=2, num_kv_heads=tiny.layout.num_kv_heads,
        head_dim=tiny.layout.head_dim, dtype="fp8", rope=tiny.layout.rope,
    )  # fmt: skip
    for layout in (fp8, MLA):
        config = store_config(tmp_path / layout.dtype.value, layout, CHUNK, gpu_chunks=2, cpu_chunks=2,
                              tiers=(TierName.CPU,))  # fmt: skip
        with TieredStore(layout, config) as store, pytest.raises(Exception, match=r"does not blend .*fp8 KV or MLA"):
            LayerwiseBlender(tiny.model, store)
