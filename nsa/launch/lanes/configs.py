"""One lane's config: the base profile with the grid's layers on top, each field labelled by its layer.

    profile < NSA_* env < lanes.yaml defaults < --steps/--stall-seconds < lane overrides < key=value < grid
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from nsa.config import ConfigError, RunConfig, resolve_config
from nsa.launch.lanes.schema import Lane, LaneError, fmt_value


@dataclass
class LaneConfig:
    lane: Lane
    cfg: RunConfig
    sources: dict[str, str]
    effective: dict[str, Any] = field(default_factory=dict)   # effective fields that differ from the baseline


def lane_config(base: Optional[str], lane: Lane, defaults: dict[str, Any], cli: dict[str, str], *,
                pinned: Optional[dict[str, Any]] = None, steps: Optional[int] = None,
                stall_seconds: Optional[float] = None) -> LaneConfig:
    """Resolve one lane: profile < env < defaults < --steps/--stall-seconds < lane < key=value < pinned.
    Sources name the layer (``lanes.yaml:defaults``, ``flag``, ``lane:<name>``, ``cli``, ``grid``)."""
    layers: list[tuple[str, dict[str, Any]]] = [("lanes.yaml:defaults", defaults)]
    flags = {k: v for k, v in (("train.steps", steps), ("train.stall_seconds", stall_seconds)) if v is not None}
    layers += [("flag", flags), (f"lane:{lane.name}", lane.overrides), ("cli", cli), ("grid", pinned or {})]

    def resolve(extra: dict[str, Any]) -> tuple[RunConfig, dict[str, str]]:
        merged, label = {}, {}
        for origin, vals in layers + [(f"lane:{lane.name} max_steps", extra)]:
            for k, v in vals.items():
                merged[k], label[k] = fmt_value(v), origin
        try:
            cfg, sources = resolve_config(base, [f"{k}={v}" for k, v in merged.items()])
        except ConfigError as e:
            raise LaneError(f"lane {lane.name!r}: {e}") from None
        return cfg, {k: (label.get(k, src) if src == "cli" else src) for k, src in sources.items()}

    cfg, sources = resolve({})
    if lane.max_steps and cfg.train.steps > lane.max_steps and "train.steps" not in cli:
        cfg, sources = resolve({"train.steps": lane.max_steps})
    return LaneConfig(lane, cfg, sources)
