"""What a model's KV cache looks like, and the namespace that keeps layouts apart.

A chunk's KV is one tensor ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]``, layer-major so that one layer
of one chunk is one contiguous slice (layerwise loading reads it without a gather)::

    layer 0: | K: tokens x heads x head_dim | V: tokens x heads x head_dim |
    layer 1: | K ...                        | V ...                        |

The *namespace* is a 128-bit hash of every field that changes the KV bytes (model id, shape, dtype, RoPE
parameters). It seeds the prefix-key chain, so two layouts can never share a key. It is computed from a canonical
text encoding (floats as ``float.hex``), never from Python's ``hash()``, so it is identical across processes,
machines and restarts.

Values here are immutable and thread-safe.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import NewType

import torch
import xxhash

from kvstore.errors import ConfigError, InvalidInputError

__all__ = ["KVDtype", "KVLayout", "Namespace", "RopeScaling", "RopeSpec"]

Namespace = NewType("Namespace", bytes)
"""16-byte hash of a layout; the seed of its prefix-key chain."""

_NAMESPACE_FORMAT_VERSION = "kvstore-layout-v1"


class KVDtype(enum.StrEnum):
    """Element types a KV cache may be stored in."""

    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[self.value]

    @property
    def element_size_bytes(self) -> int:
        return 4 if self is KVDtype.FLOAT32 else 2

    @classmethod
    def parse(cls, value: str | torch.dtype) -> KVDtype:
        """Accept ``"bf16"``, ``"bfloat16"``, ``torch.bfloat16`` and friends."""
        if isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        aliases = {
            "fp16": "float16",
            "half": "float16",
            "bf16": "bfloat16",
            "fp32": "float32",
            "float": "float32",
        }
        name = aliases.get(value.lower(), value.lower())
        try:
            return cls(name)
        except ValueError:
            raise ConfigError(
                f"KV dtype {value!r} is not supported; use one of float16 (fp16), bfloat16 (bf16), float32 (fp32)"
            ) from None


class RopeScaling(enum.StrEnum):
    """RoPE frequency schemes of Llama-family models."""

    DEFAULT = "default"
    LINEAR = "linear"
    LLAMA3 = "llama3"


@dataclass(frozen=True, slots=True, kw_only=True)
class RopeSpec:
    """Rotary position embedding parameters; part of the layout because they change the cached K.

    Args:
        theta: base of the rotary frequencies (``rope_theta``), e.g. 1e4 (Llama 2), 5e5 (Llama 3), 1e5 (SmolLM2).
        scaling: frequency scheme.
        factor: position scale (``linear``) or wavelength scale (``llama3``); 1.0 for ``default``.
        low_freq_factor: llama3 scaling only.
        high_freq_factor: llama3 scaling only.
        original_max_position_embeddings: llama3 scaling only.
    """

    theta: float = 10000.0
    scaling: RopeScaling = RopeScaling.DEFAULT
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        object.__setattr__(self, "scaling", RopeScaling(self.scaling))
        if not self.theta > 0:
            raise ConfigError(f"rope theta={self.theta} must be positive (the model config's rope_theta)")
        if not self.factor > 0:
            raise ConfigError(f"rope factor={self.factor} must be positive")

    def canonical(self) -> str:
        return "|".join(
            [
                self.scaling.value,
                float(self.theta).hex(),
                float(self.factor).hex(),
                float(self.low_freq_factor).hex(),
                float(self.high_freq_factor).hex(),
                str(self.original_max_position_embeddings),
            ]
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class KVLayout:
    """Shape, dtype and identity of one model's KV cache.

    Args:
        model_id: a name for the model (e.g. ``"HuggingFaceTB/SmolLM2-135M-Instruct"``); part of the namespace.
        num_layers: transformer layers that hold a KV cache.
        num_kv_heads: key/value heads per layer (after GQA).
        head_dim: elements per head.
        dtype: element type of the cache.
        rope: rotary embedding parameters.
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: KVDtype = KVDtype.BFLOAT16
    rope: RopeSpec = field(default_factory=RopeSpec)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", KVDtype.parse(self.dtype))
        if not self.model_id:
            raise ConfigError(
                "layout model_id is empty; give the model's name, e.g. 'meta-llama/Llama-3.1-8B'"
            )
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"layout {name}={value!r} must be a positive integer")

    @property
    def namespace(self) -> Namespace:
        """128-bit hash of every field; identical in every process and on every machine."""
        text = "|".join(
            [
                _NAMESPACE_FORMAT_VERSION,
                self.model_id,
                str(self.num_layers),
                str(self.num_kv_heads),
                str(self.head_dim),
                self.dtype.value,
                self.rope.canonical(),
            ]
        )
        return Namespace(xxhash.xxh3_128_digest(text.encode("utf-8")))

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token across all layers, K and V."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype.element_size_bytes

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_dim)

    def chunk_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.bytes_per_token

    def check_kv(self, kv: torch.Tensor, num_tokens: int) -> None:
        """Raise ``InvalidInputError`` unless ``kv`` is this layout's KV for ``num_tokens`` tokens.

        Device is not checked here: tiers copy from any device.
        """
        expected = self.chunk_shape(num_tokens)
        if not isinstance(kv, torch.Tensor):
            raise InvalidInputError(
                f"kv must be a torch.Tensor of shape {list(expected)}, got {type(kv).__name__}"
            )
        if tuple(kv.shape) != expected:
            hint = ""
            if kv.dim() == 5 and tuple(kv.shape[:2]) == expected[:2] and tuple(kv.shape[3:]) == expected[3:]:
                hint = f" (kv holds {kv.shape[2]} tokens but {num_tokens} token ids were given)"
            raise InvalidInputError(
                f"kv shape {list(kv.shape)} does not match layout {self.model_id}: expected "
                f"[num_layers, 2, num_tokens, num_kv_heads, head_dim] = {list(expected)}{hint}"
            )
        if kv.dtype != self.dtype.torch_dtype:
            raise InvalidInputError(
                f"kv dtype {kv.dtype} does not match layout dtype {self.dtype.value}; cast it with "
                f"kv.to(torch.{self.dtype.value}) or open the store with the model's dtype"
            )

    def describe(self) -> str:
        """One line for logs and the CLI."""
        return (
            f"{self.model_id} ({self.num_layers} layers x {self.num_kv_heads} kv heads x {self.head_dim}, "
            f"{self.dtype.value}, rope {self.rope.scaling.value} theta={self.rope.theta:g})"
        )

    def to_json(self) -> str:
        """Canonical JSON, stored in a data dir so a reopen can check the layout."""
        rope = self.rope
        return json.dumps(
            {
                "model_id": self.model_id,
                "num_layers": self.num_layers,
                "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim,
                "dtype": self.dtype.value,
                "rope": {
                    "theta": rope.theta,
                    "scaling": rope.scaling.value,
                    "factor": rope.factor,
                    "low_freq_factor": rope.low_freq_factor,
                    "high_freq_factor": rope.high_freq_factor,
                    "original_max_position_embeddings": rope.original_max_position_embeddings,
                },
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> KVLayout:
        try:
            data = json.loads(text)
            rope = RopeSpec(**data.pop("rope"))
            return cls(rope=rope, **data)
        except (ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"cannot read a KV layout from {text[:200]!r}: {exc}") from exc
