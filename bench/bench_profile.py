#!/usr/bin/env python
"""Profiling: where the time goes, one mode per question.

    python bench/bench_profile.py kernels --T 8192 65536 [--iters 5] [--ops]
    python bench/bench_profile.py kernels --T 16384 --HQ 12 --H 2 --dk 64 --dv 64 --compare "" select.prefetch=true
    python bench/bench_profile.py kernels --T 65536 --inputs captured:bench/captured_paper --layer 3 --compare "" tile.m=1
    python bench/bench_profile.py kernels --T 65536 --fwd --compare ""          # the forward alone
    python bench/bench_profile.py step [--variants ckpt,nockpt] [section.key=value ...]
    python bench/bench_profile.py split --T 8192 16384 65536 [--models nsa,dense] [section.key=value ...]
    ncu --kernel-name regex:_slc_fwd_kernel --launch-count 1 --section SpeedOfLight \\
        python bench/bench_profile.py ncu-attention --T 65536 --calls 1
    ncu --kernel-name regex:_slc_bwd_dkdv_kernel --launch-skip 1 --launch-count 1 --set full \\
        python bench/bench_profile.py ncu-attention --T 16384 --HQ 12 --H 2 --dk 64 --dv 64   # production shape
    ncu --kernel-name regex:_cmp_kernel --launch-skip 2 --launch-count 1 --section WarpStateStats \\
        python bench/bench_profile.py ncu-decode --B 16 --S 65536

kernels: every kernel's device microseconds per call, calls per step and share of one NSA
  forward+backward (Triton backend, paper sizes, B=1, HQ=64, H=4, d=128, bf16) under torch.profiler,
  and the dense SDPA forward+backward of the same shapes for scale; --ops also lists the aten ops with
  the most own device time (names the producer of each glue kernel). JSON: profile_attention.
  --compare runs tuning variants instead and prints their kernels' device ms side by side, with the
  registers and spills of the Triton kernels each one compiled. JSON: profile_compare. --fwd times the
  forward alone (with autograd recording, as in training), for the NSA op and the dense side.
step: a training step of the prod_50k model per step-mode variant (bare nsa.train step on synthetic
  tokens): wall ms (sync per step, p50), host ms (until the step returns: the enqueue cost; host ~= wall
  means host-bound), GPU ms (summed kernel time, torch.profiler), launches per step, and the ops with
  the most self CPU / GPU time. JSON: profile_step.
split: one eager training step per model (nsa, dense) and length, its kernels' time charged to the attention op,
  the rest of the attention layer, MLP, norms, embedding/head, optimizer and other (nsa/telemetry/step_split.py),
  host gaps (wall minus busy device time) and the graphed step's wall time. JSON: profile_split.
ncu-source REPORT: the warp-state samples of an Nsight Compute report (ncu --set full) per source line and stall
  reason (Triton kernels carry their Python lines); needs Nsight's extras/python on PYTHONPATH (gpu.sh ncu).
accuracy: on captured inputs (bench/captured), o and every gradient of the bf16 op against the fp32 per-token op,
  for the per-token loop, block order with bf16 / fp32 / the preset's pair partials, and the block-order ones
  against the bf16 per-token op (what tests/test_triton_pairs.py bounds at 0.5%).
ncu-attention / ncu-decode: drivers for Nsight Compute that run only the kernels to profile (a few
  forward+backward calls of the op; a few graph-free decode steps with device positions, PDL off, then
  the decode kernels' registers / spills / shared memory). The first call compiles: skip it in ncu.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import common
from common import HP, ROOT

STEP_VARIANTS = {
    "ckpt": [],
    "nockpt": ["model.grad_checkpointing=false"],
    "torch": ["nsa.backend=torch"],
    "compile": ["model.compile=true"],
    "compile_nockpt": ["model.compile=true", "model.grad_checkpointing=false"],
    "graph": ["runtime.cuda_graph=true"],
    "compile_graph": ["model.compile=true", "runtime.cuda_graph=true"],
}


# ----------------------------------------------------------------------------------------- kernels
def kernel_table(fn, iters: int) -> tuple[list[dict], float]:
    """[{kernel, us_per_call, calls_per_iter, share}] sorted by total time, and device ms per iter."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    tot, cnt = defaultdict(float), defaultdict(int)
    for evt in prof.events():
        if evt.device_type.name != "CUDA":
            continue
        tot[evt.name] += getattr(evt, "device_time", None) or getattr(evt, "cuda_time", 0.0)
        cnt[evt.name] += 1
    total = sum(tot.values())
    rows = [dict(kernel=k[:90], us_per_call=round(tot[k] / cnt[k], 1), calls_per_iter=cnt[k] / iters,
                 ms_per_iter=round(tot[k] / iters / 1e3, 3), share=round(tot[k] / total, 4))
            for k in sorted(tot, key=lambda k: -tot[k])]
    return rows, total / iters / 1e3


