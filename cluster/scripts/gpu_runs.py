#!/usr/bin/env python
"""The Ray-route runs of bench/gpu.sh on a GPU host (issues 47 and 49), as subcommands:

    python cluster/scripts/gpu_runs.py kill-at RUN_DIR --step N [--rank R] --out EVENT.json
    python cluster/scripts/gpu_runs.py report RUN_DIR [--event EVENT.json] [--reference RUN_DIR] --out R.json
    python cluster/scripts/gpu_runs.py runs --out ROWS.json [--steps S --warmup W] --case "NAME [@PROFILE] k=v ..." ...
    python cluster/scripts/gpu_runs.py table ROWS.json --out TABLE.json

kill-at: SIGKILL the training worker of rank R (its pid from its heartbeat) once it has finished step N: a
  real worker death, as an OOM kill or a lost node would be; writes the kill's time and the last step done.
report: a run's attempts (one per worker process: first, restarted, resumed), the restart step, the
  losses of the steps run twice (before the event and after the restart, which must agree), the seconds
  from the event (kill, stall, or an injected runtime.fault) to the restarted group's start, its first
  step, and the first step past the one the event interrupted; with --reference, every logged step's
  loss against another run's (a run without the event, or the run a checkpoint came from).
runs: launches in this one process through nsa.launch.builder.launch, so one private Ray instance serves
  every case; one throughput row per case (bench/bench_train.py's ray_row: device-timed step periods on
  CUDA), written after every case so a call cut short keeps what ran.
table: the scaling table of `runs` rows (NSA and the dense twin, 1 vs 2 GPUs, graphed vs DDP step).

Losses are the heartbeats' step_end records whose loss_step is their step; per step, the mean over ranks
(each rank logs its own micro-batch's loss). A logged loss is the mean since the previous log and a restart
logs its first step, so runs compared across a restart log every step (logging.log_every=1).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-4          # rel and abs, as the CPU restart tests (tests/test_stall_restart.py, test_pipeline_e2e.py)


# ------------------------------------------------------------------------------------------ heartbeats
def _records(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    from nsa.telemetry import read_heartbeat
    p = Path(run_dir) / f"heartbeat_rank{rank}.jsonl"
    return read_heartbeat(p) if p.is_file() else []


def run_ranks(run_dir: Path) -> list[int]:
    return sorted(int(m.group(1)) for p in Path(run_dir).glob("heartbeat_rank*.jsonl")
                  if (m := re.fullmatch(r"heartbeat_rank(\d+)\.jsonl", p.name)))


def attempts(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One rank's records cut into attempts (a run of records of one worker pid): start step and time,
    logged losses by step, step_end times by step, peak CUDA memory (MiB)."""
    out: list[dict[str, Any]] = []
    for r in records:
        if not out or r.get("pid") != out[-1]["pid"]:
            out.append({"pid": r.get("pid"), "first_ts": r["ts"], "start_step": None, "start_ts": None,
                        "streams": 1, "losses": {}, "ends": {}, "peak_mib": 0.0})
        a = out[-1]
        if r["kind"] == "start" and a["start_ts"] is None:
            # data_streams: a resume on fewer ranks continues k streams per rank, k x the micro-batches a step
            a["start_step"], a["start_ts"], a["streams"] = r["step"], r["ts"], int(r.get("data_streams", 1))
        elif r["kind"] == "step_end":
            a["ends"][r["step"]] = r["ts"]
            loss = r.get("loss")
            if r.get("loss_step") == r["step"] and isinstance(loss, float) and math.isfinite(loss):
                a["losses"][r["step"]] = loss
            a["peak_mib"] = max(a["peak_mib"], float(r.get("cuda_max_alloc_mib", 0.0) or 0.0))
    return out


