#!/usr/bin/env python
"""Smoke test of the training stack: Phase 0 (sanity) then Phase 1 (stability), GO/NO-GO report.

    python pipelines/smoke.py                                # tiny CPU profile, Phase 1 = 200 steps
    python pipelines/smoke.py --config pipelines/configs/prod_50k.yaml --phase1-steps 200
    python pipelines/smoke.py --phase1-steps 20 runtime.fault=stall@3 train.stall_seconds=5   # must say NO-GO

Phase 0 runs 2 optimizer steps so the step boundary is observable: step 1 must show a finite loss and
both a `progress` and a `step_end` heartbeat, and step 2 a `step_start` (missing step_end = stall inside
the end of step 1; step_end without the next step_start = stall at the iteration rollover).
Phase 1 runs --phase1-steps steps: no stall records, finite loss beyond step 5, steady step time
(p95/p50 of step_end times after warm-up, checkpoint/eval steps excluded), flat memory (growth of
CUDA-allocated MiB, or RSS on CPU, over the second half, from a least-squares fit).
Both phases log every step and write heartbeats every step. Each phase is its own run under
<logging.root>/<smoke name>/phase{0,1}/; the report goes to smoke_report.{md,json} there.
Exit code: 0 GO, 1 NO-GO, 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from nsa.launch.builder import launch, replace_cfg
from nsa.launch.cli import UserError, build_parser, load_config, main_entry, print_header
from nsa.launch.storage import run_root
from nsa.telemetry import read_heartbeat

DEFAULT_PROFILE = "pipelines/configs/tiny_cpu.yaml"


def _parser() -> argparse.ArgumentParser:
    p = build_parser("smoke.py", __doc__.split("\n")[0], DEFAULT_PROFILE)
    p.add_argument("--phase1-steps", type=int, default=200, help="steps of Phase 1 (default 200)")
    p.add_argument("--max-step-ratio", type=float, default=3.0,
                   help="Phase 1: max p95/p50 of step time after warm-up (default 3.0; shared CPUs are noisy)")
    p.add_argument("--max-mem-growth", type=float, default=64.0,
                   help="Phase 1: max memory growth (MiB, least-squares fit) over the second half (default 64)")
    p.add_argument("--skip-phase1", action="store_true", help="run Phase 0 only")
    return p


def _records(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    out = {}
    for f in sorted(run_dir.glob("heartbeat_rank*.jsonl")):
        out[int(f.stem.split("rank")[-1])] = read_heartbeat(f)
    return out


def _check(name: str, ok: bool, detail: str) -> dict[str, Any]:
    return {"check": name, "ok": bool(ok), "detail": detail}


def _has(recs: list[dict[str, Any]], kind: str, step: int) -> bool:
    return any(r["kind"] == kind and r["step"] == step for r in recs)


def _stalls(hb: dict[int, list[dict[str, Any]]]) -> list[str]:
    return [f"rank {r} step {x['step']} ({x.get('seconds_since_kick', '?')} s)" for r, recs in hb.items()
            for x in recs if x["kind"] == "stall"]


def phase0_checks(outcome: Any) -> list[dict[str, Any]]:
    hb = _records(outcome.run_dir)
    s = outcome.summary
    checks = [_check("run completed", s.get("status") == "completed" and outcome.exit_code == 0,
                     f"status={s.get('status')} step={s.get('step')} exit={outcome.exit_code}"),
              _check("heartbeats present", bool(hb), f"ranks {sorted(hb)}")]
    for r, recs in hb.items():
        ends = [x for x in recs if x["kind"] == "step_end" and x["step"] == 1]
        loss = ends[-1].get("loss") if ends else None
        checks.append(_check(f"rank {r}: step 1 progress + step_end", _has(recs, "progress", 1) and bool(ends),
                             "progress and step_end records for step 1"))
        checks.append(_check(f"rank {r}: step 2 step_start", _has(recs, "step_start", 2),
                             "iteration rollover reached step 2"))
        checks.append(_check(f"rank {r}: step 1 loss finite", isinstance(loss, float) and math.isfinite(loss),
                             f"loss={loss}"))
    st = _stalls(hb)
    checks.append(_check("no stall", not st, "; ".join(st) or "no stall records"))
    return checks


def _slope_per_100(xs: list[float], ys: list[float]) -> float:
    if len(xs) < 3:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 100.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def phase1_checks(outcome: Any, steps: int, max_ratio: float, max_growth: float) -> list[dict[str, Any]]:
    hb = _records(outcome.run_dir)
    s = outcome.summary
    checks = [_check("run completed", s.get("status") == "completed" and s.get("step") == steps,
                     f"status={s.get('status')} step={s.get('step')}/{steps}")]
    st = _stalls(hb)
    checks.append(_check("no stall", not st, "; ".join(st) or "no stall records"))
    rank0 = hb.get(0, [])
    busy = {x["step"] for x in rank0 if x["kind"] in ("checkpoint", "eval")}
    ends = {x["step"]: x for x in rank0 if x["kind"] == "step_end"}
    bad = [k for k, x in ends.items() if k > 5 and not (isinstance(x.get("loss"), float) and math.isfinite(x["loss"]))]
    checks.append(_check("loss finite beyond step 5", not bad and len(ends) >= min(steps, 6),
                         f"{len(ends)} step_end records; non-finite at {bad[:10]}" if bad else
                         f"{len(ends)} step_end records, all finite"))
    warm = max(5, steps // 10)
    # on a GPU the host may run ahead of the device: its device-measured step period is the step time
    key_ms = "gpu_step_ms" if any("gpu_step_ms" in x for x in ends.values()) else "step_ms"
    times = sorted(x[key_ms] for k, x in ends.items() if k > warm and k not in busy and key_ms in x)
    if len(times) >= 5:
        p50, p95 = statistics.median(times), times[min(len(times) - 1, int(round(0.95 * (len(times) - 1))))]
        ratio = p95 / p50 if p50 > 0 else math.inf
        checks.append(_check("steady step time", ratio <= max_ratio,
                             f"p50 {p50:.1f} ms, p95 {p95:.1f} ms, ratio {ratio:.2f} (max {max_ratio})"))
    else:
        checks.append(_check("steady step time", False, f"only {len(times)} steps after warm-up {warm}"))
    # the second half only: the first steps legitimately grow (allocator caches, prefetch buffers); the
    # fitted growth over the window (slope x length) is what a leak would show, robust to per-step noise
    key = "cuda_alloc_mib" if any("cuda_alloc_mib" in x for x in ends.values()) else "rss_mib"
    pts = sorted((k, x[key]) for k, x in ends.items() if key in x and k > steps // 2)
    slope = _slope_per_100([float(k) for k, _ in pts], [float(v) for _, v in pts])
    growth = slope * (pts[-1][0] - pts[0][0]) / 100.0 if len(pts) > 1 else 0.0
    checks.append(_check("flat memory", len(pts) >= 3 and growth <= max_growth,
                         f"{key}: fitted growth {growth:.1f} MiB over steps {steps // 2 + 1}..{steps} "
                         f"({slope:.1f} MiB/100 steps; max growth {max_growth} MiB)"))
    return checks


def render(report: dict[str, Any]) -> str:
    lines = [f"# NSA smoke: **{report['decision']}**", "", f"- profile: `{report['profile']}`",
             f"- started: {report['started']}", f"- wall: {report['wall_s']:.1f} s", ""]
    for ph in report["phases"]:
        lines += [f"## {ph['name']} - {'PASS' if ph['ok'] else 'FAIL'}", f"run dir: `{ph['run_dir']}`", "",
                  "| check | result | detail |", "|---|---|---|"]
        lines += [f"| {c['check']} | {'PASS' if c['ok'] else 'FAIL'} | {c['detail']} |" for c in ph["checks"]]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    args = _parser().parse_args()
    if args.phase1_steps < 1:
        raise UserError(f"--phase1-steps={args.phase1_steps} must be >= 1 (or pass --skip-phase1)")
    cfg, sources = load_config(args)
    print_header("smoke", cfg, sources, args.config)
    if args.print_config:
        return 0
    t0 = time.time()
    name = cfg.logging.name or f"smoke-{time.strftime('%Y%m%d-%H%M%S')}"
    root = run_root(cfg) / name          # runtime.storage_root applies (nsa/launch/storage.py)
    common = {"logging": {"root": str(root), "log_every": 1, "heartbeat_every": 1},
              "train": {"resume": "never", "resume_from": None}}
    report: dict[str, Any] = {"profile": args.config, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "phases": [], "root": str(root)}
    plans = [("Phase 0 (sanity: 2 steps)", "phase0", 2)]
    if not args.skip_phase1:
        plans.append((f"Phase 1 (stability: {args.phase1_steps} steps)", "phase1", args.phase1_steps))
    for title, pname, steps in plans:
        pc = replace_cfg(cfg, logging={**common["logging"], "name": pname},
                         train={**common["train"], "steps": steps,
                                "warmup_steps": min(cfg.train.warmup_steps, max(1, steps // 10))})
        print(f"\n== smoke {title} ==", flush=True)
        out = launch(pc, sources, prefix=pname)
        checks = phase0_checks(out) if pname == "phase0" else \
            phase1_checks(out, steps, args.max_step_ratio, args.max_mem_growth)
        ok = all(c["ok"] for c in checks)
        report["phases"].append({"name": title, "run_dir": str(out.run_dir), "ok": ok, "checks": checks,
                                 "summary": out.summary})
        if not ok:
            break
    report["decision"] = "GO" if report["phases"] and all(p["ok"] for p in report["phases"]) and \
        len(report["phases"]) == len(plans) else "NO-GO"
    report["wall_s"] = time.time() - t0
    md = render(report)
    root.mkdir(parents=True, exist_ok=True)
    (root / "smoke_report.md").write_text(md + "\n")
    (root / "smoke_report.json").write_text(json.dumps(report, indent=2, default=str))
    print("\n" + md)
    print(f"report: {root / 'smoke_report.md'}", flush=True)
    return 0 if report["decision"] == "GO" else 1


if __name__ == "__main__":
    main_entry(main)