def op_table(fn, iters: int, top: int = 25) -> list[dict]:
    """The aten ops with the most device time of their own (kernels they launched), by input shapes."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows = []
    for evt in prof.key_averages(group_by_input_shape=True):
        own = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)
        if evt.key.startswith("aten::") and own > 0:
            rows.append(dict(op=evt.key, shapes=str(evt.input_shapes)[:120], calls_per_iter=evt.count / iters,
                             ms_per_iter=round(own / iters / 1e3, 3)))
    return sorted(rows, key=lambda r: -r["ms_per_iter"])[:top]


def fwd_bwd(x: list[torch.Tensor], do: torch.Tensor, tuning, hp: dict | None = None, fwd_only: bool = False):
    """One NSA forward+backward of the op's inputs x (hyperparameters hp, default HP) under tuning, as a
    callable returning the gradients; fwd_only: the forward alone, recorded for autograd as in training (the
    saved tensors are freed with the returned output)."""
    def step():
        o, _ = common.nsa_op(x, tuning, hp)
        return o if fwd_only else torch.autograd.grad(o, x, do)
    return step


def op_inputs(a, T: int) -> tuple[list[torch.Tensor], dict, tuple[int, ...]]:
    """(the op's eight inputs, hp, (B, HQ, H, dk, dv)) at T: random ones of --HQ/--H/--dk/--dv, or with
    --inputs captured:DIR that folder's capture of --layer at T (its shapes and hyperparameters)."""
    if a.inputs == "random":
        return common.nsa_inputs(1, T, a.HQ, a.H, a.dk, a.dv), dict(HP), (1, a.HQ, a.H, a.dk, a.dv)
    folder = a.inputs.split(":", 1)[1]
    caps = common.read_captures(folder)["captures"]
    entry = next((e for e in caps if e["T"] == T and e["layer"] == a.layer), None)
    if entry is None:
        raise SystemExit(f"--inputs {a.inputs}: no capture of layer {a.layer} at T={T} (captured: "
                         f"{sorted((e['T'], e['layer']) for e in caps)}); pick --T / --layer from these")
    x, _, hp, shape = common.capture_case(folder, entry)
    return x, hp, shape


def compiled_kernels() -> dict:
    """{id: (kernel name, warps, stages, registers, spills, shared bytes)} of every Triton kernel of nsa
    compiled so far in this process (Triton's in-memory cache)."""
    import importlib
    import pkgutil

    import triton
    import nsa.ops.triton as pkg
    out = {}
    for m in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"{pkg.__name__}.{m.name}")
        for name, fn in vars(mod).items():
            if not isinstance(fn, triton.runtime.JITFunction) or fn.__module__ != mod.__name__:
                continue
            for dc in getattr(fn, "device_caches", {}).values():
                for ck in dc[0].values():
                    if getattr(ck, "n_regs", None) is None and hasattr(ck, "_init_handles"):
                        ck._init_handles()
                    md = ck.metadata
                    out[id(ck)] = (name, md.num_warps, md.num_stages, ck.n_regs, ck.n_spills, md.shared)
    return out


