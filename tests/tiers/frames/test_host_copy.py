"""copy_tensor: host copies by numpy keep every bit; anything else is Tensor.copy_'s."""

from __future__ import annotations

import pytest
import torch

from kvstore.tiers.frames.host_copy import copy_tensor


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_strided_host_copy_keeps_every_bit(dtype: torch.dtype) -> None:
    src = torch.randn(3, 2, 5, 4, dtype=torch.float32).to(dtype)
    src[0, 0, 0, :2] = torch.tensor([float("nan"), -0.0])
    strided = src.transpose(2, 3).contiguous().transpose(2, 3)
    dst = torch.empty_like(src).transpose(0, 1).contiguous().transpose(0, 1)  # a strided destination too
    assert not strided.is_contiguous() and not dst.is_contiguous()
    copy_tensor(dst, strided)
    assert torch.equal(dst.view(torch.int16 if src.element_size() == 2 else torch.int32),
                       src.view(torch.int16 if src.element_size() == 2 else torch.int32))  # fmt: skip


def test_a_dtype_conversion_or_broadcast_falls_back_to_copy_() -> None:
    src = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    converted = torch.empty(2, 3, dtype=torch.bfloat16)
    copy_tensor(converted, src)
    assert torch.equal(converted, src.to(torch.bfloat16))
    broadcast = torch.empty(4, 2, 3)
    copy_tensor(broadcast, src)
    assert torch.equal(broadcast, src.expand(4, 2, 3))


def test_a_source_that_requires_grad_is_copied() -> None:
    src = torch.randn(2, 3, requires_grad=True)
    dst = torch.empty(2, 3)
    copy_tensor(dst, src)
    assert torch.equal(dst, src.detach())
