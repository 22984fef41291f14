"""Shared fixtures; factories for inputs live in tests/factories.py."""

from __future__ import annotations

import pytest
from hypothesis import settings

from kvstore.layout import KVLayout, RopeSpec

# Property tests check behaviour, not speed: on a shared 2-core CI machine a bootstrap or a codec example can take
# longer than hypothesis's default 200 ms deadline for reasons that are not the code's (a clean clone failed so).
settings.register_profile("kvstore", deadline=None)
settings.load_profile("kvstore")

# tests/vllm needs vLLM, which lives in .venv-vllm (make test's second part runs it there, naming the directory, which
# this list does not stop); the main suite leaves it out instead of reporting it skipped.
collect_ignore = ["vllm"]


@pytest.fixture
def small_layout() -> KVLayout:
    """A 4-layer, 2-head, 16-dim bf16 layout: 512 bytes per token, chunks stay tiny."""
    return KVLayout(model_id="test/tiny", num_layers=4, num_kv_heads=2, head_dim=16, rope=RopeSpec(theta=1e5))