def final_losses(run_dir: Path) -> dict[int, float]:
    """step -> mean over ranks of the loss each rank logged last for that step (a restart's value wins)."""
    per_rank = []
    for rank in run_ranks(run_dir):
        seen: dict[int, float] = {}
        for a in attempts(_records(run_dir, rank)):
            seen.update(a["losses"])
        per_rank.append(seen)
    if not per_rank:
        return {}
    steps = set.intersection(*(set(p) for p in per_rank))
    return {s: sum(p[s] for p in per_rank) / len(per_rank) for s in sorted(steps)}


def compare(a: dict[int, float], b: dict[int, float], tol: float = TOL) -> dict[str, Any]:
    """Steps both hold, the largest absolute and relative differences, and whether every step agrees
    within tol (|x - y| <= max(tol, tol * |y|), pytest.approx's rule)."""
    steps = sorted(set(a) & set(b))
    if not steps:
        return {"steps": 0, "same": None}
    diffs = [abs(a[s] - b[s]) for s in steps]
    rel = [d / max(abs(b[s]), 1e-12) for d, s in zip(diffs, steps)]
    worst = max(range(len(steps)), key=lambda i: diffs[i])
    return {"steps": len(steps), "first": steps[0], "last": steps[-1], "max_abs_diff": max(diffs),
            "max_rel_diff": max(rel), "worst_step": steps[worst],
            "same": all(d <= max(tol, tol * abs(b[s])) for d, s in zip(diffs, steps)), "tol": tol}


def find_event(run_dir: Path, event_file: Optional[str]) -> Optional[dict[str, Any]]:
    """What interrupted the run: kill-at's record, else the first stall that ended a worker (its start =
    record time - seconds since the last kick), else an injected runtime.fault marker. ``step`` is the last
    step finished before it."""
    if event_file:    # kill-at writes it only once it fired
        return json.loads(Path(event_file).read_text()) if Path(event_file).is_file() else None
    stalls = [r for rank in run_ranks(run_dir) for r in _records(run_dir, rank)
              if r["kind"] == "stall" and r.get("exiting")]
    if stalls:
        r = min(stalls, key=lambda x: x["ts"])
        return {"kind": "stall", "rank": r["rank"], "step": r["step"], "detected_ts": r["ts"],
                "ts": r["ts"] - float(r.get("seconds_since_kick", 0.0)), "action": r.get("action")}
    for marker in sorted(Path(run_dir).glob(".fault_*@*.done")):
        kind, at = marker.name[len(".fault_"):-len(".done")].split("@")
        m = re.search(r"fired at ([0-9.]+)", marker.read_text())
        if m:
            return {"kind": f"fault:{kind}", "step": int(at) - 1, "ts": float(m.group(1))}
    return None


def report(run_dir: Path, event_file: Optional[str] = None, reference: Optional[Path] = None,
           tol: float = TOL) -> dict[str, Any]:
    """What `report` writes (see the module docstring)."""
    run_dir = Path(run_dir)
    ranks = run_ranks(run_dir)
    if not ranks:
        raise SystemExit(f"report: no heartbeat_rank*.jsonl in {run_dir} (is it a run dir?)")
    per_rank = {r: attempts(_records(run_dir, r)) for r in ranks}
    repeated = []
    for rank, atts in per_rank.items():
        for prev, nxt in zip(atts, atts[1:]):
            repeated.append({"rank": rank, "pids": [prev["pid"], nxt["pid"]], "restart_step": nxt["start_step"],
                             **compare(prev["losses"], nxt["losses"], tol)})
    lead = per_rank[ranks[0]]
    out: dict[str, Any] = {
        "run_dir": str(run_dir), "ranks": ranks,
        "attempts": [{"pid": a["pid"], "start_step": a["start_step"], "start_ts": a["start_ts"],
                      "steps_ended": len(a["ends"]), "last_step": max(a["ends"], default=None)} for a in lead],
        "restart_steps": [a["start_step"] for a in lead[1:]],
        "repeated": repeated,
        "repeated_same": all(r["same"] for r in checked) if (checked := [r for r in repeated if r["steps"]]) else None,
        "peak_mem_gib_per_rank": {r: round(max((a["peak_mib"] for a in atts), default=0.0) / 1024, 2)
                                  for r, atts in per_rank.items()},
    }
    mfile = run_dir / "metrics.json"
    if mfile.is_file():
        m = json.loads(mfile.read_text())
        out["metrics"] = {k: m.get(k) for k in ("status", "step", "total_steps", "start_step", "resumed_from",
                                                 "world_size", "step_mode", "final_loss", "final_val_loss",
                                                 "step_ms_p50", "toks_per_s", "sharding", "context_parallel")}
    losses = final_losses(run_dir)
    out["losses"] = {str(s): round(v, 6) for s, v in losses.items()}
    ev = find_event(run_dir, event_file)
    out["event"] = ev
    if ev is not None:
        after = [a for a in lead if a["start_ts"] is not None and a["start_ts"] > ev["ts"]]
        if after:
            a = after[0]
            past = [ts for s, ts in sorted(a["ends"].items()) if s > ev["step"]]
            out["recovery"] = {"restart_step": a["start_step"],
                               "to_restart_s": round(a["start_ts"] - ev["ts"], 2),
                               "to_first_step_s": round(min(a["ends"].values()) - ev["ts"], 2) if a["ends"] else None,
                               "to_past_event_step_s": round(past[0] - ev["ts"], 2) if past else None}
        else:
            out["recovery"] = None
    if reference is not None:
        out["reference"] = {"run_dir": str(reference), **compare(losses, final_losses(Path(reference)), tol)}
    return out


