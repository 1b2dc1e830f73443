"""A lane's verdict, read from its run directory (metrics.json, every rank's heartbeats) and the trial's error."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Optional

RESULT_FILE = "lane_result.json"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def read_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def first_line(e: BaseException) -> str:
    """An exception as one line for the lane's record: type and first non-empty line, colours stripped."""
    text = next((ln.strip() for ln in ANSI.sub("", str(e)).splitlines() if ln.strip()), "")
    return f"{type(e).__name__}: {text[:400]}"


def read_heartbeats(run_dir: Path) -> list[dict[str, Any]]:
    """The records of every rank's heartbeat file, oldest first."""
    from nsa.telemetry import read_heartbeat
    recs = [r for f in Path(run_dir).glob("heartbeat_rank*.jsonl") for r in read_heartbeat(f)]
    return sorted(recs, key=lambda r: r.get("ts", 0.0))


def stall_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every ``stall`` heartbeat the lane's watchdogs wrote (all ranks)."""
    return [r for r in read_heartbeats(run_dir) if r.get("kind") == "stall"]


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
    summary = read_json(run_dir / "metrics.json") or {}
    stalls = stall_records(run_dir)
    problems = [error] if error else []
    if summary and summary.get("status") != "completed":
        problems.append(f"{summary.get('status')}: {summary.get('reason') or 'no reason recorded'}")
    if not summary and not error:
        problems.append("no metrics.json: the lane's training never finished")
    if stalls:
        problems.append(describe_stall(stalls[0]) + (f" (+{len(stalls) - 1} more)" if len(stalls) > 1 else ""))
    mlflow_id = summary.get("mlflow_run_id") or (read_json(run_dir / "mlflow_run.json") or {}).get("run_id")
    return {
        "lane": lane, "why": why, "status": "FAILED" if problems else "COMPLETED",
        "error": "; ".join(problems), "step": summary.get("step"), "total_steps": summary.get("total_steps"),
        "final_loss": _num(summary.get("final_loss")), "first_loss": _num(summary.get("first_logged_loss")),
        "val_loss": _num(summary.get("final_val_loss")), "toks_per_s": _steady_toks_per_s(summary),
        "toks_per_s_avg": _num(summary.get("toks_per_s")), "step_ms_p50": _num(summary.get("step_ms_p50")),
        "train_wall_s": _num(summary.get("wall_s")),
        "fallbacks": sum(int(v) for v in (summary.get("fallbacks") or {}).values()),
        "fallback_counts": summary.get("fallbacks") or {}, "nonfinite_steps": _num(summary.get("nonfinite_steps")),
        "wall_s": wall_s, "checks": {}, "stalls": stalls, "run_dir": str(run_dir), "mlflow_run_id": mlflow_id,
    }


def add_checks(rec: dict[str, Any], checks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Attach the lane's check results (checks.py); a failed check fails the lane with its one-line error."""
    rec["checks"] = checks
    bad = [c["error"] for c in checks.values() if not c.get("ok")]
    if bad:
        rec["status"] = "FAILED"
        rec["error"] = "; ".join(([rec["error"]] if rec["error"] else []) + bad)
    return rec