def kernel_ms(rows: list[dict], width: int = 60) -> dict[str, float]:
    """{kernel name cut to width: ms per iteration} of kernel_table rows; names that agree in their
    first width characters (FA4's window and compressed launches) add up instead of overwriting."""
    out: dict[str, float] = {}
    for r in rows:
        name = r["kernel"][:width]
        out[name] = round(out.get(name, 0.0) + r["ms_per_iter"], 3)
    return out


def split_changes(variant: str) -> list[str]:
    """"F=V,F=V" -> its changes; commas inside parentheses, nested too, belong to a value, e.g.
    tile.fwd=(TileLaunch(128,8,2),TileLaunch(32,8,3))."""
    out, depth, cur = [], 0, ""
    for ch in variant:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [c for c in out + [cur] if c]


def run_compare(a) -> None:
    """--compare: per-kernel device ms of each tuning variant side by side, and the registers / spills of
    the kernels each variant compiled."""
    variants = [v.strip() for v in a.compare]
    result = {"hp": HP, "inputs": a.inputs, "variants": variants, "pass": _pass(a), "runs": {}, "compiled": {}}
    for T in a.T:
        x, hp, (B, HQ, H, dk, dv) = op_inputs(a, T)
        result.update(hp=hp, shape=dict(HQ=HQ, H=H, dk=dk, dv=dv))
        do = torch.randn(B, T, HQ, dv, device="cuda", dtype=torch.bfloat16)
        per, totals = {}, {}
        for v in variants:
            tuning = common.changed_tuning(split_changes(v) + a.tuning)
            before = compiled_kernels()
            nsa_step = fwd_bwd(x, do, tuning, hp, a.fwd)
            rows, ms = kernel_table(nsa_step, a.iters)
            new = [k for i, k in compiled_kernels().items() if i not in before]
            if new:
                result["compiled"][v or "base"] = [dict(zip(("kernel", "warps", "stages", "regs", "spills", "shared"), k))
                                                   for k in new]
            per[v] = kernel_ms(rows)
            totals[v] = ms
        names = sorted({k for p in per.values() for k in p}, key=lambda k: -per[variants[0]].get(k, 0.0))[:a.top]
        result["runs"][str(T)] = {"device_ms": totals, "kernels_ms": per}
        print(f"\nT={T}, device ms per {_pass(a)} (HQ={HQ}, H={H}, dk={dk}, dv={dv}, inputs {a.inputs}"
              f"{'' if a.inputs == 'random' else f' layer {a.layer}'}):")
        common.print_table(["kernel"] + [v or "base" for v in variants],
                           [["TOTAL"] + [totals[v] for v in variants]]
                           + [[n[:44]] + [per[v].get(n, 0.0) for v in variants] for n in names], ".3f")
        del x
        torch.cuda.empty_cache()
    print("\ncompiled (variant: kernel warps/stages regs spills shared):")
    for v, ks in result["compiled"].items():
        for k in ks:
            print(f"  {v[:40]:<40} {k['kernel']:<28} {k['warps']}/{k['stages']} regs {k['regs']} "
                  f"spills {k['spills']} shared {k['shared']}")
    common.write_result(result, "profile_compare", a)


