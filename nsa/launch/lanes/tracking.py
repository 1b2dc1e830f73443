"""MLflow: tags that identify a lane's run (lane, grid, why, overrides, base profile), set while it trains,
and the final pass that leaves every lane with exactly one run whose status agrees with its verdict."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from nsa.launch.lanes.plan import GridPlan
from nsa.launch.lanes.records import read_json


def lane_tags(plan: dict[str, Any], lane: str, trial_id: Optional[str] = None) -> dict[str, str]:
    """``plan`` is ``GridPlan.payload()`` (what a trial has)."""
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


def tag_lane_run(run_dir: Path, uri: Optional[str], tags: dict[str, str]) -> bool:
    """Tag the lane's MLflow run once the loop has opened it (mlflow_run.json). True when done."""
    run_id = (read_json(run_dir / "mlflow_run.json") or {}).get("run_id") if uri else None
    if not run_id:
        return uri is None
    try:
        set_tags(uri, run_id, tags)
        return True
    except Exception as e:  # noqa: BLE001 - tagging never fails a lane; the driver tags again at the end
        print(f"lane tags not set yet: {e}", flush=True)
        return False


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
            lane = next(lc.lane for lc in plan.lanes if lc.lane.name == rec["lane"])
            client.log_param(sink.run_id, "lane.repeat", str(lane.repeat))
            client.log_param(sink.run_id, "lane.checks", ",".join(lane.checks) or "-")
            sink.close("FAILED")
            rec["mlflow_run_id"] = sink.run_id
            continue
        set_tags(plan.mlflow_uri, rec["mlflow_run_id"], tags)
        lane = next(lc.lane for lc in plan.lanes if lc.lane.name == rec["lane"])
        for key, val in (("lane.repeat", lane.repeat), ("lane.checks", ",".join(lane.checks) or "-")):
            client.log_param(rec["mlflow_run_id"], key, str(val))   # what the lane does beyond its config
        status = client.get_run(rec["mlflow_run_id"]).info.status
        if rec["status"] == "FAILED" and status != "FAILED":
            client.set_terminated(rec["mlflow_run_id"], status="FAILED")


def add_histories(plan: GridPlan, records: list[dict[str, Any]]) -> None:
    """Each lane's loss curve and peak memory from its MLflow run (every lane has one, CSV or not)."""
    if not plan.mlflow_uri:
        return
    from mlflow import MlflowClient
    client = MlflowClient(plan.mlflow_uri)
    for rec in records:
        rec.setdefault("loss_curve", [])
        rec.setdefault("peak_mem_mib", None)
        if not rec.get("mlflow_run_id"):
            continue
        try:
            loss = client.get_metric_history(rec["mlflow_run_id"], "loss")
            mem = client.get_metric_history(rec["mlflow_run_id"], "mem_mib")
        except Exception as e:  # noqa: BLE001 - a missing history leaves the lane out of the plot only
            print(f"lane {rec['lane']}: no MLflow history ({type(e).__name__}: {e})", flush=True)
            continue
        rec["loss_curve"] = sorted([m.step, m.value] for m in loss)
        rec["peak_mem_mib"] = max((m.value for m in mem), default=None)


SUMMARY_TAG = "grid_summary"


def log_summary_run(plan: GridPlan, records: list[dict[str, Any]], files: list[Path]) -> Optional[str]:
    """The grid's parent MLflow run (``lanes <grid id>``, tag grid_summary=<grid id>): every lane's run
    becomes its child (mlflow.parentRunId), and it holds the summary files, the figures and per-lane metrics."""
    if not plan.mlflow_uri:
        return None
    from mlflow import MlflowClient
    client = MlflowClient(plan.mlflow_uri)
    exp = client.get_experiment_by_name(plan.experiment)
    exp_id = exp.experiment_id if exp is not None else client.create_experiment(plan.experiment)
    run = client.create_run(exp_id, run_name=f"lanes {plan.grid_id}",
                            tags={SUMMARY_TAG: plan.grid_id, "base_profile": str(plan.base)})
    rid = run.info.run_id
    client.log_param(rid, "lanes", ",".join(r["lane"] for r in records)[:500])
    client.log_param(rid, "skipped", ",".join(ln.name for ln, _ in plan.skipped)[:500] or "-")
    for rec in records:
        if rec.get("mlflow_run_id"):
            client.set_tag(rec["mlflow_run_id"], "mlflow.parentRunId", rid)
        for key in ("final_loss", "val_loss", "toks_per_s", "peak_mem_mib", "toks_vs_base", "d_loss"):
            if isinstance(rec.get(key), (int, float)):
                client.log_metric(rid, f"{rec['lane']}.{key}", float(rec[key]))
        client.log_metric(rid, f"{rec['lane']}.completed", float(rec["status"] == "COMPLETED"))
    for f in files:
        client.log_artifact(rid, str(f))
    failed = any(r["status"] != "COMPLETED" for r in records)
    client.set_terminated(rid, status="FAILED" if failed and not plan.allow_failures else "FINISHED")
    return rid
