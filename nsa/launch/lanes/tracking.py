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
            sink.close("FAILED")
            rec["mlflow_run_id"] = sink.run_id
            continue
        set_tags(plan.mlflow_uri, rec["mlflow_run_id"], tags)
        status = client.get_run(rec["mlflow_run_id"]).info.status
        if rec["status"] == "FAILED" and status != "FAILED":
            client.set_terminated(rec["mlflow_run_id"], status="FAILED")
