#!/usr/bin/env python
"""Where does a training step's time go? Host enqueue time vs GPU time vs launches, per variant.

    python bench/profile_step.py                                # prod_50k model, seq 2048, batch 1
    python bench/profile_step.py --variants ckpt,nockpt train.seq_len=8192

For each variant the bare step (nsa.train.step.train_step on synthetic tokens, no data path) is run
`--steps` times after warm-up and reports:
  wall ms    step time with a device sync after every step (p50)
  host ms    time until train_step returns, i.e. the host's enqueue cost (p50); host ~= wall means the
             step is launch/host-bound and any extra host work (e.g. a Ray worker's threads) slows it
  gpu ms     summed CUDA kernel time of one step (torch.profiler), the floor if the host kept up
  launches   kernel launches per step
plus the 20 ops with the largest self CPU time. Prints a table; writes JSON to bench/out/ and $OUT.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from nsa.config import extra_output_dir, resolve_config  # noqa: E402

VARIANTS = {
    "ckpt": [],
    "nockpt": ["model.grad_checkpointing=false"],
    "torch": ["nsa.backend=torch"],
    "compile": ["model.compile=true"],
    "compile_nockpt": ["model.compile=true", "model.grad_checkpointing=false"],
    "graph": ["runtime.cuda_graph=true"],
    "compile_graph": ["model.compile=true", "runtime.cuda_graph=true"],
}


def _build(overrides: list[str]):
    from nsa.model import TinyLM
    from nsa.train import build_optimizer, build_scheduler, precision_from_config
    cfg, _ = resolve_config(str(ROOT / "pipelines" / "configs" / "prod_50k.yaml"), overrides)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    prec = precision_from_config(cfg.runtime, dev)
    model = TinyLM.from_config(cfg.model, cfg.nsa).to(dev)
    opt = build_optimizer(model, cfg.train)
    sched = build_scheduler(opt, cfg.train)
    batch = torch.randint(0, cfg.model.vocab, (cfg.train.batch_size, cfg.train.seq_len + 1), device=dev)
    return cfg, dev, prec, model, opt, sched, batch


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)  # sync-ok: benchmark timing only


def profile_variant(name: str, overrides: list[str], steps: int, warmup: int, top: int) -> dict[str, Any]:
    cfg, dev, prec, model, opt, sched, batch = _build(overrides)

    from nsa.train.graphed import single_device_step
    run_step, _ = single_device_step(model, opt, sched, prec, cfg.runtime, grad_clip=cfg.train.grad_clip, device=dev)

    def step():
        return run_step([batch])

    t0 = time.perf_counter()
    for _ in range(warmup + (cfg.runtime.cuda_graph_warmup + 1 if cfg.runtime.cuda_graph else 0)):
        step()
    _sync(dev)
    warmup_s = time.perf_counter() - t0
    wall, host = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        _sync(dev)
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        wall.append((t2 - t0) * 1e3)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    n_prof = 2
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n_prof):
            step()
        _sync(dev)
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events) / n_prof if dev.type == "cuda" else float("nan")
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                         "cuLaunchKernelEx")) / n_prof
    cpu_top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    gpu_top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:top] if dev.type == "cuda" else []
    tokens = cfg.train.batch_size * cfg.train.seq_len
    row = {"variant": name, "overrides": overrides, "seq_len": cfg.train.seq_len, "batch": cfg.train.batch_size,
           "wall_ms_p50": statistics.median(wall), "host_ms_p50": statistics.median(host),
           "gpu_ms": gpu_us / 1e3, "launches": launches, "toks_per_s": tokens / statistics.median(wall) * 1e3, "warmup_s": warmup_s,
           "cpu_top": [{"op": e.key, "count": e.count / n_prof, "self_cpu_ms": e.self_cpu_time_total / 1e3 / n_prof}
                       for e in cpu_top],
           "gpu_top": [{"op": e.key[:90], "count": e.count / n_prof, "self_gpu_ms": e.self_device_time_total / 1e3 / n_prof}
                       for e in gpu_top]}
    del model, opt
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="ckpt,nockpt", help=f"comma list of {sorted(VARIANTS)}")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("overrides", nargs="*", metavar="section.key=value")
    a = ap.parse_args()
    rows = []
    for v in a.variants.split(","):
        if v not in VARIANTS:
            raise SystemExit(f"--variants: unknown {v!r}; choose from {sorted(VARIANTS)}")
        rows.append(profile_variant(v, VARIANTS[v] + a.overrides, a.steps, a.warmup, a.top))
        r = rows[-1]
        print(f"\n== {v} (seq {r['seq_len']}, batch {r['batch']}): wall {r['wall_ms_p50']:.1f} ms, "
              f"host {r['host_ms_p50']:.1f} ms, gpu {r['gpu_ms']:.1f} ms, {r['launches']:.0f} launches, "
              f"{r['toks_per_s']:.0f} tok/s (warm-up {r['warmup_s']:.1f} s)", flush=True)
        for e in r["cpu_top"]:
            print(f"  cpu {e['self_cpu_ms']:8.2f} ms  x{e['count']:6.0f}  {e['op']}")
        for e in r["gpu_top"][:12]:
            print(f"  gpu {e['self_gpu_ms']:8.2f} ms  x{e['count']:6.0f}  {e['op']}")
    print(f"\n{'variant':<8} {'seq':>5} {'wall ms':>8} {'host ms':>8} {'gpu ms':>8} {'launches':>9} {'tok/s':>8}")
    for r in rows:
        print(f"{r['variant']:<8} {r['seq_len']:>5} {r['wall_ms_p50']:>8.1f} {r['host_ms_p50']:>8.1f} "
              f"{r['gpu_ms']:>8.1f} {r['launches']:>9.0f} {r['toks_per_s']:>8.0f}")
    report = {"time": time.strftime("%Y-%m-%d %H:%M:%S"),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "rows": rows}
    out = ROOT / "bench" / "out" / f"profile_step_{time.strftime('%Y%m%d-%H%M%S')}.json"
    targets = [out] + ([Path(extra_output_dir()) / "profile_step.json"] if extra_output_dir() else [])
    for t in targets:
        t.parent.mkdir(parents=True, exist_ok=True)
        t.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