# ------------------------------------------------------------------------------------------ kill-at
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _new_step_ends(fh: Any, buf: str) -> tuple[list[dict[str, Any]], str]:
    """step_end records among the complete lines appended since the last read (a partial line is kept)."""
    buf += fh.read()
    *lines, rest = buf.split("\n")
    ends = []
    for ln in lines:
        try:
            r = json.loads(ln)
        except ValueError:
            continue
        if r.get("kind") == "step_end":
            ends.append(r)
    return ends, rest


def kill_at(run_dir: Path, step: int, rank: int = 1, timeout: float = 600.0, poll: float = 0.05) -> dict[str, Any]:
    """Wait for rank ``rank``'s step_end >= step (read as the file grows), SIGKILL that worker's pid, then read
    the last step it finished. Raises TimeoutError if the step is not reached in time."""
    path = Path(run_dir) / f"heartbeat_rank{rank}.jsonl"
    deadline, fh, buf, last = time.time() + timeout, None, "", {}
    try:
        while time.time() < deadline:
            if fh is None and path.is_file():
                fh = path.open()
            ends, buf = _new_step_ends(fh, buf) if fh is not None else ([], buf)
            for r in ends:
                last[r["pid"]] = r["step"]
            hit = [r for r in ends if r["step"] >= step and _pid_alive(int(r["pid"]))]
            if hit:
                pid = int(hit[-1]["pid"])
                os.kill(pid, signal.SIGKILL)
                ts = time.time()
                for _ in range(100):            # SIGKILL is asynchronous: wait until the pid is gone
                    if not _pid_alive(pid):
                        break
                    time.sleep(0.01)
                for r in _new_step_ends(fh, buf)[0]:   # what it finished before the signal landed
                    last[r["pid"]] = max(last.get(r["pid"], 0), r["step"])
                return {"kind": "kill", "rank": rank, "pid": pid, "ts": ts, "asked_step": step,
                        "step": last[pid], "signal": "SIGKILL"}
            time.sleep(poll)
    finally:
        if fh is not None:
            fh.close()
    raise TimeoutError(f"kill-at: rank {rank} of {run_dir} did not finish step {step} within {timeout:g} s")


# ------------------------------------------------------------------------------------------ runs
def _bench_train():
    """bench/bench_train.py as a module (with bench/common.py as `common`, as when run from bench/)."""
    for mod in ("common", "bench_train"):
        if mod not in sys.modules:
            spec = importlib.util.spec_from_file_location(mod, ROOT / "bench" / f"{mod}.py")
            m = importlib.util.module_from_spec(spec)
            sys.modules[mod] = m
            spec.loader.exec_module(m)
    return sys.modules["bench_train"]


