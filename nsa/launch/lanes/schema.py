"""The lanes file (lanes/lanes.yaml): ``defaults:`` applied to every lane and named lanes, each a one-line
``why`` plus config overrides. Parsing only: resolving a lane's config is nsa/launch/lanes/configs.py."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from nsa.config import ConfigError, parse_overrides
from nsa.launch.cli import REPO_ROOT

DEFAULT_LANES = str(REPO_ROOT / "lanes" / "lanes.yaml")
LANE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")   # used as a directory and MLflow run name
REQUIREMENTS = ("gpu", "flash_attn")
CHECKS = ("prefill",)
LANE_FIELDS = ("why", "overrides", "max_steps", "default", "requires", "skip_if_baseline", "repeat", "checks")
PINNED = ("logging.root", "logging.name", "logging.experiment", "logging.mlflow_uri", "train.resume")


class LaneError(ValueError):
    """Bad lanes file, lane selection or grid option (exit code 2)."""


@dataclass(frozen=True)
class Lane:
    name: str
    why: str
    overrides: dict[str, Any]
    max_steps: Optional[int] = None     # cap on train.steps (slow-by-design lanes), unless key=value sets it
    default: bool = True                # part of the grid when --only is not given
    requires: tuple[str, ...] = ()      # of REQUIREMENTS: unmet on this base -> the lane is skipped, with why
    skip_if_baseline: bool = False      # a switch the base may already set: skipped (not refused) where it does
    repeat: int = 1                     # runs of the same config; 2 compares their losses step by step
    checks: tuple[str, ...] = ()        # of CHECKS, run on the lane's final model


def fmt_value(v: Any) -> str:
    """A YAML value as the text of a ``key=value`` override."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return "null" if v is None else str(v)


def _as_override_dict(where: str, body: Any) -> dict[str, Any]:
    """A lane's overrides as {dotted key: value}: a mapping, or a list of 'key=value' strings."""
    if body is None:
        return {}
    if isinstance(body, list):
        if not all(isinstance(s, str) for s in body):
            raise LaneError(f"{where}: a list of overrides must hold 'section.key=value' strings")
        out = dict(parse_overrides(body))
    elif isinstance(body, dict):
        out = {str(k): v for k, v in body.items()}
        parse_overrides([f"{k}={fmt_value(v)}" for k, v in out.items()])   # unknown keys -> ConfigError
    else:
        raise LaneError(f"{where}: overrides must be a mapping or a list of 'section.key=value' strings")
    return out


def _parse_lane(name: str, body: Any, path: Path) -> Lane:
    where = f"{path}: lane {name!r}"
    if not LANE_NAME.fullmatch(name):    # fullmatch: "$" alone lets a trailing newline through
        raise LaneError(f"{where}: a lane name must be letters, digits, '_', '.', '-' (it names a directory)")
    if not isinstance(body, dict):
        raise LaneError(f"{where} must be a mapping with 'why' and 'overrides'")
    unknown = set(body) - set(LANE_FIELDS)
    if unknown:
        raise LaneError(f"{where}: unknown fields {sorted(unknown)}; allowed: {', '.join(LANE_FIELDS)}")
    why = body.get("why")
    if not isinstance(why, str) or not why.strip():
        raise LaneError(f"{where}: add a one-line 'why' (what the lane isolates)")
    max_steps = body.get("max_steps")
    if max_steps is not None and (not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1):
        raise LaneError(f"{where}: max_steps={max_steps!r} must be a positive integer")
    try:
        overrides = _as_override_dict(where, body.get("overrides"))
    except ConfigError as e:
        raise LaneError(f"{where}: {e}") from None
    pinned = sorted(set(overrides) & set(PINNED))
    if pinned:
        raise LaneError(f"{where}: {pinned} are set by the grid for every lane; remove them from the lane")
    requires, checks = _names(where, "requires", body.get("requires"), REQUIREMENTS), _names(
        where, "checks", body.get("checks"), CHECKS)
    repeat = body.get("repeat", 1)
    if repeat not in (1, 2):
        raise LaneError(f"{where}: repeat={repeat!r} must be 1 or 2 (2: run twice and compare the losses)")
    return Lane(name, why.strip(), overrides, max_steps, bool(body.get("default", True)), requires,
                bool(body.get("skip_if_baseline", False)), repeat, checks)


def _names(where: str, field: str, value: Any, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """A lane's list field (requires, checks): a list of known names."""
    items = [value] if isinstance(value, str) else (value or [])
    if not isinstance(items, list) or any(v not in allowed for v in items):
        raise LaneError(f"{where}: {field}={value!r} must be a list of {list(allowed)}")
    return tuple(dict.fromkeys(items))


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (plain YAML keeps the last silently)."""


def _unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise LaneError(f"{key!r} is given twice in one mapping (line {key_node.start_mark.line + 1}); "
                            "each lane and key must appear once")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def load_lanes(path: str | Path) -> tuple[dict[str, Any], dict[str, Lane]]:
    """Parse a lanes file: (defaults applied to every lane, {name: Lane}) in file order."""
    p = Path(path)
    if not p.is_file():
        raise LaneError(f"lanes file {str(p)!r} does not exist (the default is lanes/lanes.yaml)")
    try:
        raw = yaml.load(p.read_text(), Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as e:
        raise LaneError(f"{p} is not valid YAML: {e}") from None
    except LaneError as e:
        raise LaneError(f"{p}: {e}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("lanes"), dict) or not raw["lanes"]:
        raise LaneError(f"{p}: expected a mapping with a non-empty 'lanes:' mapping (and optional 'defaults:')")
    extra = set(raw) - {"defaults", "lanes"}
    if extra:
        raise LaneError(f"{p}: unknown top-level keys {sorted(extra)}; allowed: defaults, lanes")
    try:
        defaults = _as_override_dict(f"{p}: defaults", raw.get("defaults"))
    except ConfigError as e:
        raise LaneError(f"{p}: defaults: {e}") from None
    lanes = {str(n): _parse_lane(str(n), b, p) for n, b in raw["lanes"].items()}
    return defaults, lanes


def select_lanes(lanes: dict[str, Lane], only: Optional[Sequence[str]]) -> list[Lane]:
    """The lanes named in ``only`` (in that order), else every lane with ``default: true``."""
    if not only:
        return [ln for ln in lanes.values() if ln.default]
    unknown = [n for n in only if n not in lanes]
    if unknown:
        raise LaneError(f"unknown lane(s) {unknown}; known lanes: {', '.join(lanes)} (see --list)")
    return [lanes[n] for n in dict.fromkeys(only)]