def run_kernels(a) -> None:
    if a.compare:
        return run_compare(a)
    result = {"hp": HP, "runs": {}, "tuning": a.tuning, "inputs": a.inputs, "pass": _pass(a)}
    tuning = common.changed_tuning(a.tuning)
    for T in a.T:
        x, hp, (B, HQ, H, dk, dv) = op_inputs(a, T)
        result["hp"] = hp
        do = torch.randn(B, T, HQ, dv, device="cuda", dtype=torch.bfloat16)
        nsa_step = fwd_bwd(x, do, tuning, hp, a.fwd)
        dense_step = _dense_fwd_bwd(B, T, HQ, H, dk, dv, a.fwd)
        rows, ms = kernel_table(nsa_step, a.iters)
        drows, dms = kernel_table(dense_step, a.iters)
        run = result["runs"][str(T)] = {"nsa_device_ms": round(ms, 3), "dense_device_ms": round(dms, 3),
                                        "kernels": rows, "dense_kernels": drows}
        print(f"\nT={T}: NSA {_pass(a)} device {ms:.2f} ms, dense {dms:.2f} ms (ratio {dms / ms:.2f}x)")
        common.print_table(["kernel", "us/call", "calls", "ms", "share"],
                           [[r["kernel"][:70], r["us_per_call"], r["calls_per_iter"], r["ms_per_iter"],
                             f"{r['share']:.1%}"] for r in rows], [""] + [".1f", "g", ".3f", ""])
        if a.ops:
            run["aten_ops"] = ops = op_table(nsa_step, a.iters)
            common.print_table(["aten op (own device time)", "ms", "calls", "input shapes"],
                               [[r["op"], r["ms_per_iter"], r["calls_per_iter"], r["shapes"]] for r in ops],
                               ["", ".3f", "g", ""])
        del x, nsa_step, dense_step
        torch.cuda.empty_cache()
    common.write_result(result, "profile_attention", a)


def _pass(a) -> str:
    """What one timed call of `kernels` is: "fwd" (--fwd) or "fwd+bwd"."""
    return "fwd" if a.fwd else "fwd+bwd"


def _dense_fwd_bwd(B: int, T: int, HQ: int, H: int, dk: int, dv: int, fwd_only: bool = False):
    """A causal GQA SDPA forward+backward step on fresh bf16 inputs (the dense side of the kernel table);
    fwd_only: its forward alone, recorded for autograd."""
    bf = dict(device="cuda", dtype=torch.bfloat16, requires_grad=True)
    qd, kd, vd = torch.randn(B, HQ, T, dk, **bf), torch.randn(B, H, T, dk, **bf), torch.randn(B, H, T, dv, **bf)
    dod = torch.randn(B, HQ, T, dv, device="cuda", dtype=torch.bfloat16)

    def step():
        o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
        return o if fwd_only else torch.autograd.grad(o, (qd, kd, vd), dod)
    return step


# ----------------------------------------------------------------------------------------- step
def _build(overrides: list[str]):
    from nsa.config import resolve_config
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


def profile_variant(name: str, overrides: list[str], steps: int, warmup: int, top: int) -> dict[str, Any]:
    from nsa.train.graphed import single_device_step
    cfg, dev, prec, model, opt, sched, batch = _build(overrides)
    run_step, _ = single_device_step(model, opt, sched, prec, cfg.runtime, grad_clip=cfg.train.grad_clip, device=dev)

    def step():
        return run_step([batch])

    t0 = time.perf_counter()
    for _ in range(warmup + (cfg.runtime.cuda_graph_warmup + 1 if cfg.runtime.cuda_graph else 0)):
        step()
    common.sync()
    warmup_s = time.perf_counter() - t0
    wall, host = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        common.sync()
        host.append((t1 - t0) * 1e3)
        wall.append((time.perf_counter() - t0) * 1e3)
    cuda = dev.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    n_prof = 2
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n_prof):
            step()
        common.sync()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events) / n_prof if cuda else float("nan")
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                         "cuLaunchKernelEx")) / n_prof
    cpu_top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    gpu_top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:top] if cuda else []
    tokens = cfg.train.batch_size * cfg.train.seq_len
    row = {"variant": name, "overrides": overrides, "seq_len": cfg.train.seq_len, "batch": cfg.train.batch_size,
           "wall_ms_p50": statistics.median(wall), "host_ms_p50": statistics.median(host), "gpu_ms": gpu_us / 1e3,
           "launches": launches, "toks_per_s": tokens / statistics.median(wall) * 1e3, "warmup_s": warmup_s,
           "cpu_top": [{"op": e.key, "count": e.count / n_prof, "self_cpu_ms": e.self_cpu_time_total / 1e3 / n_prof}
                       for e in cpu_top],
           "gpu_top": [{"op": e.key[:90], "count": e.count / n_prof,
                        "self_gpu_ms": e.self_device_time_total / 1e3 / n_prof} for e in gpu_top]}
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
    return row


