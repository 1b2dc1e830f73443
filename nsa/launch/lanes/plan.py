"""The grid plan: every chosen lane resolved and validated in the driver, before Ray starts."""
from __future__ import annotations

import argparse
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from nsa.config import ConfigError, RunConfig, parse_overrides, resolve_config
from nsa.launch import builder
from nsa.launch.cli import resolve_profile
from nsa.launch.lanes.configs import LaneConfig, lane_config
from nsa.launch.lanes.schema import LANE_NAME, LaneError, load_lanes, select_lanes

DEFAULT_BASE = "pipelines/configs/tiny_cpu.yaml"


@dataclass
class GridPlan:
    grid_id: str
    grid_dir: Path
    base: Optional[str]
    base_cfg: RunConfig
    lanes: list[LaneConfig]
    mlflow_uri: Optional[str]
    experiment: str
    hang_grace: float
    max_concurrent: int = 1
    allow_failures: bool = False

    def payload(self) -> dict[str, Any]:
        """What every trial needs (plain data: it travels through Ray's object store)."""
        return {"grid_id": self.grid_id, "mlflow_uri": self.mlflow_uri, "hang_grace": self.hang_grace,
                "base": self.base,
                "lanes": {lc.lane.name: {"cfg": lc.cfg.to_dict(), "sources": lc.sources, "why": lc.lane.why,
                                         "overrides": lc.lane.overrides} for lc in self.lanes}}


def _grid_id(name: Optional[str]) -> str:
    if name:
        if not LANE_NAME.match(name):
            raise LaneError(f"--name={name!r} must be letters, digits, '_', '.', '-'")
        return name
    return f"lanes-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def plan_grid(args: argparse.Namespace) -> GridPlan:
    """Everything checkable without Ray: lanes file, selection, every lane's config, grid paths."""
    defaults, lanes = load_lanes(args.lanes)
    chosen = select_lanes(lanes, [n.strip() for n in (args.only or "").split(",") if n.strip()])
    try:
        cli = parse_overrides(list(args.overrides))
    except ConfigError as e:
        raise LaneError(f"key=value overrides: {e}") from None
    if "logging.name" in cli:
        raise LaneError("logging.name: lanes are named after themselves; name the grid with --name")
    base = resolve_profile(args.base)
    try:
        base_cfg, _ = resolve_config(base, [f"{k}={v}" for k, v in cli.items()])
    except ConfigError as e:
        raise LaneError(f"base profile: {e}") from None
    base_cfg.logging.root = str(Path(base_cfg.logging.root).expanduser().resolve())
    grid_id = _grid_id(args.name)
    grid_dir = Path(base_cfg.logging.root) / grid_id
    uri = builder.mlflow_uri(base_cfg)         # one store beside the pipeline's own runs
    experiment = cli.get("logging.experiment") or f"{base_cfg.logging.experiment}-lanes"
    pinned = {"logging.root": str(grid_dir), "logging.experiment": experiment,
              "logging.mlflow_uri": uri, "train.resume": "never"}
    resolved = []
    for lane in chosen:
        lc = lane_config(base, lane, defaults, cli, pinned={**pinned, "logging.name": lane.name},
                         steps=args.steps, stall_seconds=args.stall_seconds)
        try:
            builder.validate_inputs(lc.cfg)    # data prepared once here, never by two trials at once
        except ValueError as e:
            raise LaneError(f"lane {lane.name!r}: {e}") from None
        resolved.append(lc)
    stall = max(lc.cfg.train.stall_seconds for lc in resolved)
    grace = args.hang_grace if args.hang_grace is not None else stall
    if grace < 0:
        raise LaneError(f"--hang-grace={grace} must be >= 0 (0: wait for a stalled lane forever)")
    return GridPlan(grid_id, grid_dir, base, base_cfg, resolved, uri, experiment, grace,
                    allow_failures=args.allow_failures)
