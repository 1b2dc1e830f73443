"""The Ray Tune side: one trial per lane (``grid_search`` over lane names), each fitting the lane's trainer
from nsa.launch.builder, and the lane records collected from the ResultGrid afterwards.

Trials run in Ray workers, which import this module by name: the local instance ships the ``nsa`` package
(``runtime_env py_modules``), a cluster job has it from ``--working-dir`` or the installed checkout."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

from nsa.config import config_from_dict
from nsa.launch import builder
from nsa.launch.lanes.plan import GridPlan
from nsa.launch.lanes.checks import repeat_check, run_prefill_check
from nsa.launch.lanes.records import RESULT_FILE, add_checks, first_line, lane_record, read_json
from nsa.launch.lanes.resources import TRIAL_CPU
from nsa.launch.lanes.tracking import lane_tags, tag_lane_run
from nsa.launch.lanes.watchdog import fit_watched
from nsa.train.reporting import write_json


class LaneFailed(RuntimeError):
    """Raised by a trial whose lane did not complete cleanly, so the ResultGrid records the error."""


def lane_trial(config: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
    """Tune trial: build the lane's trainer with the pipeline's builder and fit it. Raises LaneFailed."""
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback
    t0, lane = time.time(), config["lane"]
    spec = plan["lanes"][lane]
    cfg = config_from_dict(spec["cfg"])
    run_dir = Path(cfg.logging.root) / str(cfg.logging.name)
    trial_id = tune.get_context().get_trial_id()
    tags = lane_tags(plan, lane, trial_id)
    checks: dict[str, dict[str, Any]] = {}
    try:
        builder.prepare_run(cfg, spec["sources"])
        print(f"lane {lane}: trial {trial_id}, run dir {run_dir}", flush=True)
        trainer = builder.build_trainer(cfg, run_dir, builder.make_datasets(cfg), callbacks=[TuneReportCallback()])
        error = fit_watched(trainer, run_dir, plan["mlflow_uri"], tags, plan["hang_grace"], cfg.train.stall_seconds)
        if error is None and spec.get("repeat", 1) > 1:
            checks["repeat"] = _repeat(cfg, spec, run_dir, plan)
        if error is None and "prefill" in spec.get("checks", ()):
            checks["prefill"] = run_prefill_check(run_dir, spec["cfg"])
    except Exception as e:  # noqa: BLE001 - the lane's verdict carries it
        error = first_line(e)
    tag_lane_run(run_dir, plan["mlflow_uri"], tags)
    rec = add_checks(lane_record(lane, spec["why"], run_dir, error, time.time() - t0), checks)
    write_json(run_dir / RESULT_FILE, rec)
    print(f"lane {lane}: {rec['status']} in {rec['wall_s']:.0f}s" + (f" ({rec['error']})" if rec["error"] else ""),
          flush=True)
    if rec["status"] != "COMPLETED":
        raise LaneFailed(f"lane {lane}: {rec['error']}")
    return {k: v for k, v in rec.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _repeat(cfg: Any, spec: dict[str, Any], run_dir: Path, plan: dict[str, Any]) -> dict[str, Any]:
    """Train the lane's config a second time (run dir ``<lane>.repeat``, no MLflow run of its own: the lane
    keeps one) and compare the two runs' losses step by step."""
    name = f"{cfg.logging.name}.repeat"
    again = builder.replace_cfg(cfg, logging={"name": name, "mlflow": False})
    rep_dir = Path(again.logging.root) / name
    print(f"lane {cfg.logging.name}: repeat run in {rep_dir}", flush=True)
    builder.prepare_run(again, spec["sources"])
    trainer = builder.build_trainer(again, rep_dir, builder.make_datasets(again))
    error = fit_watched(trainer, rep_dir, None, {}, plan["hang_grace"], again.train.stall_seconds)
    if error is None:
        error = lane_record(name, "", rep_dir, None, None)["error"] or None
    if error:
        return {"check": "repeat", "ok": False, "error": f"repeat run failed: {error}", "run_b": str(rep_dir)}
    return repeat_check(run_dir, rep_dir)


def _trial_name(trial: Any) -> str:
    return f"{trial.config['lane']}_{trial.trial_id}"


def _progress(n: int) -> Any:
    """A Tune callback printing "lane k of n" as lanes start and finish (lanes run concurrently)."""
    from ray import tune

    class Progress(tune.Callback):
        started = finished = 0

        def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            self.started += 1
            print(f"lane {self.started} of {n}: {trial.config['lane']} started", flush=True)

        def _end(self, trial: Any, how: str) -> None:
            self.finished += 1
            print(f"lane {trial.config['lane']} {how} ({self.finished} of {n} done)", flush=True)

        def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            self._end(trial, "completed")

        def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            self._end(trial, "failed")
    return Progress()


def run_tuner(plan: GridPlan) -> Any:
    """The Tune grid over lane names; returns the ResultGrid (fit() does not raise for failed trials)."""
    from ray import tune
    trainable = tune.with_resources(tune.with_parameters(lane_trial, plan=plan.payload()), {"CPU": TRIAL_CPU})
    tuner = tune.Tuner(
        trainable, param_space={"lane": tune.grid_search([lc.lane.name for lc in plan.lanes])},
        tune_config=tune.TuneConfig(max_concurrent_trials=plan.max_concurrent, reuse_actors=False,
                                    trial_name_creator=_trial_name, trial_dirname_creator=_trial_name),
        run_config=tune.RunConfig(name="tune", storage_path=str(plan.grid_dir), verbose=0,
                                  callbacks=[_progress(len(plan.lanes))],
                                  failure_config=tune.FailureConfig(max_failures=0)))
    return tuner.fit()


def collect(plan: GridPlan, grid: Any) -> list[dict[str, Any]]:
    """Lane records in plan order: the trial's own record, else one rebuilt from the run dir + Tune's error."""
    errors: dict[str, Optional[str]] = {}
    for res in grid:
        lane = (res.config or {}).get("lane")
        errors[lane] = first_line(res.error) if res.error is not None else None
    out = []
    for lc in plan.lanes:
        name = lc.lane.name
        run_dir = plan.grid_dir / name
        rec = read_json(run_dir / RESULT_FILE)
        if rec is None:
            err = errors.get(name) if name in errors else "not run: the grid ended before this lane started"
            rec = lane_record(name, lc.lane.why, run_dir, err, None)
        out.append(rec)
    return out
