#!/usr/bin/env python
"""A/B lanes as one Ray Tune grid: base profile x lane overrides -> the pipeline's one TorchTrainer per lane.

    python lanes/ab_grid.py                                   # the default lanes of lanes/lanes.yaml
    python lanes/ab_grid.py --only baseline,conservative --steps 20 train.lr=1e-3
    python lanes/ab_grid.py --list                            # the lanes and why each exists

Lane config = profile < NSA_* env < lanes.yaml defaults < --steps/--stall-seconds < lane overrides < key=value,
resolved and validated in the driver. A Tuner over ``grid_search(lane names)`` runs one trial per lane, which
fits ``builder.build_trainer(..., callbacks=[TuneReportCallback()])``. The loop opens one MLflow run per lane;
the grid tags it ``lane``/``grid``. A lane whose worker watchdog recorded a stall is FAILED; one that does not
recover within ``--hang-grace`` is abandoned so it cannot hold the grid. Writes ``<grid dir>/lanes_summary.
{json,md}``. Exit codes: 0 all lanes completed (or --allow-failures), 1 a lane failed, 2 bad input.
Details: lanes/README.md.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import secrets
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
PIPELINES = REPO_ROOT / "pipelines"
for _p in (str(REPO_ROOT), str(PIPELINES)):      # `import builder` like the entry points do
    if _p not in sys.path:
        sys.path.insert(0, _p)

import yaml  # noqa: E402

from nsa.config import ConfigError, RunConfig, config_from_dict, parse_overrides, resolve_config  # noqa: E402
from nsa.train.reporting import write_json  # noqa: E402

DEFAULT_BASE = "pipelines/configs/tiny_cpu.yaml"
DEFAULT_LANES = str(Path(__file__).resolve().parent / "lanes.yaml")
TRIAL_CPU = 0.01          # the trial's driver only waits on fit(); Tune refuses a request of 0 resources
SILENCE_FLOOR_S = 120.0   # hang_verdict rule (2) never fires sooner: worker start-up is silent and slow
DATA_TASK_CPUS = 1.0      # what one Ray Data read/map task asks for (Ray's default; builder sets none)
LANE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")   # used as a directory and MLflow run name
PINNED = ("logging.root", "logging.name", "logging.experiment", "logging.mlflow_uri", "train.resume")
RESULT_FILE = "lane_result.json"


class LaneError(ValueError):
    """Bad lanes file, lane selection or grid option (exit code 2)."""


class LaneFailed(RuntimeError):
    """Raised by a trial whose lane did not complete cleanly, so the ResultGrid records the error."""


# ------------------------------------------------------------------------------------------ lanes file
@dataclass(frozen=True)
class Lane:
    name: str
    why: str
    overrides: dict[str, Any]
    max_steps: Optional[int] = None     # cap on train.steps (slow-by-design lanes), unless key=value sets it
    default: bool = True                # part of the grid when --only is not given


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
        parse_overrides([f"{k}={_fmt_value(v)}" for k, v in out.items()])   # unknown keys -> ConfigError
    else:
        raise LaneError(f"{where}: overrides must be a mapping or a list of 'section.key=value' strings")
    return out


def _parse_lane(name: str, body: Any, path: Path) -> Lane:
    where = f"{path}: lane {name!r}"
    if not LANE_NAME.match(name):
        raise LaneError(f"{where}: a lane name must be letters, digits, '_', '.', '-' (it names a directory)")
    if not isinstance(body, dict):
        raise LaneError(f"{where} must be a mapping with 'why' and 'overrides'")
    unknown = set(body) - {"why", "overrides", "max_steps", "default"}
    if unknown:
        raise LaneError(f"{where}: unknown fields {sorted(unknown)}; allowed: why, overrides, max_steps, default")
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
    return Lane(name, why.strip(), overrides, max_steps, bool(body.get("default", True)))


def load_lanes(path: str | Path) -> tuple[dict[str, Any], dict[str, Lane]]:
    """Parse a lanes file: (defaults applied to every lane, {name: Lane}) in file order."""
    p = Path(path)
    if not p.is_file():
        raise LaneError(f"lanes file {str(p)!r} does not exist (the default is lanes/lanes.yaml)")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise LaneError(f"{p} is not valid YAML: {e}") from None
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


# ------------------------------------------------------------------------------------------ configs
def _fmt_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return "null" if v is None else str(v)


@dataclass
class LaneConfig:
    lane: Lane
    cfg: RunConfig
    sources: dict[str, str]


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
                merged[k], label[k] = _fmt_value(v), origin
        try:
            cfg, sources = resolve_config(base, [f"{k}={v}" for k, v in merged.items()])
        except ConfigError as e:
            raise LaneError(f"lane {lane.name!r}: {e}") from None
        return cfg, {k: (label.get(k, src) if src == "cli" else src) for k, src in sources.items()}

    cfg, sources = resolve({})
    if lane.max_steps and cfg.train.steps > lane.max_steps and "train.steps" not in cli:
        cfg, sources = resolve({"train.steps": lane.max_steps})
    return LaneConfig(lane, cfg, sources)


# ------------------------------------------------------------------------------------------ plan
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
                "pipelines": str(PIPELINES), "base": self.base,
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
    import builder
    defaults, lanes = load_lanes(args.lanes)
    chosen = select_lanes(lanes, [n.strip() for n in (args.only or "").split(",") if n.strip()])
    try:
        cli = parse_overrides(list(args.overrides))
    except ConfigError as e:
        raise LaneError(f"key=value overrides: {e}") from None
    if "logging.name" in cli:
        raise LaneError("logging.name: lanes are named after themselves; name the grid with --name")
    from _cli import resolve_profile
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


# ------------------------------------------------------------------------------------------ resources
def lane_demand(cfg: RunConfig) -> dict[str, float]:
    """Logical resources one running lane holds: its worker group plus its trial's driver."""
    import builder
    n, per = builder.resolve_num_workers(cfg), builder.worker_resources(cfg)
    return {"CPU": n * per["CPU"] + TRIAL_CPU, "GPU": n * per.get("GPU", 0.0)}