def parse_case(text: str, profile: str) -> tuple[str, str, list[str], Optional[int]]:
    """'NAME [@PROFILE] [warmup=N] k=v ...' -> (name, profile, overrides, the case's own warm-up steps)."""
    parts = text.split()
    if not parts or "=" in parts[0] or parts[0].startswith("@"):
        raise SystemExit(f"--case {text!r}: start with the case's name, e.g. --case 'nsa_8k train.seq_len=8192'")
    prof = [p[1:] for p in parts[1:] if p.startswith("@")]
    warm = [int(p.split("=", 1)[1]) for p in parts[1:] if p.startswith("warmup=")]
    ovr = [p for p in parts[1:] if not p.startswith(("@", "warmup="))]
    return parts[0], (prof[-1] if prof else profile), ovr, (warm[-1] if warm else None)


def case_row(run_dir: Path, cfg: Any, warmup: int, summary: dict[str, Any]) -> dict[str, Any]:
    """bench_train.ray_row, with tokens per step counted per data-parallel replica (a CP group of N ranks
    trains one sequence) and per data stream of a rank (a resume on fewer ranks), and the peak CUDA memory
    of every rank."""
    row = _bench_train().ray_row(run_dir, cfg, warmup)
    world, cp = int(summary.get("world_size", 1)), cfg.runtime.context_parallel
    streams = attempts(_records(run_dir, 0))[-1]["streams"]
    tokens = cfg.train.batch_size * cfg.train.seq_len * cfg.train.accumulate * max(1, world // cp) * streams
    row.update(tokens_per_step=tokens, toks_per_s=tokens / (row["step_ms_p50"] / 1e3))
    rep = report(run_dir)
    row["peak_mem_gib_per_rank"] = rep["peak_mem_gib_per_rank"]
    return row


def run_cases(cases: list[str], out: Path, steps: int, warmup: int, profile: str, common: list[str],
              root: Path, dry_run: bool = False) -> list[dict[str, Any]]:
    """Launch every case in turn (dry_run: resolve and print each case's config only, nothing launched)."""
    from nsa.config import resolve_config
    from nsa.launch import builder
    rows: list[dict[str, Any]] = []
    for text in cases:
        halted = False
        name, prof, ovr, own = parse_case(text, profile)
        warm = warmup if own is None else own
        keys = {o.split("=", 1)[0] for o in common + ovr}
        extra = [] if "train.steps" in keys else [f"train.steps={warm + steps}"]
        row: dict[str, Any] = {"case": name, "profile": prof, "overrides": common + ovr}
        t0 = time.time()
        try:
            cfg, src = resolve_config(str(ROOT / prof), common + extra + ovr +
                                      [f"logging.root={root}", f"logging.name={name}"])
            row.update(world=cfg.runtime.num_workers, cp=cfg.runtime.context_parallel, seq=cfg.train.seq_len,
                       attention=cfg.model.attention, cuda_graph=cfg.runtime.cuda_graph,
                       sharding=cfg.runtime.sharding, steps=cfg.train.steps)
            if dry_run:
                print(f"case {name}: {prof} " + " ".join(f"{k}={row[k]}" for k in (
                    "world", "cp", "seq", "attention", "cuda_graph", "sharding", "steps")), flush=True)
                rows.append(row)
                continue
            res = builder.launch(cfg, src, prefix="gpu", quiet=True)
            row.update(status=res.summary.get("status"), exit_code=res.exit_code, run_dir=str(res.run_dir),
                       step_mode=res.summary.get("step_mode"))
            # the driver turns SIGTERM (timeout's, at T_RUN) into a halt with a checkpoint: this case keeps the
            # steps it ran, and no later case starts
            halted = res.summary.get("status") == "halted"
            if res.exit_code == 0:
                row.update(case_row(res.run_dir, cfg, warm, res.summary))
            else:
                row["error"] = f"{res.summary.get('status')}: {res.summary.get('reason', '')}"
        except Exception as exc:   # one case's failure (OOM, bad override) is its row; the others still run
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        row["wall_s"] = round(time.time() - t0, 1)
        rows.append(row)
        msg = row.get("error") or f"{row['toks_per_s']:.0f} tok/s, step {row['step_ms_p50']:.1f} ms, {row['step_mode']}"
        print(f"case {name}: {msg} ({row['wall_s']:.0f} s)", flush=True)
        write_json(out, {"steps": steps, "warmup": warmup, "rows": rows})
        if halted:
            print(f"case {name} was halted (a SIGTERM: the time limit): the later cases were not launched", flush=True)
            break
    return rows


def write_json(path: Path, data: dict[str, Any]) -> None:
    """data with the date, command line, GPUs (nvidia-smi: the driver process never touches CUDA) and torch."""
    import datetime
    import importlib.metadata
    import subprocess
    data = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv), **data}
    try:
        gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout.splitlines()
        data["device"] = [g.split(" (UUID")[0] for g in gpus if g.strip()]
    except (OSError, subprocess.SubprocessError):
        data["device"] = "cpu"
    try:
        data["torch"] = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        pass
    from nsa.fileio import atomic_write_text
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=1, default=str))


