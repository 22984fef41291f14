"""RoPE correction: move cached K from the positions it was computed at to the positions it is reused at.

Rotary position embedding turns each pair ``(x[i], x[i + head_dim/2])`` of a key by the angle
``position * inv_freq[i]`` (Hugging Face Llama's ``rotate_half`` convention: the first half of the head pairs with
the second half, not interleaved neighbours). Rotations of a plane compose, so K computed at position ``p`` and
rotated once by ``delta * inv_freq[i]`` is K at ``p + delta``; no un-rotation to position 0 is needed. This module
computes that one rotation, for any mix of deltas::

    keys   [..., num_tokens, num_kv_heads, head_dim]   (a chunk's K: kv[:, 0] of [layers, 2, tokens, heads, dim])
    deltas [..., num_tokens] (or a scalar)             broadcast over the keys' leading dims, one angle per token

so the blender can place several cached segments, each with its own delta, into one prompt and rotate the whole
prompt's K of a layer (or of every layer) in one call (``token_deltas`` builds the per-token deltas from a plan).

Numerics: the inverse frequencies are computed exactly as transformers' rope init functions compute them (float32,
same operation order), so they are bit-identical to a Hugging Face model's ``rotary_emb.inv_freq``; the angles
``delta * inv_freq`` and their cos/sin are computed in float64 (exact for any delta below 2**53) and the rotation
itself in float32, then cast back to the cache dtype. A zero delta is an exact identity in every dtype.

Only frequency schemes whose cos/sin carry no extra attention scaling and no position-dependent frequencies can be
corrected by a rotation: ``default``, ``linear`` and ``llama3``. ``RopeSpec`` cannot express others; a model config
with yarn, dynamic or longrope scaling is refused where the config is read
(``kvstore.models.rope_spec_from_hf_config``).

Values here are immutable; functions are pure and thread-safe. Tensors stay on the device they arrive on.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvstore.errors import ConfigError, InvalidInputError
from kvstore.layout import RopeScaling, RopeSpec

__all__ = ["PlacedRange", "RopeRotator", "Rotation", "inverse_frequencies", "rotate_keys", "token_deltas"]

logger = logging.getLogger(__name__)

_KEY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def inverse_frequencies(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """The ``head_dim // 2`` rotary inverse frequencies of a layout, float32 on the CPU.

    Bit-identical to ``LlamaRotaryEmbedding.inv_freq`` of a Hugging Face model with the same parameters: the same
    float32 operations in the same order (``1 / theta ** (2i / head_dim)``, then the linear or llama3 rescaling).

    Raises:
        ConfigError: ``head_dim`` is not a positive even number.
    """
    if head_dim <= 0 or head_dim % 2:
        raise ConfigError(f"head_dim={head_dim} must be a positive even number for rotary embeddings")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.scaling is RopeScaling.DEFAULT:
        return inv_freq
    if rope.scaling is RopeScaling.LINEAR:
        return inv_freq / rope.factor
    if rope.scaling is RopeScaling.LLAMA3:
        return _llama3_frequencies(inv_freq, rope)
    raise ConfigError(f"rope scaling {rope.scaling!r} has no rotation; use default, linear or llama3")


def _llama3_frequencies(inv_freq: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """Llama 3.1's rescaling: long wavelengths slowed by ``factor``, short ones kept, a smooth ramp between."""
    if rope.high_freq_factor <= rope.low_freq_factor:
        raise ConfigError(
            f"llama3 rope high_freq_factor={rope.high_freq_factor} must exceed low_freq_factor="
            f"{rope.low_freq_factor} (Llama 3.1 uses 4.0 and 1.0)"
        )
    context_tokens = rope.original_max_position_embeddings
    low_freq_wavelength = context_tokens / rope.low_freq_factor
    high_freq_wavelength = context_tokens / rope.high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > low_freq_wavelength, inv_freq / rope.factor, inv_freq)
    smooth = (context_tokens / wavelength - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelength < high_freq_wavelength) * ~(wavelength > low_freq_wavelength)
    return torch.where(is_medium, smoothed, scaled)


