"""A/B lanes as one Ray Tune grid: base profile x lane overrides -> the pipeline's one TorchTrainer per lane.

    python lanes/ab_grid.py                                   # the default lanes of lanes/lanes.yaml
    python lanes/ab_grid.py --only baseline,conservative --steps 20 train.lr=1e-3
    python lanes/ab_grid.py --list                            # the lanes and why each exists

Lane config = profile < NSA_* env < lanes.yaml defaults < --steps/--stall-seconds < lane overrides < key=value,
resolved and validated in the driver. A Tuner over ``grid_search(lane names)`` runs one trial per lane, which
fits ``nsa.launch.builder.build_trainer(..., callbacks=[TuneReportCallback()])``. The loop opens one MLflow run
per lane; the grid tags it ``lane``/``grid``. A lane whose worker watchdog recorded a stall is FAILED; one that
does not recover within ``--hang-grace`` is abandoned so it cannot hold the grid. Writes ``<grid dir>/lanes_summary.
{json,md}``. Exit codes: 0 all lanes completed (or --allow-failures), 1 a lane failed, 2 bad input.
Details: lanes/README.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
from typing import Optional, Sequence

from nsa.config import ConfigError
from nsa.launch import builder
from nsa.launch.cli import EXIT_USAGE, UserError
from nsa.launch.lanes.effective import describe
from nsa.launch.lanes.plan import DEFAULT_BASE, GridPlan, plan_grid
from nsa.launch.lanes.report import TERMINAL_WIDTH, format_table, rank, write_figures, write_summary
from nsa.launch.lanes.resources import ensure_lane_gpus, size_concurrency
from nsa.launch.lanes.schema import DEFAULT_LANES, LaneError, load_lanes
from nsa.launch.lanes.tracking import add_histories, finalize_mlflow, log_summary_run
from nsa.launch.lanes.tuner import collect, run_tuner


def run_grid(plan: GridPlan, max_concurrent: Optional[int] = None) -> int:
    """Connect Ray, size the grid, run it, tag MLflow, print and write the summary. Returns the exit code."""
    t0 = time.time()
    print(builder.connect_ray(plan.base_cfg), flush=True)
    ensure_lane_gpus([lc.cfg for lc in plan.lanes], max_concurrent)   # a cold GPU cluster: autoscale first
    plan.max_concurrent = size_concurrency(plan, max_concurrent)
    plan.grid_dir.mkdir(parents=True, exist_ok=True)
    if plan.mlflow_uri:    # create the SQLite tables here: two lanes creating a fresh store at once could race
        from nsa.telemetry.loggers import ensure_local_store
        ensure_local_store(plan.mlflow_uri)      # artifact root beside the store, Default's too
    print(f"grid {plan.grid_id}: {len(plan.lanes)} lanes, {plan.max_concurrent} at a time, dir {plan.grid_dir}\n"
          + textwrap.fill(", ".join(lc.lane.name for lc in plan.lanes), TERMINAL_WIDTH, initial_indent="  lanes: ",
                          subsequent_indent=" " * 9), flush=True)
    for lane, why in plan.skipped:
        print(f"lane {lane.name}: skipped on this base: {why}", flush=True)
    records = collect(plan, run_tuner(plan))
    finalize_mlflow(plan, records)
    add_histories(plan, records)
    records = rank(records)
    failed = [r for r in records if r["status"] != "COMPLETED"]
    code = 1 if failed and not plan.allow_failures else 0
    wall = time.time() - t0
    jpath, mpath = write_summary(plan, records, wall, code)
    parent = log_summary_run(plan, records, [jpath, mpath, *write_figures(plan, records)])
    print(f"\n== lanes grid {plan.grid_id}: {len(records) - len(failed)}/{len(records)} completed, "
          f"{len(plan.skipped)} skipped, in {wall:.0f}s")
    print(format_table(records, plan.skipped))
    for r in failed:     # the error itself is in the table's notes
        print(f"FAILED {r['lane']}: run dir {r['run_dir']}")
    print(f"summary: {jpath}\n         {mpath}")
    if plan.mlflow_uri:
        print(f"mlflow:  mlflow ui --backend-store-uri {plan.mlflow_uri}\n         experiment {plan.experiment}, "
              f"tag grid={plan.grid_id}; summary run {parent}", flush=True)
    return code


def _lanes_epilog(path: str = DEFAULT_LANES) -> str:
    try:
        lanes = load_lanes(path)[1].values()
    except LaneError as e:
        return f"lanes: {e}"
    rows = [f"  {ln.name:<16}{ln.why[:100]}" + ("" if ln.default else " [--only]") for ln in lanes]
    return "lanes of lanes/lanes.yaml (--list shows their overrides):\n" + "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ab_grid.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_lanes_epilog())
    p.add_argument("--base", default=DEFAULT_BASE, help=f"base profile (default {DEFAULT_BASE})")
    p.add_argument("--lanes", default=DEFAULT_LANES, help="lanes file (default lanes/lanes.yaml)")
    p.add_argument("--only", help="comma-separated lane names (default: every lane with default: true)")
    p.add_argument("--max-concurrent", type=int, help="lanes at once (default: as many as the CPUs fit)")
    p.add_argument("--steps", type=int, help="train.steps for every lane (lanes' max_steps still cap it)")
    p.add_argument("--stall-seconds", type=float, help="train.stall_seconds (worker watchdog) for every lane")
    p.add_argument("--hang-grace", type=float, help="seconds a lane may still recover after a stall record "
                   "before the grid ends it (default: the stall timeout; 0: never end it)")
    p.add_argument("--name", help="grid id and directory name under logging.root (default lanes-<time>-<hex>)")
    p.add_argument("--overwrite", action="store_true", help="run again under the --name of an earlier grid: its "
                   "folder is moved aside to <name>.replaced-<time> first (without it such a grid is refused)")
    p.add_argument("--allow-failures", action="store_true", help="exit 0 even if a lane failed")
    p.add_argument("--list", action="store_true", help="print the lanes and exit")
    p.add_argument("--print-config", action="store_true", help="print every lane's non-default config and exit")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="overrides for every lane (highest)")
    return p


def _print_lanes(path: str) -> None:
    for ln in load_lanes(path)[1].values():
        extra = ("" if ln.default else " [not default]") + (f" [max_steps {ln.max_steps}]" if ln.max_steps else "")
        extra += (f" [requires {','.join(ln.requires)}]" if ln.requires else "") + (
            " [skip_if_baseline]" if ln.skip_if_baseline else "") + (f" [repeat {ln.repeat}]" if ln.repeat > 1 else "")
        extra += f" [checks {','.join(ln.checks)}]" if ln.checks else ""
        print(f"{ln.name:<14} {ln.why}{extra}\n{'':<14} {json.dumps(ln.overrides)}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.list:
            _print_lanes(args.lanes)
            return 0
        if args.steps is not None and args.steps < 1:
            raise LaneError(f"--steps={args.steps} must be >= 1")
        plan = plan_grid(args, validate=not args.print_config)
        if args.print_config:
            for lc in plan.lanes:
                print(f"== lane {lc.lane.name}: {lc.lane.why}")
                print(f"  effective vs baseline: {describe(lc.effective, sorted(lc.effective)) or 'none (the baseline)'}")
                print("\n".join(f"  {k} = {v!r}  [{lc.sources[k]}]" for k, v in lc.cfg.flat().items()
                                if lc.sources[k] != "default"))
            for lane, why in plan.skipped:
                print(f"== lane {lane.name}: skipped on this base: {why}")
            return 0
        try:
            return run_grid(plan, args.max_concurrent)
        finally:
            plan.release()
    except (LaneError, UserError, ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