def run_step(a) -> None:
    rows = []
    for v in a.variants.split(","):
        if v not in STEP_VARIANTS:
            raise SystemExit(f"--variants: unknown {v!r}; choose from {sorted(STEP_VARIANTS)}")
        rows.append(r := profile_variant(v, STEP_VARIANTS[v] + a.overrides, a.steps, a.warmup, a.top))
        print(f"\n== {v} (seq {r['seq_len']}, batch {r['batch']}): wall {r['wall_ms_p50']:.1f} ms, "
              f"host {r['host_ms_p50']:.1f} ms, gpu {r['gpu_ms']:.1f} ms, {r['launches']:.0f} launches, "
              f"{r['toks_per_s']:.0f} tok/s (warm-up {r['warmup_s']:.1f} s)", flush=True)
        for e in r["cpu_top"]:
            print(f"  cpu {e['self_cpu_ms']:8.2f} ms  x{e['count']:6.0f}  {e['op']}")
        for e in r["gpu_top"][:12]:
            print(f"  gpu {e['self_gpu_ms']:8.2f} ms  x{e['count']:6.0f}  {e['op']}")
    print()
    common.print_table(["variant", "seq", "wall ms", "host ms", "gpu ms", "launches", "tok/s"],
                       [[r["variant"], r["seq_len"], r["wall_ms_p50"], r["host_ms_p50"], r["gpu_ms"], r["launches"],
                         r["toks_per_s"]] for r in rows], ["", "", ".1f", ".1f", ".1f", ".0f", ".0f"])
    common.write_result({"rows": rows}, "profile_step", a)


def split_row(overrides: list[str], steps: int, warmup: int) -> dict[str, Any]:
    """One eager step of the model split by category (nsa/telemetry/step_split.py), its wall time, host gaps
    (wall minus busy device time) and, on CUDA, the same step's wall time as a CUDA-graph replay."""
    from nsa.ops import eager_graph
    from nsa.telemetry import step_split as ss
    from nsa.train.graphed import single_device_step
    cfg, dev, prec, model, opt, sched, batch = _build(["runtime.cuda_graph=false"] + overrides)
    cuda = dev.type == "cuda"
    run_step, _ = single_device_step(model, opt, sched, prec, cfg.runtime, grad_clip=cfg.train.grad_clip, device=dev)
    wall = []
    # the op's own per-call graphs off: each kernel is charged by its launch (a replay is one launch for many)
    with ss.labelled(model, opt), eager_graph.paused():
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            run_step([batch])
            common.sync()
            wall.append((time.perf_counter() - t0) * 1e3)
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=acts) as prof:
            run_step([batch])
            common.sync()
    ms, via_bwd = ss.attribute(prof.events(), cuda)
    eager = statistics.median(wall[warmup:])
    row = {"attention": cfg.model.attention, "seq_len": cfg.train.seq_len, "eager_wall_ms": eager,
           "busy_ms": sum(ms.values()), "host_gap_ms": eager - sum(ms.values()) if cuda else float("nan"),
           "ms": ms, "backward_labelled_ms": via_bwd}
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
        row["graphed_wall_ms"] = profile_variant("graph", overrides + ["runtime.cuda_graph=true"], steps, warmup,
                                                 0)["wall_ms_p50"]
    return row