def size_concurrency(plan: GridPlan, requested: Optional[int]) -> int:
    """Check every lane fits the cluster and how many fit at once, leaving Ray Data its CPU share (the
    2-core deadlock). An unplaceable worker group is retried forever by Ray, so refuse that before fit().
    The default also stays within the local cores when this process started the Ray instance."""
    import os
    import builder
    import ray
    total = ray.cluster_resources()
    for lc in plan.lanes:
        try:
            builder.check_resources(lc.cfg, builder.resolve_num_workers(lc.cfg))
        except ValueError as e:
            raise LaneError(f"lane {lc.lane.name!r}: {e}") from None
    need = {k: max(lane_demand(lc.cfg)[k] for lc in plan.lanes) for k in ("CPU", "GPU")}
    # the lanes' Ray Data tasks share what the worker groups leave; each task needs DATA_TASK_CPUS at once,
    # so less than that left free deadlocks every lane at its first batch (seen with 2 lanes on 2 CPUs)
    keep = max(builder.MIN_FREE_DATA_CPUS, DATA_TASK_CPUS)
    free = {"CPU": total.get("CPU", 0.0) - keep, "GPU": total.get("GPU", 0.0)}
    fit = max(0, min(int((free[k] + 1e-9) // v) for k, v in need.items() if v > 0))
    room = (f"each lane holds up to {need['CPU']:g} CPU" + (f" and {need['GPU']:g} GPU" if need["GPU"] else "")
            + f"; the cluster has {total.get('CPU', 0):g} CPU, {keep:g} of them kept for Ray Data tasks")
    if fit < 1:
        raise LaneError(f"no lane fits: {room}; lower runtime.cpus_per_worker or raise runtime.ray_num_cpus")
    if requested is not None:
        if not 1 <= requested <= fit:
            raise LaneError(f"--max-concurrent={requested}: {room}, so 1 to {fit} lanes fit at once "
                            "(lower runtime.cpus_per_worker to fit more)")
        return requested
    local_cap = (os.cpu_count() or 1) if not plan.base_cfg.runtime.ray_address else fit
    return max(1, min(fit, len(plan.lanes), local_cap))


# ------------------------------------------------------------------------------------------ lane records
def _read_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def stall_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every ``stall`` heartbeat the lane's watchdogs wrote (all ranks)."""
    return [r for r in read_heartbeats(run_dir) if r.get("kind") == "stall"]


def read_heartbeats(run_dir: Path) -> list[dict[str, Any]]:
    """The records of every rank's heartbeat file, oldest first."""
    from nsa.telemetry import read_heartbeat
    recs = [r for f in Path(run_dir).glob("heartbeat_rank*.jsonl") for r in read_heartbeat(f)]
    return sorted(recs, key=lambda r: r.get("ts", 0.0))


def describe_stall(rec: dict[str, Any]) -> str:
    secs = rec.get("seconds_since_kick")
    return (f"stalled after step {rec.get('step')} on rank {rec.get('rank')} (no step_end for "
            f"{secs if secs is None else round(float(secs), 1)}s; stacks: {rec.get('stack_dump')})")


def _num(x: Any) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _steady_toks_per_s(summary: dict[str, Any]) -> Optional[float]:
    """Tokens per second of a typical step (p50 step time), not diluted by start-up like the run average."""
    steps = (summary.get("step") or 0) - (summary.get("start_step") or 0)
    ms, tokens = _num(summary.get("step_ms_p50")), _num(summary.get("tokens_seen_this_session"))
    return tokens / steps / (ms / 1e3) if steps > 0 and ms and tokens else _num(summary.get("toks_per_s"))


def lane_record(lane: str, why: str, run_dir: Path, error: Optional[str], wall_s: Optional[float]) -> dict[str, Any]:
    """One lane's verdict from its run directory (metrics.json, heartbeats) and the trial's error."""
    summary = _read_json(run_dir / "metrics.json") or {}
    stalls = stall_records(run_dir)
    problems = [error] if error else []
    if summary and summary.get("status") != "completed":
        problems.append(f"{summary.get('status')}: {summary.get('reason') or 'no reason recorded'}")
    if not summary and not error:
        problems.append("no metrics.json: the lane's training never finished")
    if stalls:
        problems.append(describe_stall(stalls[0]) + (f" (+{len(stalls) - 1} more)" if len(stalls) > 1 else ""))
    mlflow_id = summary.get("mlflow_run_id") or (_read_json(run_dir / "mlflow_run.json") or {}).get("run_id")
    return {
        "lane": lane, "why": why, "status": "FAILED" if problems else "COMPLETED",
        "error": "; ".join(problems), "step": summary.get("step"), "total_steps": summary.get("total_steps"),
        "final_loss": _num(summary.get("final_loss")), "first_loss": _num(summary.get("first_logged_loss")),
        "val_loss": _num(summary.get("final_val_loss")), "toks_per_s": _steady_toks_per_s(summary),
        "toks_per_s_avg": _num(summary.get("toks_per_s")), "step_ms_p50": _num(summary.get("step_ms_p50")),
        "train_wall_s": _num(summary.get("wall_s")),
        "wall_s": wall_s, "stalls": stalls, "run_dir": str(run_dir), "mlflow_run_id": mlflow_id,
    }


# ------------------------------------------------------------------------------------------ the trial
def hang_verdict(recs: list[dict[str, Any]], grace: float, stall_s: float, since: float, now: float) -> Optional[str]:
    """Whether the grid should give up on a lane, from its heartbeats (oldest first). Hung when (1) the
    worker's watchdog wrote a stall record and no step_end/end followed within ``grace`` s, or (2) no
    heartbeat at all came for ``stall_s + grace`` s (at least SILENCE_FLOOR_S; ``since`` = lane start when
    there is none yet): the watchdog is paused during the first data fetch, so a data deadlock at start-up
    writes no stall record. ``grace`` <= 0 disables both."""
    if grace <= 0:
        return None
    last_ts = recs[-1].get("ts", 0.0) if recs else since
    if now - last_ts > max(stall_s + grace, SILENCE_FLOOR_S):
        where = f"{recs[-1].get('kind')} of step {recs[-1].get('step')}" if recs else "the lane started"
        return (f"hung: no heartbeat for {now - last_ts:.0f}s since {where} (> train.stall_seconds + "
                "--hang-grace), lane ended by the grid")
    stall = next((r for r in reversed(recs) if r.get("kind") == "stall"), None)
    if stall is None or now - stall["ts"] <= grace:
        return None
    if any(r.get("kind") in ("step_end", "end") and r.get("ts", 0.0) > stall["ts"] for r in recs):
        return None
    return f"hung: no step_end {grace:g}s after the watchdog's stall record, lane ended by the grid (--hang-grace)"


def _tag_lane_run(run_dir: Path, uri: Optional[str], tags: dict[str, str]) -> bool:
    """Tag the lane's MLflow run once the loop has opened it (mlflow_run.json). True when done."""
    run_id = (_read_json(run_dir / "mlflow_run.json") or {}).get("run_id") if uri else None
    if not run_id:
        return uri is None
    try:
        set_tags(uri, run_id, tags)
        return True
    except Exception as e:  # noqa: BLE001 - tagging never fails a lane; the driver tags again at the end
        print(f"lane tags not set yet: {e}", flush=True)
        return False


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _first_line(e: BaseException) -> str:
    text = next((ln.strip() for ln in ANSI.sub("", str(e)).splitlines() if ln.strip()), "")
    return f"{type(e).__name__}: {text[:400]}"


def _fit_watched(trainer: Any, run_dir: Path, uri: Optional[str], tags: dict[str, str], grace: float,
                 stall_s: float) -> Optional[str]:
    """fit() in a thread while this one tags the MLflow run and watches for a hang (then the lane is
    abandoned: the trial's actor exits and takes the lane's controller and workers with it)."""
    box: dict[str, BaseException] = {}

    def target() -> None:
        try:
            trainer.fit()
        except BaseException as e:  # noqa: BLE001 - reported as the lane's error
            box["error"] = e

    th = threading.Thread(target=target, name="lane-fit", daemon=True)
    t0, tagged = time.time(), False
    th.start()
    while th.is_alive():
        th.join(1.0)
        tagged = tagged or _tag_lane_run(run_dir, uri, tags)
        try:
            hung = hang_verdict(read_heartbeats(run_dir), grace, stall_s, t0, time.time())
        except OSError:
            hung = None
        if hung:
            return hung
    return _first_line(box["error"]) if "error" in box else None


def _lane_trial(config: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
    """Tune trial: build the lane's trainer with the pipeline's builder and fit it. Raises LaneFailed."""
    if plan["pipelines"] not in sys.path:
        sys.path.insert(0, plan["pipelines"])
    import builder
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback
    t0, lane = time.time(), config["lane"]
    spec = plan["lanes"][lane]
    cfg = config_from_dict(spec["cfg"])
    run_dir = Path(cfg.logging.root) / str(cfg.logging.name)
    trial_id = tune.get_context().get_trial_id()
    tags = lane_tags(plan, lane, trial_id)
    try:
        builder.prepare_run(cfg, spec["sources"])
        print(f"lane {lane}: trial {trial_id}, run dir {run_dir}", flush=True)
        trainer = builder.build_trainer(cfg, run_dir, builder.make_datasets(cfg), callbacks=[TuneReportCallback()])
        error = _fit_watched(trainer, run_dir, plan["mlflow_uri"], tags, plan["hang_grace"],
                             cfg.train.stall_seconds)
    except Exception as e:  # noqa: BLE001 - the lane's verdict carries it
        error = _first_line(e)
    _tag_lane_run(run_dir, plan["mlflow_uri"], tags)
    rec = lane_record(lane, spec["why"], run_dir, error, time.time() - t0)
    write_json(run_dir / RESULT_FILE, rec)
    print(f"lane {lane}: {rec['status']} in {rec['wall_s']:.0f}s" + (f" ({rec['error']})" if rec["error"] else ""),
          flush=True)
    if rec["status"] != "COMPLETED":
        raise LaneFailed(f"lane {lane}: {rec['error']}")
    return {k: v for k, v in rec.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


# ------------------------------------------------------------------------------------------ MLflow
def lane_tags(plan: dict[str, Any], lane: str, trial_id: Optional[str] = None) -> dict[str, str]:
    spec = plan["lanes"][lane]
    tags = {"lane": lane, "grid": plan["grid_id"], "lane_why": spec["why"][:500],
            "lane_overrides": json.dumps(spec["overrides"], sort_keys=True)[:500],
            "base_profile": str(plan.get("base"))}
    if trial_id:
        tags["tune_trial_id"] = trial_id
    return tags


def set_tags(uri: str, run_id: str, tags: dict[str, str]) -> None:
    from mlflow import MlflowClient
    client = MlflowClient(uri)
    for k, v in tags.items():
        client.set_tag(run_id, k, v)


def finalize_mlflow(plan: GridPlan, records: list[dict[str, Any]]) -> None:
    """Every lane ends with exactly one tagged MLflow run whose status agrees with the verdict: lanes that
    died before the loop opened a run get a FAILED placeholder with the resolved config as params."""
    if not plan.mlflow_uri:
        return
    from mlflow import MlflowClient
    from nsa.telemetry import MLflowLogger
    payload, client = plan.payload(), MlflowClient(plan.mlflow_uri)
    cfgs = {lc.lane.name: lc.cfg for lc in plan.lanes}
    for rec in records:
        tags = {**lane_tags(payload, rec["lane"]), "lane_status": rec["status"],
                "lane_error": (rec["error"] or "-")[:5000]}
        if rec["mlflow_run_id"] is None:
            sink = MLflowLogger(plan.mlflow_uri, plan.experiment, run_name=rec["lane"], tags=tags)
            sink.log_params(cfgs[rec["lane"]].to_dict())
            sink.close("FAILED")
            rec["mlflow_run_id"] = sink.run_id
            continue
        set_tags(plan.mlflow_uri, rec["mlflow_run_id"], tags)
        status = client.get_run(rec["mlflow_run_id"]).info.status
        if rec["status"] == "FAILED" and status != "FAILED":
            client.set_terminated(rec["mlflow_run_id"], status="FAILED")


# ------------------------------------------------------------------------------------------ run + report
def _trial_name(trial: Any) -> str:
    return f"{trial.config['lane']}_{trial.trial_id}"


def run_tuner(plan: GridPlan) -> Any:
    """The Tune grid over lane names; returns the ResultGrid (fit() does not raise for failed trials)."""
    import ray.cloudpickle
    from ray import tune
    if __name__ != "__main__":    # imported (tests): ship this module by value, workers cannot import it
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    trainable = tune.with_resources(tune.with_parameters(_lane_trial, plan=plan.payload()), {"CPU": TRIAL_CPU})
    tuner = tune.Tuner(
        trainable, param_space={"lane": tune.grid_search([lc.lane.name for lc in plan.lanes])},
        tune_config=tune.TuneConfig(max_concurrent_trials=plan.max_concurrent, reuse_actors=False,
                                    trial_name_creator=_trial_name, trial_dirname_creator=_trial_name),
        run_config=tune.RunConfig(name="tune", storage_path=str(plan.grid_dir), verbose=0,
                                  failure_config=tune.FailureConfig(max_failures=0)))
    return tuner.fit()


def collect(plan: GridPlan, grid: Any) -> list[dict[str, Any]]:
    """Lane records in plan order: the trial's own record, else one rebuilt from the run dir + Tune's error."""
    errors: dict[str, Optional[str]] = {}
    for res in grid:
        lane = (res.config or {}).get("lane")
        errors[lane] = _first_line(res.error) if res.error is not None else None
    out = []
    for lc in plan.lanes:
        name = lc.lane.name
        run_dir = plan.grid_dir / name
        rec = _read_json(run_dir / RESULT_FILE)
        if rec is None:
            err = errors.get(name) if name in errors else "not run: the grid ended before this lane started"
            rec = lane_record(name, lc.lane.why, run_dir, err, None)
        out.append(rec)
    return out


def _f(x: Any, fmt: str = ".4f") -> str:
    return "-" if x is None else format(x, fmt)


def format_table(records: list[dict[str, Any]], markdown: bool = False) -> str:
    head = ["lane", "status", "steps", "final loss", "val loss", "toks/s", "wall s", "error"]
    rows = [[r["lane"], r["status"], f"{r['step'] if r['step'] is not None else '-'}/{r['total_steps'] or '-'}",
             _f(r["final_loss"]), _f(r["val_loss"]), _f(r["toks_per_s"], ".0f"), _f(r["wall_s"], ".0f"),
             (r["error"] or "")[:(2000 if markdown else 90)]] for r in records]
    if markdown:
        esc = lambda s: s.replace("|", "\\|")  # noqa: E731
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows])
    width = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, width)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in width])] + [line(r) for r in rows])


