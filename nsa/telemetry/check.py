"""Health checks of a run directory (the old ``run_smoke_tests.py`` + ``health_check.sh``).

    python -m nsa.telemetry.check <run_dir> [--min-toks-per-s X] [--max-fetch-p95-ms Y]
        [--max-heartbeat-age-s Z] [--max-collapse F] [--min-entropy E] [--max-gate G]
        [--max-mem-growth M] [--min-steps N] [--json]

Reads ``training.csv`` (step, loss, lr, toks_per_s, step_ms, fetch_ms_p50, fetch_ms_p95, grad_norm,
mem_mib, gate/L<i>/<stat>...) — or, when CSV logging was off, the ``loss``/``toks_per_s`` fields of
rank 0's ``step_end`` heartbeats — and every ``heartbeat_rank*.jsonl``. Prints PASS/FAIL/WARN/SKIP per
check; exit 0 if nothing failed (WARN does not fail), 1 on any FAIL, 2 when the input is unusable.
Gate health (entropy, max gate, collapse), kernel fallbacks and memory growth are WARN at worst: a
healthy model may favour one branch in some layers. Without training.csv, gate stats come from the
``stats`` of ``progress`` heartbeats and memory from ``step_end`` heartbeats.

"Recent" values (throughput, fetch time) are the median over the last 10% of rows (at least one),
so one slow warm-up step or one hiccup does not decide the verdict.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from .health import DEFAULT_THRESHOLDS
from .heartbeat import KIND_ANOMALY, KIND_END, KIND_PROGRESS, KIND_STALL, read_heartbeat

PASS, FAIL, WARN, SKIP = "PASS", "FAIL", "WARN", "SKIP"
DEFAULTS = {  # thresholds from the runbooks: stale > 3 min; gate health (warnings) as nsa/telemetry/health.py
    "min_toks_per_s": None,
    "max_fetch_p95_ms": 2000.0,
    "max_heartbeat_age_s": 180.0,
    "max_collapse": DEFAULT_THRESHOLDS["max_collapse"],
    "min_entropy": DEFAULT_THRESHOLDS["min_entropy"],
    "max_gate": DEFAULT_THRESHOLDS["max_gate"],
    "max_mem_growth": 0.25,   # recent memory vs early memory (fraction); warning only
    "min_steps": None,
}


@dataclass
class CheckResult:
    name: str
    status: str  # PASS | FAIL | SKIP
    detail: str
    value: float | None = None


class UnusableRunDir(ValueError):
    """The run directory is missing or holds nothing to check (exit code 2)."""


@dataclass
class _RunData:
    rows: list[dict[str, float | None]]
    columns: list[str]
    rows_source: str | None
    heartbeats: dict[str, list[dict[str, Any]]]


def _to_float(text: Any) -> float | None:
    if text is None or text == "":
        return None
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def _read_csv(path: Path) -> tuple[list[dict[str, float | None]], list[str]]:
    with open(path, newline="", encoding="utf-8", errors="replace") as fh:
        reader = csv.DictReader(fh)
        rows = [{k: _to_float(v) for k, v in r.items() if k is not None} for r in reader]
        return [r for r in rows if r.get("step") is not None], list(reader.fieldnames or [])


def load_run(run_dir: str | os.PathLike) -> _RunData:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UnusableRunDir(f"run directory {str(run_dir)!r} does not exist or is not a directory")
    heartbeats = {p.name: read_heartbeat(p) for p in sorted(run_dir.glob("heartbeat_rank*.jsonl"))}
    csv_path = run_dir / "training.csv"
    rows, columns, source = [], [], None
    if csv_path.is_file():
        rows, columns = _read_csv(csv_path)
        source = "training.csv"
    elif "heartbeat_rank0.jsonl" in heartbeats:
        rows = [{k: _to_float(v) if not isinstance(v, float) else v for k, v in r.items()
                 if k in ("step", "loss", "toks_per_s", "fetch_ms_p95")}
                for r in heartbeats["heartbeat_rank0.jsonl"] if r.get("kind") == "step_end" and "loss" in r]
        columns = sorted({k for r in rows for k in r})
        source = "heartbeat_rank0.jsonl (step_end records)" if rows else None
    if not heartbeats and source is None:
        raise UnusableRunDir(f"{run_dir} has neither training.csv nor heartbeat_rank*.jsonl: "
                             "is this a run directory?")
    return _RunData(rows, columns, source, heartbeats)


def _column(rows: Sequence[dict[str, float | None]], col: str) -> list[tuple[float, float]]:
    """(step, value) pairs where the value is present (NaN included)."""
    return [(r["step"], r[col]) for r in rows if r.get(col) is not None]  # type: ignore[misc]


def _recent_median(values: Sequence[float]) -> float:
    k = max(1, len(values) // 10)
    return statistics.median(values[-k:])


def _check_loss_finite(data: _RunData) -> CheckResult:
    losses = _column(data.rows, "loss")
    for rec in data.heartbeats.values() if data.rows_source == "training.csv" else ():
        # only completed steps carry a measured loss; progress/start records may hold a NaN placeholder
        losses += [(r.get("step", -1), r["loss"]) for r in rec
                   if r.get("kind") == "step_end" and isinstance(r.get("loss"), float)]
    if not losses:
        return CheckResult("loss_finite", SKIP, "no loss values")
    bad = [(s, v) for s, v in losses if not math.isfinite(v)]
    if bad:
        return CheckResult("loss_finite", FAIL, f"{len(bad)} non-finite loss value(s), first at step "
                           f"{int(bad[0][0])} ({bad[0][1]})", float(len(bad)))
    return CheckResult("loss_finite", PASS, f"{len(losses)} finite loss values", 0.0)


def _check_loss_improving(data: _RunData) -> CheckResult:
    values = [v for _, v in _column(data.rows, "loss") if math.isfinite(v)]
    if len(values) < 2:
        return CheckResult("loss_improving", SKIP, f"need >= 2 finite loss rows, have {len(values)}")
    k = max(1, len(values) // 10)
    first, last = statistics.fmean(values[:k]), statistics.fmean(values[-k:])
    status = PASS if last < first else FAIL
    return CheckResult("loss_improving", status, f"mean of last {k}: {last:.4g} vs first {k}: {first:.4g}",
                       last - first)


def _check_min_steps(data: _RunData, min_steps: int | None) -> CheckResult:
    steps = [r["step"] for r in data.rows if r.get("step") is not None]
    for rec in data.heartbeats.values():
        steps += [float(r["step"]) for r in rec if isinstance(r.get("step"), (int, float))]
    last = max(steps) if steps else None
    if min_steps is None:
        return CheckResult("min_steps", SKIP, f"no --min-steps (last step {last})", last)
    if last is None:
        return CheckResult("min_steps", FAIL, "no steps recorded", None)
    return CheckResult("min_steps", PASS if last >= min_steps else FAIL, f"last step {int(last)} "
                       f"(need >= {min_steps})", last)


def _check_recent(data: _RunData, name: str, col: str, limit: float | None, floor: bool,
                  unit: str) -> CheckResult:
    if limit is None:
        return CheckResult(name, SKIP, "no threshold given")
    values = [v for _, v in _column(data.rows, col) if math.isfinite(v)]
    if not values:
        return CheckResult(name, SKIP, f"no {col} values")
    recent = _recent_median(values)
    ok = recent >= limit if floor else recent <= limit
    rel = ">=" if floor else "<="
    return CheckResult(name, PASS if ok else FAIL, f"recent median {col} {recent:.4g} {unit} "
                       f"(need {rel} {limit:g})", recent)


def _latest_gate_values(data: _RunData, stat: str) -> dict[str, float]:
    """Last finite value of every ``gate/<layer>/<stat>`` column, else of rank 0's progress heartbeats."""
    out = {}
    for col in data.columns:
        if col.startswith("gate/") and col.endswith("/" + stat):
            vals = [v for _, v in _column(data.rows, col) if math.isfinite(v)]
            if vals:
                out[col] = vals[-1]
    if not out:
        for r in data.heartbeats.get("heartbeat_rank0.jsonl", []):
            if r.get("kind") == KIND_PROGRESS and isinstance(r.get("stats"), dict):
                out.update({k: v for k, v in r["stats"].items() if k.startswith("gate/") and k.endswith("/" + stat)
                            and isinstance(v, (int, float)) and math.isfinite(v)})
    return out