def run_split(a) -> None:
    from nsa.telemetry.step_split import CATS
    rows = []
    for T in a.T:
        for m in a.models.split(","):
            if m not in ("nsa", "dense"):
                raise SystemExit(f"--models: unknown {m!r}; choose from nsa, dense")
            rows.append(r := split_row([f"model.attention={m}", f"train.seq_len={T}"] + a.overrides, a.steps,
                                       a.warmup))
            print(f"{m:5s} T={T:6d} eager {r['eager_wall_ms']:8.1f} ms busy {r['busy_ms']:8.1f}  "
                  + "  ".join(f"{c} {r['ms'][c]:.1f}" for c in CATS)
                  + (f"  graphed {r['graphed_wall_ms']:.1f}" if "graphed_wall_ms" in r else ""), flush=True)
    common.write_result({"rows": rows, "categories": CATS}, "profile_split", a)


# ----------------------------------------------------------------------------------------- ncu drivers
def run_ncu_attention(a) -> None:
    torch.manual_seed(0)
    x = common.nsa_inputs(1, a.T, a.HQ, a.H, a.dk, a.dv)
    do = torch.randn(1, a.T, a.HQ, a.dv, device="cuda", dtype=torch.bfloat16)
    tuning = common.changed_tuning(a.tuning)
    for _ in range(a.calls):
        o, _ = common.nsa_op(x, tuning)
        torch.autograd.grad(o, x, do)
    torch.cuda.synchronize()


def run_ncu_decode(a) -> None:
    from bench_decode import make_cache, step_inputs
    torch.manual_seed(0)
    c = make_cache(a.B, a.S, 64, 4, 128, 128)
    args, pos, win = step_inputs(c, a.S)
    tuning = common.decode_knobs_variant(common.base_tuning(), pdl=False)
    kernels: dict = {}
    for _ in range(a.calls):
        common.decode_op(args, pos, win, tuning, launch_info=kernels)
    torch.cuda.synchronize()
    for name, k in kernels.items():   # the compiled kernels of the last call
        print(name, "regs", getattr(k, "n_regs", None), "spills", getattr(k, "n_spills", None),
              "shared", getattr(getattr(k, "metadata", None), "shared", None))


# ----------------------------------------------------------------------------------------- ncu-source
def load_ncu_report():
    """Nsight Compute's own Python module (its install's extras/python on PYTHONPATH: bench/gpu.sh ncu)."""
    try:
        import ncu_report
    except ImportError:
        raise SystemExit("ncu-source needs Nsight Compute's ncu_report module: put its extras/python folder on "
                         "PYTHONPATH (e.g. /opt/nvidia/nsight-compute/<version>/extras/python)") from None
    return ncu_report


STALL_PREFIX = "smsp__pcsamp_warps_issue_stalled_"


def per_line(action) -> tuple[dict, Counter, int]:
    """(stall reasons' samples per 'file:line', samples per stall reason, total samples) of one kernel."""
    lines: dict = defaultdict(Counter)
    reasons: Counter = Counter()
    total = 0
    names = [n for n in action.metric_names() if n.startswith(STALL_PREFIX) and not n.endswith("_not_issued")]
    for name in names:
        m = action.metric_by_name(name)
        n = m.num_instances()
        if not n:
            continue
        pcs = m.correlation_ids()
        reason = name[len(STALL_PREFIX):]
        for i in range(n):
            v = m.as_uint64(i)
            if not v:
                continue
            pc = pcs.as_uint64(i)
            info = action.source_info(pc)
            key = f"{os.path.basename(info.file_name())}:{info.line()}" if info is not None else f"pc {pc:#x}"
            lines[key][reason] += v
            reasons[reason] += v
            total += v
    return lines, reasons, total