def write_summary(plan: GridPlan, records: list[dict[str, Any]], wall_s: float, code: int) -> tuple[Path, Path]:
    failed = [r["lane"] for r in records if r["status"] != "COMPLETED"]
    ui = f"mlflow ui --backend-store-uri {plan.mlflow_uri}" if plan.mlflow_uri else None
    doc = {"grid": plan.grid_id, "grid_dir": str(plan.grid_dir), "base": plan.base, "experiment": plan.experiment,
           "mlflow_uri": plan.mlflow_uri, "mlflow_ui": ui, "max_concurrent": plan.max_concurrent,
           "wall_s": wall_s, "exit_code": code, "failed": failed,
           "lanes": [{**r, "overrides": lc.lane.overrides, "sources": {k: v for k, v in lc.sources.items()
                                                                       if v != "default"}}
                     for r, lc in zip(records, plan.lanes)]}
    jpath, mpath = plan.grid_dir / "lanes_summary.json", plan.grid_dir / "lanes_summary.md"
    write_json(jpath, doc)
    md = [f"# Lanes grid `{plan.grid_id}`", "", f"Base profile `{plan.base}`; {len(records)} lanes, "
          f"{plan.max_concurrent} at a time; {wall_s:.0f}s; failed: {', '.join(failed) or 'none'}.", "",
          format_table(records, markdown=True), "", "## Lanes", ""]
    md += [f"- **{lc.lane.name}**: {lc.lane.why}. Overrides: `{json.dumps(lc.lane.overrides)}`; run dir "
           f"`{r['run_dir']}`" for r, lc in zip(records, plan.lanes)]
    if ui:
        md += ["", f"Compare in MLflow (experiment `{plan.experiment}`, tag `grid={plan.grid_id}`): `{ui}`"]
    mpath.write_text("\n".join(md) + "\n")
    return jpath, mpath