# ------------------------------------------------------------------------------------------ table
def scale_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (attention, seq): tokens/s on 1 GPU and on 2 (graphed step with its captured all-reduce, and
    DDP's eager overlapped buckets), the 2-GPU efficiency of each against twice the 1-GPU figure, the faster
    2-GPU step, and NSA / dense per GPU (1 GPU) and in aggregate (the faster 2-GPU step of each)."""
    tok: dict[tuple, float] = {}
    modes: dict[tuple, dict[str, str]] = {}
    for r in rows:   # keyed by the step asked for; the step each run took is kept beside (step_modes)
        if "toks_per_s" in r and r.get("cp", 1) == 1:
            tok[(r["attention"], r["seq"], r["world"], bool(r["cuda_graph"]))] = r["toks_per_s"]
            modes.setdefault((r["attention"], r["seq"]), {})[r["case"]] = str(r.get("step_mode"))
    table = []
    for att, seq in sorted({(k[0], k[1]) for k in tok}, key=lambda k: (k[1], k[0])):
        one = tok.get((att, seq, 1, True)) or tok.get((att, seq, 1, False))
        g, e = tok.get((att, seq, 2, True)), tok.get((att, seq, 2, False))
        best = max((v for v in (g, e) if v), default=None)
        table.append({"attention": att, "seq": seq, "tok_s_1gpu": one, "tok_s_2gpu_graph": g, "tok_s_2gpu_ddp": e,
                      "eff_graph": g / (2 * one) if g and one else None, "eff_ddp": e / (2 * one) if e and one else None,
                      "faster_2gpu": None if not (g and e) else ("graph" if g >= e else "ddp"), "tok_s_2gpu_best": best,
                      "step_modes": modes.get((att, seq), {})})
    by = {(t["attention"], t["seq"]): t for t in table}
    for t in table:
        d = by.get(("dense", t["seq"]))
        if t["attention"] == "nsa" and d:
            t["nsa_over_dense_per_gpu"] = t["tok_s_1gpu"] / d["tok_s_1gpu"] if t["tok_s_1gpu"] and d["tok_s_1gpu"] else None
            t["nsa_over_dense_aggregate"] = (t["tok_s_2gpu_best"] / d["tok_s_2gpu_best"]
                                             if t["tok_s_2gpu_best"] and d["tok_s_2gpu_best"] else None)
    return table


def format_table(table: list[dict[str, Any]]) -> str:
    def f(v: Any, pat: str) -> str:
        return format(v, pat) if isinstance(v, (int, float)) else "-"
    lines = ["attention   seq   1 GPU tok/s  2 GPU graph   2 GPU DDP  eff graph  eff DDP  faster  NSA/dense 1 GPU  2 GPU"]
    for t in table:
        lines.append(f"{t['attention']:<7} {t['seq']:>7} {f(t['tok_s_1gpu'], '12.0f')} {f(t['tok_s_2gpu_graph'], '12.0f')} "
                     f"{f(t['tok_s_2gpu_ddp'], '11.0f')} {f(t['eff_graph'], '10.1%')} {f(t['eff_ddp'], '8.1%')} "
                     f"{t['faster_2gpu'] or '-':>7} {f(t.get('nsa_over_dense_per_gpu'), '15.2f')} "
                     f"{f(t.get('nsa_over_dense_aggregate'), '6.2f')}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ main
def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kill-at", help="SIGKILL a rank's worker once it finished a step")
    k.add_argument("run_dir", type=Path)
    k.add_argument("--step", type=int, required=True)
    k.add_argument("--rank", type=int, default=1)
    k.add_argument("--timeout", type=float, default=600.0)
    k.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("report", help="attempts, restart, repeated losses, recovery time of a run")
    r.add_argument("run_dir", type=Path)
    r.add_argument("--event", default=None, help="kill-at's JSON (default: a stall record or fault marker)")
    r.add_argument("--reference", type=Path, default=None, help="a run whose logged losses must match")
    r.add_argument("--tol", type=float, default=TOL)
    r.add_argument("--runs", type=Path, default=None, help="a `runs` JSON to keep in the report")
    r.add_argument("--note", action="append", default=[], metavar="KEY=VALUE", help="kept under 'notes'")
    r.add_argument("--out", type=Path, required=True)
    n = sub.add_parser("runs", help="launch cases in one process (one Ray instance); one throughput row each")
    n.add_argument("--case", action="append", required=True,
                   help="'NAME [@PROFILE] [warmup=N] key=value ...' (warmup: this case's own --warmup)")
    n.add_argument("--profile", default="pipelines/configs/prod_50k.yaml", help="relative to the repository")
    n.add_argument("--common", default="", help="key=value overrides of every case (space-separated)")
    n.add_argument("--steps", type=int, default=12, help="measured steps (train.steps = warmup + steps)")
    n.add_argument("--warmup", type=int, default=6, help="steps before the measured ones (a CUDA-graph step is "
                   "steady from step 6: 3 eager, the capture, one more)")
    n.add_argument("--root", type=Path, required=True, help="logging.root of the runs (absolute)")
    n.add_argument("--out", type=Path, required=True)
    n.add_argument("--dry-run", action="store_true", help="resolve every case's config, launch nothing")
    t = sub.add_parser("table", help="scaling table of `runs` rows")
    t.add_argument("rows", type=Path)
    t.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "kill-at":
        ev = kill_at(a.run_dir, a.step, a.rank, a.timeout)
        write_json(a.out, ev)
        print(f"kill-at: SIGKILL rank {ev['rank']} pid {ev['pid']} after step {ev['step']}", flush=True)
    elif a.cmd == "report":
        rep = report(a.run_dir, a.event, a.reference, a.tol)
        rep["notes"] = dict(n.split("=", 1) for n in a.note if "=" in n)
        if a.runs is not None:
            rep["runs"] = json.loads(a.runs.read_text())["rows"]
        write_json(a.out, rep)
        print(json.dumps({k: rep.get(k) for k in ("restart_steps", "repeated_same", "recovery", "event")}
                         | ({"reference": rep["reference"]} if "reference" in rep else {}), default=str), flush=True)
    elif a.cmd == "runs":
        rows = run_cases(a.case, a.out, a.steps, a.warmup, a.profile, a.common.split(), a.root.resolve(), a.dry_run)
        return 0 if all("error" not in r for r in rows) else 1
    else:
        table = scale_table(json.loads(a.rows.read_text())["rows"])   # rows of `runs` with cp 1
        write_json(a.out, {"table": table, "rows": json.loads(a.rows.read_text())["rows"]})
        print(format_table(table), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