@dataclass(frozen=True, slots=True, kw_only=True)
class Rotation:
    """Precomputed cos/sin of one set of deltas on one device; apply it to the K of many layers.

    Built by ``RopeRotator.rotation``. ``cos`` and ``sin`` have shape ``deltas.shape + (1, head_dim // 2)``: the
    ``1`` broadcasts over KV heads, the deltas' own shape broadcasts over the key's leading dims.
    """

    cos: torch.Tensor
    sin: torch.Tensor

    @property
    def head_dim(self) -> int:
        return 2 * int(self.cos.shape[-1])

    @property
    def deltas_shape(self) -> tuple[int, ...]:
        return tuple(self.cos.shape[:-2])

    @property
    def device(self) -> torch.device:
        return self.cos.device

    def apply(self, keys: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
        """Rotate ``keys`` ``[..., num_tokens, num_kv_heads, head_dim]`` by this rotation's deltas.

        Args:
            keys: float16, bfloat16 or float32 keys on this rotation's device; any leading dims (layers, chunks),
                views included.
            in_place: write the result into ``keys`` (no output allocation; ``keys`` must be writable).

        Returns:
            The rotated keys, in ``keys``' dtype: ``keys`` itself when ``in_place``, else a new tensor.

        Raises:
            InvalidInputError: wrong type, dtype, device, head_dim, or deltas that do not broadcast over the keys.
        """
        self._check(keys)
        half = self.head_dim // 2
        first, second = keys[..., :half].float(), keys[..., half:].float()
        rotated_first = first * self.cos
        rotated_first.addcmul_(second, self.sin, value=-1.0)
        rotated_second = second * self.cos
        rotated_second.addcmul_(first, self.sin)
        out = keys if in_place else torch.empty_like(keys)
        out[..., :half].copy_(rotated_first)
        out[..., half:].copy_(rotated_second)
        return out

    def apply_to_kv(self, kv: torch.Tensor) -> None:
        """Rotate, in place, the K half of chunk KV ``[..., num_layers, 2, num_tokens, num_kv_heads, head_dim]``."""
        if not isinstance(kv, torch.Tensor) or kv.dim() < 5 or kv.shape[-4] != 2:
            shape = list(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
            raise InvalidInputError(
                f"kv {shape} is not chunk KV: expected [..., num_layers, 2, num_tokens, num_kv_heads, head_dim] "
                "with K at index 0 of the dim of size 2; pass K alone to Rotation.apply"
            )
        self.apply(kv.select(-4, 0), in_place=True)

    def _check(self, keys: torch.Tensor) -> None:
        if not isinstance(keys, torch.Tensor):
            raise InvalidInputError(f"keys must be a torch.Tensor, got {type(keys).__name__}")
        if keys.dtype not in _KEY_DTYPES:
            raise InvalidInputError(
                f"keys dtype {keys.dtype} cannot be rotated; cached K is float16, bfloat16 or float32"
            )
        if keys.dim() < 3 or keys.shape[-1] != self.head_dim:
            raise InvalidInputError(
                f"keys shape {list(keys.shape)} must end in [num_tokens, num_kv_heads, head_dim={self.head_dim}]"
            )
        if keys.device != self.device:
            raise InvalidInputError(
                f"keys are on {keys.device} but the rotation on {self.device}; build it with "
                "rotator.rotation(deltas, device=keys.device)"
            )
        leading = tuple(keys.shape[:-2])
        deltas_shape = self.deltas_shape
        # The deltas broadcast over the keys without growing them: right-aligned, each dim 1 or equal.
        fits = len(deltas_shape) <= len(leading) and all(
            size in (1, target) for size, target in zip(reversed(deltas_shape), reversed(leading), strict=False)
        )
        if not fits:
            raise InvalidInputError(
                f"deltas of shape {list(self.deltas_shape)} do not broadcast over keys {list(keys.shape)}: give "
                f"one delta per token ([num_tokens] = [{keys.shape[-3]}]) or a scalar"
            )


class RopeRotator:
    """The rotary frequencies of one layout; builds ``Rotation``\\ s for sets of position deltas.

    Args:
        rope: the layout's rotary parameters (``KVLayout.rope``).
        head_dim: elements per head (``KVLayout.head_dim``); must be even.
    """

    def __init__(self, rope: RopeSpec, head_dim: int) -> None:
        self._rope = rope
        self._inv_freq = inverse_frequencies(rope, head_dim)
        self._inv_freq_float64 = self._inv_freq.to(torch.float64)

    @property
    def rope(self) -> RopeSpec:
        return self._rope

    @property
    def head_dim(self) -> int:
        return 2 * int(self._inv_freq.shape[0])

    @property
    def inv_freq(self) -> torch.Tensor:
        """float32 ``[head_dim // 2]``, bit-identical to the Hugging Face model's buffer."""
        return self._inv_freq.clone()

    def rotation(
        self, deltas: int | torch.Tensor, *, device: torch.device | str | None = None
    ) -> Rotation:
        """The rotation that moves K by ``deltas`` positions (negative moves it earlier).

        Args:
            deltas: an int (every token moves by it) or an integer tensor, e.g. ``[num_tokens]`` from
                ``token_deltas``, or ``[num_chunks, 1, num_tokens]`` for keys ``[num_chunks, num_layers, ...]``.
            device: where to build cos/sin; default the deltas tensor's device (CPU for an int).

        Raises:
            InvalidInputError: deltas are not integers.
        """
        if isinstance(deltas, bool) or not isinstance(deltas, int | torch.Tensor):
            raise InvalidInputError(f"deltas must be an int or an integer tensor, got {type(deltas).__name__}")
        if isinstance(deltas, torch.Tensor) and (deltas.dtype.is_floating_point or deltas.dtype.is_complex):
            raise InvalidInputError(
                f"deltas dtype {deltas.dtype} is not an integer type; positions are whole tokens (use torch.int64)"
            )
        target = torch.device(device) if device is not None else (
            deltas.device if isinstance(deltas, torch.Tensor) else torch.device("cpu")
        )
        steps = torch.as_tensor(deltas, dtype=torch.float64, device=target)
        angles = steps[..., None, None] * self._inv_freq_float64.to(target)
        return Rotation(cos=angles.cos().to(torch.float32), sin=angles.sin().to(torch.float32))


def rotate_keys(
    keys: torch.Tensor, deltas: int | torch.Tensor, rope: RopeSpec, *, in_place: bool = False
) -> torch.Tensor:
    """One-off rotation of ``keys`` ``[..., num_tokens, num_kv_heads, head_dim]`` by ``deltas``, on keys' device.

    Callers that rotate many layers with the same deltas build a ``RopeRotator`` and one ``Rotation`` instead.
    """
    if not isinstance(keys, torch.Tensor):
        raise InvalidInputError(f"keys must be a torch.Tensor, got {type(keys).__name__}")
    rotation = RopeRotator(rope, int(keys.shape[-1])).rotation(deltas, device=keys.device)
    return rotation.apply(keys, in_place=in_place)


class PlacedRange(Protocol):
    """A range of a prompt filled from cache, moved by ``rope_delta`` (``kvstore.plan.Segment`` is one)."""

    @property
    def start(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def rope_delta(self) -> int: ...


def token_deltas(ranges: Iterable[PlacedRange], num_tokens: int) -> torch.Tensor:
    """Per-token deltas ``[num_tokens]`` (int64, CPU) of a prompt: each range's delta, 0 elsewhere.

    Tokens outside every range (gaps, the question) get delta 0, an exact identity, so the whole prompt's K can be
    rotated in one call.

    Raises:
        InvalidInputError: a range reaches outside ``[0, num_tokens)`` or overlaps another.
    """
    deltas = torch.zeros(num_tokens, dtype=torch.int64)
    covered = torch.zeros(num_tokens, dtype=torch.bool)
    for placed in ranges:
        end = placed.start + placed.num_tokens
        if placed.start < 0 or placed.num_tokens < 0 or end > num_tokens:
            raise InvalidInputError(
                f"range [{placed.start}, {end}) lies outside the prompt's {num_tokens} tokens"
            )
        if bool(covered[placed.start : end].any()):
            raise InvalidInputError(f"range [{placed.start}, {end}) overlaps an earlier range; plans never overlap")
        covered[placed.start : end] = True
        deltas[placed.start : end] = placed.rope_delta
    return deltas