def run_grid(plan: GridPlan, max_concurrent: Optional[int] = None) -> int:
    """Connect Ray, size the grid, run it, tag MLflow, print and write the summary. Returns the exit code."""
    import builder
    t0 = time.time()
    print(builder.connect_ray(plan.base_cfg), flush=True)
    plan.max_concurrent = size_concurrency(plan, max_concurrent)
    plan.grid_dir.mkdir(parents=True, exist_ok=True)
    if plan.mlflow_uri:    # create the SQLite tables here: two lanes creating a fresh store at once could race
        from mlflow import MlflowClient
        MlflowClient(plan.mlflow_uri).search_experiments(max_results=1)
    print(f"grid {plan.grid_id}: {len(plan.lanes)} lanes ({', '.join(lc.lane.name for lc in plan.lanes)}), "
          f"{plan.max_concurrent} at a time, dir {plan.grid_dir}", flush=True)
    records = collect(plan, run_tuner(plan))
    finalize_mlflow(plan, records)
    failed = [r for r in records if r["status"] != "COMPLETED"]
    code = 1 if failed and not plan.allow_failures else 0
    wall = time.time() - t0
    jpath, mpath = write_summary(plan, records, wall, code)
    print(f"\n== lanes grid {plan.grid_id}: {len(records) - len(failed)}/{len(records)} completed in {wall:.0f}s")
    print(format_table(records))
    for r in failed:
        print(f"FAILED {r['lane']}: {r['error']}  (run dir {r['run_dir']})")
    print(f"summary: {jpath}\n         {mpath}")
    if plan.mlflow_uri:
        print(f"mlflow:  mlflow ui --backend-store-uri {plan.mlflow_uri}   (experiment {plan.experiment}, "
              f"tag grid={plan.grid_id})", flush=True)
    return code