def _check_gates(data: _RunData, min_entropy: float | None, max_collapse: float | None,
                 max_gate: float | None = None) -> list[CheckResult]:
    results = []
    for name, stat, limit, floor in (("gate_entropy", "entropy", min_entropy, True),
                                     ("gate_max", "max_gate", max_gate, False),
                                     ("gate_collapse", "collapse_frac", max_collapse, False)):
        vals = _latest_gate_values(data, stat)
        if limit is None or not vals:
            results.append(CheckResult(name, SKIP, "no threshold" if limit is None else f"no gate/*/{stat} columns"))
            continue
        col, worst = (min if floor else max)(vals.items(), key=lambda kv: kv[1])
        bad = sorted(k.split("/")[1] for k, v in vals.items() if (v < limit if floor else v > limit))
        results.append(CheckResult(name, WARN if bad else PASS, f"worst latest {col} = {worst:.4g} (want "
                                   f"{'>=' if floor else '<='} {limit:g}; {len(bad)} of {len(vals)} layer(s) "
                                   f"outside{': ' + ', '.join(bad) if bad else ''})", worst))
    return results


def _check_fallbacks(data: _RunData) -> CheckResult:
    """Kernel fallback counters (``fallbacks`` of step_end heartbeats, cumulative per process)."""
    totals: dict[str, int] = {}
    for name, recs in data.heartbeats.items():
        last = next((r["fallbacks"] for r in reversed(recs) if isinstance(r.get("fallbacks"), dict)), None)
        for k, v in (last or {}).items():
            if isinstance(v, (int, float)) and v > 0:
                totals[k] = totals.get(k, 0) + int(v)
    seen = any(isinstance(r.get("fallbacks"), dict) for recs in data.heartbeats.values() for r in recs)
    if not seen:
        return CheckResult("kernel_fallbacks", SKIP, "no fallback counters in the heartbeats")
    if totals:
        return CheckResult("kernel_fallbacks", WARN, "kernels fell back: " + ", ".join(
            f"{k}={v}" for k, v in sorted(totals.items())), float(sum(totals.values())))
    return CheckResult("kernel_fallbacks", PASS, "no kernel fell back", 0.0)


