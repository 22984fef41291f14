"""A layer-by-layer retrieve (``TieredStore.retrieve(progress=...)``) and the loader that waits on it, on real
tiers (the gpu tier's logic on host memory, LMDB on disk) with chunks of 8 tokens."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
import torch

from kvstore import KVLayout, TieredStore
from kvstore.blend.kv_loading import KVLoader
from kvstore.errors import ConfigError
from kvstore.keys import as_token_array, prefix_keys
from kvstore.plan import RetrieveProgress, Segment
from kvstore.store.retrieve_copies import LAYERS_PER_STEP
from kvstore.tiers.base import TierName
from tests.factories import flip_frame_bit, make_kv, make_tokens, store_config

CHUNK = 8
SENTINEL = 7.0  # what the buffer holds where nothing was copied yet (random KV never equals it everywhere)


class Recorder(RetrieveProgress):
    """Remembers every report and, at each layer, which layers of a memory chunk's place already hold its KV."""

    def __init__(self, out: torch.Tensor, watched: Segment) -> None:
        self.out, self.watched = out, watched
        self.events: list[object] = []
        self.written_at_report: list[list[bool]] = []

    def segments_loaded(self, segments: tuple[Segment, ...]) -> None:
        self.events.append(tuple(segments))

    def layer_queued(self, layer: int) -> None:
        self.events.append(layer)
        cached = self.out[:, :, self.watched.start : self.watched.end]
        self.written_at_report.append([not bool((cached[index] == SENTINEL).all()) for index in range(len(cached))])


def sentinel_buffer(layout: KVLayout, num_tokens: int) -> torch.Tensor:
    return torch.full(layout.chunk_shape(num_tokens), SENTINEL, dtype=layout.dtype.torch_dtype)


def test_memory_chunks_arrive_layer_by_layer_and_the_result_matches_a_whole_chunk_retrieve(
    tmp_path: Path, small_layout: KVLayout
) -> None:
    deep = dataclasses.replace(small_layout, num_layers=2 * LAYERS_PER_STEP + 2)  # two whole steps and a short one
    config = store_config(tmp_path, deep, CHUNK, gpu_chunks=2, cpu_chunks=2)
    tokens, kv = make_tokens(6 * CHUNK), make_kv(deep, 6 * CHUNK)
    with TieredStore(deep, config) as store:
        store.store(tokens, kv)
        store.flush()
        plan = store.lookup(tokens)
        assert {segment.tier for segment in plan.segments} == {TierName.GPU, TierName.CPU, TierName.DISK}
        out = sentinel_buffer(deep, 6 * CHUNK)
        in_gpu_tier = next(segment for segment in plan.segments if segment.tier is TierName.GPU)
        recorder = Recorder(out, in_gpu_tier)
        result = store.retrieve(plan, out, progress=recorder)
        num_layers = deep.num_layers
        assert recorder.events[0] == result.segments and recorder.events[1:] == list(range(num_layers))
        for layer, written in enumerate(recorder.written_at_report):  # a step's layers land together
            step_end = min((layer // LAYERS_PER_STEP + 1) * LAYERS_PER_STEP, num_layers)
            assert written == [index < step_end for index in range(num_layers)], f"at layer {layer}: {written}"
        assert torch.equal(result.kv, kv)
        whole = store.retrieve(store.lookup(tokens))
        assert torch.equal(whole.kv, result.kv)
        assert sum(tier.num_pinned for tier in store.stats().tiers) == 0


def test_a_corrupt_disk_chunk_is_already_a_gap_when_the_segments_are_reported(
    tmp_path: Path, small_layout: KVLayout
) -> None:
    config = store_config(
        tmp_path, small_layout, CHUNK, gpu_chunks=2, cpu_chunks=2,
        tiers=(TierName.DISK,), enable_segmented_prefix=True,
    )  # fmt: skip
    tokens, kv = make_tokens(4 * CHUNK), make_kv(small_layout, 4 * CHUNK)
    with TieredStore(small_layout, config) as store:
        store.store(tokens, kv)
    keys = prefix_keys(small_layout.namespace, as_token_array(tokens), CHUNK)
    flip_frame_bit(config.data_dir, keys[2])
    with TieredStore(small_layout, config) as store:
        plan = store.lookup(tokens)
        out = sentinel_buffer(small_layout, 4 * CHUNK)
        recorder = Recorder(out, plan.segments[0])
        result = store.retrieve(plan, out, progress=recorder)
        reported = recorder.events[0]
        assert isinstance(reported, tuple) and [segment.start for segment in reported] == [0, 8, 24]
        assert reported == result.segments
        assert recorder.events[1:] == list(range(small_layout.num_layers)), "every layer is reported, copies or not"
        assert torch.equal(out[:, :, 24:], kv[:, :, 24:]) and bool((out[:, :, 16:24] == SENTINEL).all())


def test_the_loader_hands_out_segments_then_layers_and_the_prompt_kv_lands(
    tmp_path: Path, small_layout: KVLayout
) -> None:
    config = store_config(tmp_path, small_layout, CHUNK, gpu_chunks=2, cpu_chunks=4)
    tokens, kv = make_tokens(3 * CHUNK), make_kv(small_layout, 3 * CHUNK)
    loader = KVLoader(torch.device("cpu"))
    try:
        with TieredStore(small_layout, config) as store, torch.inference_mode():
            store.store(tokens, kv)
            plan = store.lookup(tokens)
            out = sentinel_buffer(small_layout, 3 * CHUNK)
            pending = loader.start(lambda buffer, progress: store.retrieve(plan, buffer, progress=progress), out)
            assert [segment.start for segment in pending.segments()] == [0, 8, 16]
            for layer in range(small_layout.num_layers):
                pending.wait_layer(layer)
                assert torch.equal(out[layer], kv[layer])
            pending.settle()
            assert pending.duration_ms() > 0.0
    finally:
        loader.close()


def test_a_failing_retrieve_raises_from_every_wait_and_never_hangs(small_layout: KVLayout) -> None:
    loader = KVLoader(torch.device("cpu"))
    release = threading.Event()

    def retrieve(out: torch.Tensor, progress: RetrieveProgress) -> object:
        release.wait(timeout=5)
        raise ConfigError("plan 1 was already retrieved or released")

    try:
        pending = loader.start(retrieve, sentinel_buffer(small_layout, CHUNK))  # type: ignore[arg-type]
        release.set()
        with pytest.raises(ConfigError, match="already retrieved"):
            pending.segments()
        with pytest.raises(ConfigError, match="already retrieved"):
            pending.wait_layer(0)
        pending.settle()
        assert pending.duration_ms() == 0.0
    finally:
        loader.close()