# ------------------------------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ab_grid.py", description=__doc__.split("\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Lanes and their overrides: lanes/lanes.yaml (see --list).")
    p.add_argument("--base", default=DEFAULT_BASE, help=f"base profile (default {DEFAULT_BASE})")
    p.add_argument("--lanes", default=DEFAULT_LANES, help="lanes file (default lanes/lanes.yaml)")
    p.add_argument("--only", help="comma-separated lane names (default: every lane with default: true)")
    p.add_argument("--max-concurrent", type=int, help="lanes at once (default: as many as the CPUs fit)")
    p.add_argument("--steps", type=int, help="train.steps for every lane (lanes' max_steps still cap it)")
    p.add_argument("--stall-seconds", type=float, help="train.stall_seconds (worker watchdog) for every lane")
    p.add_argument("--hang-grace", type=float, help="seconds a lane may still recover after a stall record "
                   "before the grid ends it (default: the stall timeout; 0: never end it)")
    p.add_argument("--name", help="grid id and directory name under logging.root (default lanes-<time>-<hex>)")
    p.add_argument("--allow-failures", action="store_true", help="exit 0 even if a lane failed")
    p.add_argument("--list", action="store_true", help="print the lanes and exit")
    p.add_argument("--print-config", action="store_true", help="print every lane's non-default config and exit")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="overrides for every lane (highest)")
    return p


def _print_lanes(path: str) -> None:
    for ln in load_lanes(path)[1].values():
        extra = ("" if ln.default else " [not default]") + (f" [max_steps {ln.max_steps}]" if ln.max_steps else "")
        print(f"{ln.name:<14} {ln.why}{extra}\n{'':<14} {json.dumps(ln.overrides)}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    from _cli import EXIT_USAGE, UserError
    args = build_parser().parse_args(argv)
    try:
        if args.list:
            _print_lanes(args.lanes)
            return 0
        if args.steps is not None and args.steps < 1:
            raise LaneError(f"--steps={args.steps} must be >= 1")
        plan = plan_grid(args)
        if args.print_config:
            for lc in plan.lanes:
                print(f"== lane {lc.lane.name}: {lc.lane.why}")
                print("\n".join(f"  {k} = {v!r}  [{lc.sources[k]}]" for k, v in lc.cfg.flat().items()
                                if lc.sources[k] != "default"))
            return 0
        return run_grid(plan, args.max_concurrent)
    except (LaneError, UserError, ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