def _check_memory_growth(data: _RunData, max_growth: float | None) -> CheckResult:
    """Recent vs early memory (median of the last / first 10% after the first row, which is warm-up)."""
    if max_growth is None:
        return CheckResult("memory_growth", SKIP, "no threshold given")
    vals = [v for _, v in _column(data.rows, "mem_mib") if math.isfinite(v)]
    source = "mem_mib"
    if len(vals) < 3:
        vals = [float(r["mem_mib"]) for r in data.heartbeats.get("heartbeat_rank0.jsonl", [])
                if r.get("kind") == "step_end" and isinstance(r.get("mem_mib"), (int, float))]
        source = "step_end mem_mib"
    vals = vals[1:]
    if len(vals) < 2:
        return CheckResult("memory_growth", SKIP, "need >= 3 memory samples")
    k = max(1, len(vals) // 10)
    early, late = statistics.median(vals[:k]), statistics.median(vals[-k:])
    growth = (late - early) / max(early, 1e-9)
    return CheckResult("memory_growth", WARN if growth > max_growth else PASS,
                       f"{source} {early:.0f} -> {late:.0f} MiB ({growth:+.1%}; want <= {max_growth:+.0%})", growth)


def _check_heartbeat_fresh(data: _RunData, max_age_s: float | None, now: float) -> CheckResult:
    if not data.heartbeats:
        return CheckResult("heartbeat_fresh", SKIP, "no heartbeat_rank*.jsonl files")
    if max_age_s is None:
        return CheckResult("heartbeat_fresh", SKIP, "no threshold given")
    stale, notes, worst = [], [], 0.0
    for name, records in data.heartbeats.items():
        if not records:
            stale.append(f"{name}: empty")
            continue
        last = records[-1]
        age = now - float(last.get("ts", 0.0))
        if last.get("kind") == KIND_END:
            notes.append(f"{name}: ended at step {last.get('step')}")
            continue
        worst = max(worst, age)
        entry = f"{name}: last {last.get('kind')} step {last.get('step')} {age:.0f}s ago"
        (stale if age > max_age_s else notes).append(entry)
    status = FAIL if stale else PASS
    return CheckResult("heartbeat_fresh", status, "; ".join(stale + notes) + f" (max age {max_age_s:g}s)", worst)


def _check_no_bad_records(data: _RunData) -> CheckResult:
    if not data.heartbeats:
        return CheckResult("no_stall_or_anomaly", SKIP, "no heartbeat_rank*.jsonl files")
    bad = [(name, r) for name, recs in data.heartbeats.items() for r in recs
           if r.get("kind") in (KIND_STALL, KIND_ANOMALY)]
    if not bad:
        n = sum(len(r) for r in data.heartbeats.values())
        return CheckResult("no_stall_or_anomaly", PASS, f"{n} records in {len(data.heartbeats)} file(s)", 0.0)
    name, first = bad[0]
    return CheckResult("no_stall_or_anomaly", FAIL, f"{len(bad)} stall/anomaly record(s); first: {first.get('kind')} "
                       f"at step {first.get('step')} in {name}", float(len(bad)))


def run_checks(run_dir: str | os.PathLike, *, min_toks_per_s: float | None = DEFAULTS["min_toks_per_s"],
               max_fetch_p95_ms: float | None = DEFAULTS["max_fetch_p95_ms"],
               max_heartbeat_age_s: float | None = DEFAULTS["max_heartbeat_age_s"],
               max_collapse: float | None = DEFAULTS["max_collapse"],
               min_entropy: float | None = DEFAULTS["min_entropy"],
               max_gate: float | None = DEFAULTS["max_gate"],
               max_mem_growth: float | None = DEFAULTS["max_mem_growth"],
               min_steps: int | None = DEFAULTS["min_steps"], now: float | None = None) -> list[CheckResult]:
    """All checks of one run directory; raises :class:`UnusableRunDir` for unusable input."""
    data = load_run(run_dir)
    now = time.time() if now is None else now
    results = [_check_loss_finite(data), _check_loss_improving(data), _check_min_steps(data, min_steps),
               _check_recent(data, "throughput", "toks_per_s", min_toks_per_s, True, "tok/s"),
               _check_recent(data, "fetch_p95", "fetch_ms_p95", max_fetch_p95_ms, False, "ms")]
    results += _check_gates(data, min_entropy, max_collapse, max_gate)
    results += [_check_fallbacks(data), _check_memory_growth(data, max_mem_growth)]
    results += [_check_heartbeat_fresh(data, max_heartbeat_age_s, now), _check_no_bad_records(data)]
    if data.rows_source is None:
        for r in results:
            if r.status == SKIP and r.name in ("loss_finite", "loss_improving"):
                r.detail += " (no training.csv)"
    return results


def format_table(results: Sequence[CheckResult]) -> str:
    width = max(len(r.name) for r in results)
    lines = [f"{'CHECK'.ljust(width)}  STATUS  DETAIL"]
    lines += [f"{r.name.ljust(width)}  {r.status.ljust(6)}  {r.detail}" for r in results]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nsa.telemetry.check", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="directory with training.csv and heartbeat_rank*.jsonl")
    p.add_argument("--min-toks-per-s", type=float, default=DEFAULTS["min_toks_per_s"])
    p.add_argument("--max-fetch-p95-ms", type=float, default=DEFAULTS["max_fetch_p95_ms"])
    p.add_argument("--max-heartbeat-age-s", type=float, default=DEFAULTS["max_heartbeat_age_s"])
    p.add_argument("--max-collapse", type=float, default=DEFAULTS["max_collapse"])
    p.add_argument("--min-entropy", type=float, default=DEFAULTS["min_entropy"])
    p.add_argument("--max-gate", type=float, default=DEFAULTS["max_gate"])
    p.add_argument("--max-mem-growth", type=float, default=DEFAULTS["max_mem_growth"])
    p.add_argument("--min-steps", type=int, default=DEFAULTS["min_steps"])
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    thresholds = {k: v for k, v in vars(args).items() if k not in ("run_dir", "json")}
    try:
        results = run_checks(args.run_dir, **thresholds)
    except UnusableRunDir as exc:
        if args.json:
            print(json.dumps({"run_dir": args.run_dir, "status": "UNUSABLE", "error": str(exc)}))
        else:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    failed = any(r.status == FAIL for r in results)
    if args.json:
        print(json.dumps({"run_dir": args.run_dir, "status": FAIL if failed else PASS,
                          "checks": [asdict(r) for r in results]}, indent=2))
    else:
        print(f"run_dir: {args.run_dir}")
        print(format_table(results))
        warned = any(r.status == WARN for r in results)
        print(f"overall: {FAIL if failed else PASS}" + (" (with warnings)" if warned and not failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
