"""The grid plan: every chosen lane resolved and validated in the driver, before Ray starts."""
from __future__ import annotations

import argparse
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from nsa.config import ConfigError, RunConfig, check_run_name, parse_overrides, resolve_config
from nsa.launch import builder
from nsa.launch.cli import resolve_profile
from nsa.launch.lanes.claim import claim_grid
from nsa.launch.lanes.configs import LaneConfig, lane_config
from nsa.launch.lanes.effective import describe, differing, effective_config, same_as, unmet_requirement
from nsa.launch.lanes.schema import Lane, LaneError, load_lanes, select_lanes
from nsa.launch.storage import run_root

DEFAULT_BASE = "pipelines/configs/tiny_cpu.yaml"
BASELINE = "baseline"


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
    skipped: list[tuple[Lane, str]] = field(default_factory=list)   # (lane, why it does not run on this base)
    lock: Any = None        # the grid folder's lock (nsa/launch/lanes/claim.py), held until the grid ends

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()

    def payload(self) -> dict[str, Any]:
        """What every trial needs (plain data: it travels through Ray's object store)."""
        return {"grid_id": self.grid_id, "mlflow_uri": self.mlflow_uri, "hang_grace": self.hang_grace,
                "base": self.base,
                "lanes": {lc.lane.name: {"cfg": lc.cfg.to_dict(), "sources": lc.sources, "why": lc.lane.why,
                                         "overrides": lc.lane.overrides, "repeat": lc.lane.repeat,
                                         "checks": list(lc.lane.checks)} for lc in self.lanes},
                "order": [lc.lane.name for lc in self.lanes]}


def _grid_id(name: Optional[str]) -> str:
    if name:
        try:     # the rules of a run name (length, ASCII characters Ray takes): it names the grid's folder
            return check_run_name(name, "--name")
        except ConfigError as e:
            raise LaneError(str(e)) from None
    return f"lanes-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def resolve_lanes(base_cfg: RunConfig, baseline: Lane, chosen: list[Lane], one: Any, base_name: str
                  ) -> tuple[list[LaneConfig], list[tuple[Lane, str]]]:
    """Resolve the chosen lanes; skip those the base cannot run (``requires``) or that a
    ``skip_if_baseline`` lane's base already is; refuse a lane whose effective config equals the
    baseline's or another lane's, naming both and the fields that would have to differ."""
    where = f"on base {base_name} ({'GPU' if base_cfg.runtime.use_gpu else 'CPU'})"
    base_eff, base_notes = effective_config(one(baseline).cfg, baseline)
    base_eff = {**base_eff, "lane.repeat": 1, "lane.checks": ""}
    resolved, skipped, seen = [], [], {}
    for lane in chosen:
        why = unmet_requirement(lane, base_cfg)
        if why:
            skipped.append((lane, why))
            continue
        lc = one(lane)
        if lane.repeat > 1 and (not lc.cfg.logging.csv or lc.cfg.logging.log_every != 1):
            raise LaneError(f"lane {lane.name!r}: repeat compares training.csv step by step; it needs "
                            "logging.csv=true and logging.log_every=1")
        eff, notes = effective_config(lc.cfg, lane)
        raw = lc.cfg.flat()
        if lane.name != BASELINE and eff == base_eff:
            if lane.skip_if_baseline:
                skipped.append((lane, f"the base already runs this lane: {same_as(lane, notes, raw, BASELINE, base_notes)}"))
                continue
            raise LaneError(f"lane {lane.name!r} has the same effective config as lane {BASELINE!r} {where}: "
                            f"{same_as(lane, notes, raw, BASELINE, base_notes)}; at least one field must differ from "
                            f"{BASELINE} (or give the lane 'skip_if_baseline: true' or 'requires: [gpu]')")
        key = repr(sorted(eff.items()))
        if key in seen:
            other, o_eff = seen[key]
            keys = sorted(set(lane.overrides) | set(other.lane.overrides))
            raise LaneError(f"lanes {other.lane.name!r} and {lane.name!r} have the same effective config {where} "
                            f"({describe(eff, keys) or 'no overrides'}); at least one of the fields "
                            f"{keys or 'of either lane'} must resolve differently between them")
        seen[key] = (lc, eff)
        lc.effective = {k: eff[k] for k in differing(eff, base_eff)}
        resolved.append(lc)
    return resolved, skipped


def plan_grid(args: argparse.Namespace, validate: bool = True) -> GridPlan:
    """Everything checkable without Ray: lanes file, selection, every lane's config and effective config,
    grid paths. ``validate=False`` (--print-config) skips the data checks, so any base profile prints."""
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
    base_cfg.logging.root = str(run_root(base_cfg))       # runtime.storage_root applies
    grid_id = _grid_id(args.name)
    grid_dir = Path(base_cfg.logging.root) / grid_id
    uri = builder.mlflow_uri(base_cfg)         # one store beside the pipeline's own runs
    experiment = cli.get("logging.experiment") or f"{base_cfg.logging.experiment}-lanes"
    pinned = {"logging.root": str(grid_dir), "logging.experiment": experiment,
              "logging.mlflow_uri": uri, "train.resume": "never"}
    one = lambda ln: lane_config(base, ln, defaults, cli, pinned={**pinned, "logging.name": ln.name},  # noqa: E731
                                 steps=args.steps, stall_seconds=args.stall_seconds)
    resolved, skipped = resolve_lanes(base_cfg, lanes.get(BASELINE, Lane(BASELINE, "the base profile", {})),
                                      chosen, one, Path(base).name if base else "the defaults")
    if not resolved:
        raise LaneError("no chosen lane runs on this base: " + "; ".join(f"{ln.name}: {why}" for ln, why in skipped))
    stall = max(lc.cfg.train.stall_seconds for lc in resolved)
    grace = args.hang_grace if args.hang_grace is not None else stall
    if grace < 0:
        raise LaneError(f"--hang-grace={grace} must be >= 0 (0: wait for a stalled lane forever)")
    # the grid owns its folder from here on (before the data checks, which may build the default data)
    lock = claim_grid(grid_id, grid_dir, getattr(args, "overwrite", False), uri) if validate else None
    try:
        for lc in resolved if validate else []:
            try:
                builder.validate_inputs(lc.cfg)    # data prepared once here, never by two trials at once
            except ValueError as e:
                raise LaneError(f"lane {lc.lane.name!r}: {e}") from None
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return GridPlan(grid_id, grid_dir, base, base_cfg, resolved, uri, experiment, grace,
                    allow_failures=args.allow_failures, skipped=skipped, lock=lock)