def run_ncu_source(a) -> None:
    ncu_report = load_ncu_report()
    ctx = ncu_report.load_report(a.report)
    for r in range(ctx.num_ranges()):
        rng = ctx.range_by_idx(r)
        for i in range(rng.num_actions()):
            act = rng.action_by_idx(i)
            name = act.name()
            lines, reasons, total = per_line(act)
            dur = act.metric_by_name("gpu__time_duration.sum")
            print(f"== {name} ({dur.as_double() / 1e3 if dur else float('nan'):.1f} us, {total} samples)")
            if not total:
                continue
            print("  stalls: " + ", ".join(f"{k} {v / total:.0%}" for k, v in reasons.most_common(8)))
            ranked = sorted(lines.items(), key=lambda kv: -sum(kv[1].values()))[:a.top]
            for key, rs in ranked:
                v = sum(rs.values())
                why = ", ".join(f"{k} {c / v:.0%}" for k, c in rs.most_common(2))
                print(f"  {v / total:6.1%}  {key:<22} {why}")


# ----------------------------------------------------------------------------------------- accuracy
NAMES = ("o", "dq", "dk_cmp", "dv_cmp", "dk_slc", "dv_slc", "dk_win", "dv_win", "dgates")
INPUTS = ("q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates")


def _acc_run(xs, do, hp, tuning, dtype):
    from nsa.ops.triton.function import nsa_triton_apply
    x = [a.detach().to(dtype).clone().requires_grad_() for a in xs]
    o, bi = nsa_triton_apply(*x, **hp, tuning=tuning)
    return bi, [t.float() for t in (o, *torch.autograd.grad(o, x, do.to(dtype)))]


