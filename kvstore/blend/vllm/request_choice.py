"""Whether and how one request is blended: the deployment's settings, overridden by the request's own parameters.

A request opts out, changes its ratio or asks for the selected positions through vLLM's per-request
``kv_transfer_params`` (``SamplingParams(extra_args={"kv_transfer_params": {...}})``, or the OpenAI server's
``kv_transfer_params`` field)::

    {"kvstore": {"blend": false}}                  # the exact prefix path only
    {"kvstore": {"blend_ratio": 1.0}}              # this request recomputes every blended token
    {"kvstore": {"blend_report_selection": true}}  # the response lists the recomputed positions

Blending must be on for the deployment (``kvstore.blend``): a request cannot turn on what the engine was not started
with (its plugin, a server with the content index); it is told so in its response. A bad value cannot fail the
request (vLLM's scheduler has no way to reject one), so it is ignored and named in the response's ``ignored``.

Pure values; no engine imports.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

__all__ = ["BlendChoice", "DeploymentBlend", "blend_choice"]

_KEYS = ("blend", "blend_ratio", "blend_report_selection")


class DeploymentBlend(Protocol):
    """The deployment's blend settings a request starts from (the connector's ``ConnectorSettings`` has them)."""

    @property
    def blend(self) -> bool: ...

    @property
    def blend_ratio(self) -> float: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class BlendChoice:
    """One request's blend settings.

    Args:
        enabled: blend this request.
        ratio: its recompute ratio.
        report_selection: list the recomputed positions in the response.
        notes: what the response should say about the request's own parameters (ignored keys, an opt-in the
            deployment cannot honour); empty when there is nothing to say.
    """

    enabled: bool
    ratio: float
    report_selection: bool = False
    notes: tuple[str, ...] = ()


def blend_choice(settings: DeploymentBlend, transfer_params: Mapping[str, object] | None) -> BlendChoice:
    """The deployment's blend settings with the request's ``kv_transfer_params["kvstore"]`` applied."""
    raw = (transfer_params or {}).get("kvstore") if isinstance(transfer_params, Mapping) else None
    asked: Mapping[str, object] = raw if isinstance(raw, Mapping) else {}
    notes: list[str] = []
    if raw is not None and not isinstance(raw, Mapping):
        notes.append(f"ignored kvstore={raw!r}: expected an object")
    enabled, ratio, report_selection = settings.blend, settings.blend_ratio, False
    for key, value in asked.items():
        if key == "blend" and isinstance(value, bool):
            if value and not settings.blend:
                notes.append("blend is off for this deployment (kvstore.blend): not blended")
            enabled = value and settings.blend
        elif key == "blend_ratio" and _is_fraction(value):
            ratio = float(value)  # type: ignore[arg-type]
        elif key == "blend_report_selection" and isinstance(value, bool):
            report_selection = value
        elif key in _KEYS:
            notes.append(f"ignored {key}={value!r}: not a valid value")
        # other keys under "kvstore" belong to no one yet: left alone, as vLLM leaves unknown parameters
    return BlendChoice(enabled=enabled, ratio=ratio, report_selection=report_selection, notes=tuple(notes))


def _is_fraction(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and 0.0 <= value <= 1.0
