#!/usr/bin/env python
"""Where a training step goes: the prod_50k model's step split by what it computes, NSA against its dense twin.

    python bench/bench_step_split.py --T 8192 16384 65536 [--models nsa,dense] [section.key=value ...]

Per model and length, one eager step (the same kernels as the graphed one) under torch.profiler, each
kernel's device time (CPU time without CUDA) charged to one category:
  op          the attention kernel itself (nsa_attention / the dense flash call), forward and backward
  attn_rest   the rest of the attention layer: projections, RoPE, compression, gates, copies, o_proj
  mlp         SwiGLU;  norms  RMSNorms;  embed_head  embedding and lm_head
  optimizer   optimizer.step (and what it launches);  other  loss, clipping, scaler, what no label covers
Forward work is labelled by record_function ranges pushed from module hooks (a recompute under gradient
checkpointing runs the hooks again, so it is charged where it belongs); backward work by the autograd node's
sequence number, which names the forward op (and so the label) that recorded it. Also printed: the eager
step's wall time, host gaps (wall minus busy device time) and, where runtime.cuda_graph applies, the graphed
step's wall time. JSON: step_split.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

CATS = ("op", "attn_rest", "mlp", "norms", "embed_head", "optimizer", "other")
PREFIX = "split:"


def _label_modules(model: torch.nn.Module) -> list:
    """Forward pre/post hooks that open and close a record_function range per labelled module call."""
    from nsa.layers.attention import NSAAttention
    from nsa.layers.dense import DenseAttention
    from nsa.model.block import RMSNorm, SwiGLU
    kinds = ((NSAAttention, "attn_rest"), (DenseAttention, "attn_rest"), (SwiGLU, "mlp"), (RMSNorm, "norms"),
             (torch.nn.Embedding, "embed_head"))
    handles, head = [], getattr(model, "lm_head", None)
    for mod in model.modules():
        cat = next((c for k, c in kinds if isinstance(mod, k)), "embed_head" if mod is head else None)
        if cat is None:
            continue
        stack: list = []

        def pre(m, args, cat=cat, stack=stack):
            rf = torch.autograd.profiler.record_function(PREFIX + cat)
            rf.__enter__()
            stack.append(rf)

        def post(m, args, out, stack=stack):
            stack.pop().__exit__(None, None, None)

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    return handles


@contextlib.contextmanager
def _label_op():
    """The attention kernel call of either model inside a 'split:op' range."""
    import nsa.layers.attention as na
    import nsa.layers.dense as nd

    def wrap(fn):
        def inner(*a, **k):
            with torch.autograd.profiler.record_function(PREFIX + "op"):
                return fn(*a, **k)
        return inner
    saved = (na._attend, nd.dense_attention)
    na._attend, nd.dense_attention = wrap(saved[0]), wrap(saved[1])
    try:
        yield
    finally:
        na._attend, nd.dense_attention = saved


def _own_label(e) -> str | None:
    return e.name[len(PREFIX):] if e.name.startswith(PREFIX) else None


def attribute(events, cuda: bool) -> tuple[dict[str, float], float]:
    """events: torch.profiler's FunctionEvents -> (ms per category (device self time, or CPU self time),
    ms of it charged through backward autograd nodes)."""
    def label_of(e):
        while e is not None:
            if (lab := _own_label(e)) is not None:
                return lab, e
            e = e.cpu_parent
        return None, None

    # forward ops that record autograd nodes: (thread, sequence_nr) -> label
    fwd: dict[tuple[int, int], str] = {}
    for e in events:
        if getattr(e, "sequence_nr", -1) >= 0 and not e.name.startswith("autograd::"):
            lab, _ = label_of(e)
            if lab is not None:
                fwd.setdefault((e.fwd_thread if getattr(e, "fwd_thread", 0) else e.thread, e.sequence_nr), lab)
    out, via_bwd = dict.fromkeys(CATS, 0.0), 0.0
    for e in events:
        t = (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e3
        if t <= 0 or (cuda and e.device_type != torch.autograd.DeviceType.CPU):
            continue
        lab, _ = label_of(e)
        if lab is None:   # backward: the nearest autograd node names its forward op
            a = e
            while a is not None and lab is None:
                if getattr(a, "sequence_nr", -1) >= 0 and a.name.startswith("autograd::engine::evaluate_function"):
                    lab = fwd.get((a.fwd_thread, a.sequence_nr))
                a = a.cpu_parent
            via_bwd += t if lab in out else 0.0
        out[lab if lab in out else "other"] += t
    return out, via_bwd


def split_step(overrides: list[str], steps: int, warmup: int) -> dict[str, Any]:
    from bench_profile import _build
    from nsa.train.graphed import single_device_step
    cfg, dev, prec, model, opt, sched, batch = _build(["runtime.cuda_graph=false"] + overrides)
    cuda = dev.type == "cuda"
    run_step, _ = single_device_step(model, opt, sched, prec, cfg.runtime, grad_clip=cfg.train.grad_clip, device=dev)
    real_opt_step = opt.step

    def opt_step(*a, **k):
        with torch.autograd.profiler.record_function(PREFIX + "optimizer"):
            return real_opt_step(*a, **k)
    opt.step = opt_step
    handles = _label_modules(model)
    wall = []
    with _label_op():
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            run_step([batch])
            common.sync()
            if i >= warmup:
                wall.append((time.perf_counter() - t0) * 1e3)
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=acts) as prof:
            run_step([batch])
            common.sync()
    for h in handles:
        h.remove()
    opt.step = real_opt_step
    ms, via_bwd = attribute(prof.events(), cuda)
    busy = sum(ms.values())
    row = {"attention": cfg.model.attention, "seq_len": cfg.train.seq_len, "eager_wall_ms": statistics.median(wall),
           "busy_ms": busy, "host_gap_ms": statistics.median(wall) - busy if cuda else float("nan"),
           "ms": ms, "backward_labelled_ms": via_bwd, "device": common.device_name()}
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
        row["graphed_wall_ms"] = graphed_wall(overrides, steps, warmup)
    return row


def graphed_wall(overrides: list[str], steps: int, warmup: int) -> float:
    """The same step as a CUDA-graph replay (runtime.cuda_graph=true), median wall ms."""
    from bench_profile import _build
    from nsa.train.graphed import single_device_step
    cfg, dev, prec, model, opt, sched, batch = _build(["runtime.cuda_graph=true"] + overrides)
    run_step, _ = single_device_step(model, opt, sched, prec, cfg.runtime, grad_clip=cfg.train.grad_clip, device=dev)
    for _ in range(warmup + cfg.runtime.cuda_graph_warmup + 1):
        run_step([batch])
    common.sync()
    wall = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run_step([batch])
        common.sync()
        wall.append((time.perf_counter() - t0) * 1e3)
    del model, opt
    torch.cuda.empty_cache()
    return statistics.median(wall)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--T", type=int, nargs="+", default=[8192, 16384, 65536])
    p.add_argument("--models", default="nsa,dense", help="comma list of nsa, dense")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="bench/out", help="folder for the stamped JSON")
    p.add_argument("--save", action="store_true", help="also write bench/results/step_split.json")
    p.add_argument("--copy-to", default=None, help="also copy the JSON there as step_split.json")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    a = p.parse_args()
    rows = []
    for T in a.T:
        for m in a.models.split(","):
            if m not in ("nsa", "dense"):
                raise SystemExit(f"--models: unknown {m!r}; choose from nsa, dense")
            rows.append(r := split_step([f"model.attention={m}", f"train.seq_len={T}"] + a.overrides,
                                        a.steps, a.warmup))
            print(f"{m:5s} T={T:6d} eager {r['eager_wall_ms']:8.1f} ms  busy {r['busy_ms']:8.1f}  "
                  + "  ".join(f"{c} {r['ms'][c]:.1f}" for c in CATS)
                  + (f"  graphed {r['graphed_wall_ms']:.1f}" if "graphed_wall_ms" in r else ""), flush=True)
    common.write_result({"rows": rows, "categories": CATS}, "step_split", a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