def run_accuracy(a) -> None:
    from nsa.ops.testing import rel_rms
    from nsa.ops.tuning import tuning_for
    folder = Path(a.dir)
    meta = json.loads((folder / "meta.json").read_text())
    base = tuning_for("cuda")
    sel = base.select
    variants = {"token": dataclasses.replace(sel, loop="token"),
                "block-input": dataclasses.replace(sel, loop="block", pair_dtype="input", dq_pair_dtype="input"),
                "block-fp32": dataclasses.replace(sel, loop="block", pair_dtype="fp32", dq_pair_dtype="fp32"),
                "block-fp32o": dataclasses.replace(sel, loop="block", pair_dtype="fp32", dq_pair_dtype="input"),
                "block-fp16o": dataclasses.replace(sel, loop="block", pair_dtype="fp16", dq_pair_dtype="input"),
                "block-preset": dataclasses.replace(sel, loop="block")}
    for e in (e for e in meta["captures"] if e["T"] in a.T):
        s = torch.load(folder / e["file"], map_location="cuda", weights_only=True)
        xs = [s[n].contiguous() for n in INPUTS]
        hp = {k: e["op"][k] for k in ("l", "d", "l_sel", "n_sel", "w")} | dict(scale=xs[0].shape[-1] ** -0.5)
        do = torch.randn(xs[0].shape[:3] + (xs[6].shape[-1],), device="cuda", dtype=xs[0].dtype,
                         generator=torch.Generator("cuda").manual_seed(1))
        bi32, ref = _acc_run(xs, do, hp, dataclasses.replace(base, select=variants["token"]), torch.float32)
        res = {}
        for label, v in variants.items():
            bi, res[label] = _acc_run(xs, do, hp, dataclasses.replace(base, select=v), torch.bfloat16)
            same = (bi == bi32).all(-1).float().mean().item()   # sync-ok: report
            print(f"T={e['T']} L{e['layer']} {label:12s} vs fp32: bi rows equal {same:.5f} "
                  + " ".join(f"{n} {rel_rms(x, r):.2e}" for n, x, r in zip(NAMES, res[label], ref)), flush=True)
        for label in list(variants)[1:]:
            print(f"T={e['T']} L{e['layer']} {label} vs token: "
                  + " ".join(f"{n} {rel_rms(x, r):.2e}" for n, x, r in zip(NAMES, res[label], res["token"])))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    k = sub.add_parser("kernels", help="per-kernel device time of one NSA forward+backward vs dense")
    k.add_argument("--T", type=int, nargs="+", default=[8192, 65536])
    k.add_argument("--iters", type=int, default=5)
    k.add_argument("--ops", action="store_true", help="also list the aten ops with the most own device time")
    k.add_argument("--tuning", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="changes to the device's KernelTuning, e.g. select.loop=block")
    k.add_argument("--compare", nargs="+", default=None, metavar="F=V,F=V",
                   help="tuning variants side by side (comma-separated changes, '' for the preset): device ms "
                        "per kernel, and registers / spills of what each compiled")
    k.add_argument("--top", type=int, default=12, help="kernels listed with --compare")
    k.add_argument("--fwd", action="store_true", help="time the forward alone (autograd recording, as in training)")
    for name in ("HQ", "H", "dk", "dv"):
        k.add_argument(f"--{name}", type=int, default=common.SHAPE[name])
    k.add_argument("--inputs", default="random",
                   help="random (default; --HQ/--H/--dk/--dv) or captured:DIR (bench/capture_inputs.py's capture "
                        "of --layer at each --T, its shapes and hyperparameters)")
    k.add_argument("--layer", type=int, default=0, help="--inputs captured:DIR: the captured layer")
    common.result_args(k)
    s = sub.add_parser("step", help="host vs GPU time and launches of a training step, per step mode")
    s.add_argument("--variants", default="ckpt,nockpt", help=f"comma list of {sorted(STEP_VARIANTS)}")
    s.add_argument("--steps", type=int, default=10)
    s.add_argument("--warmup", type=int, default=3)
    s.add_argument("--top", type=int, default=20)
    common.result_args(s)
    s.add_argument("overrides", nargs="*", metavar="section.key=value")
    sp = sub.add_parser("split", help="a training step split by category, NSA vs the dense twin, eager and graphed")
    sp.add_argument("--T", type=int, nargs="+", default=[8192, 16384, 65536])
    sp.add_argument("--models", default="nsa,dense", help="comma list of nsa, dense")
    sp.add_argument("--steps", type=int, default=3)
    sp.add_argument("--warmup", type=int, default=2)
    common.result_args(sp)
    sp.add_argument("overrides", nargs="*", metavar="section.key=value")
    na = sub.add_parser("ncu-attention", help="Nsight Compute driver: a few NSA forward+backward calls")
    na.add_argument("--T", type=int, default=65536)
    na.add_argument("--calls", type=int, default=2)
    na.add_argument("--tuning", nargs="*", default=[], metavar="FIELD=VALUE", help="as for kernels")
    for name in ("HQ", "H", "dk", "dv"):   # e.g. the production shape: --HQ 12 --H 2 --dk 64 --dv 64
        na.add_argument(f"--{name}", type=int, default=common.SHAPE[name])
    ns = sub.add_parser("ncu-source", help="stalls per source line of an Nsight Compute report")
    ns.add_argument("report")
    ns.add_argument("--top", type=int, default=14)
    ac = sub.add_parser("accuracy", help="bf16 op vs the fp32 op on captured inputs, per loop order / pair dtype")
    ac.add_argument("--dir", default="bench/captured")
    ac.add_argument("--T", type=int, nargs="+", default=[8192, 65536])
    nd = sub.add_parser("ncu-decode", help="Nsight Compute driver: a few decode steps (device positions)")
    nd.add_argument("--B", type=int, default=16)
    nd.add_argument("--S", type=int, default=65536)
    nd.add_argument("--calls", type=int, default=4)
    a = ap.parse_args()
    common.check_inputs(getattr(a, "inputs", "random"))
    if a.mode not in ("step", "split", "ncu-source") and not common.has_cuda():
        raise SystemExit(f"bench_profile.py {a.mode} needs a CUDA device")
    {"kernels": run_kernels, "step": run_step, "split": run_split, "ncu-attention": run_ncu_attention,
     "ncu-decode": run_ncu_decode, "ncu-source": run_ncu_source,
     "accuracy": run_accuracy}[a.mode](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
