#!/usr/bin/env python
"""Training throughput: a bare PyTorch loop vs the Ray Train loop, same model, same data.

    python bench/bench_train.py                         # prod_50k profile (GPU), 30 measured steps
    python bench/bench_train.py --tiny                  # tiny CPU profile, a crash test in seconds
    python bench/bench_train.py --steps 50 runtime.num_workers=1 train.seq_len=4096

bare: one device, nsa.train.step.train_step over nsa.data's plain parquet iterator; the bench syncs the
      device after every step (bench-only) so step times are exact.
ray:  nsa/launch/builder.launch (Ray Data + TorchTrainer + DDP + full telemetry); times come from the
      heartbeats (host wall clock between step boundaries; in steady state the GPU paces the host).
Both: tokens/s (total and per device), step and fetch p50/p95, fetch as a share of step time, and MFU
from an analytic FLOP count of the model (matmuls of every linear layer per token, the compression MLPs
per block, and the attention FLOPs NSA actually computes: compressed keys visible to each query,
n_sel*l_sel selected keys, w window keys; backward = 2x forward; the gradient-checkpointing recompute
is not counted, as usual for MFU). Prints a table; writes bench/out/train_<stamp>.json (--save: also
bench/results/train.json; $OUT or --copy-to: <dir>/train.json).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import common
from common import ROOT
from nsa.config import RunConfig, resolve_config

# dense peak TFLOPS by device-name substring and autocast dtype (bf16/fp16 tensor cores; fp32 = TF32)
PEAK_TFLOPS = {"H200": {"bf16": 989, "fp16": 989, "fp32": 494}, "H100": {"bf16": 989, "fp16": 989, "fp32": 494},
               "A100": {"bf16": 312, "fp16": 312, "fp32": 156}, "L40S": {"bf16": 362, "fp16": 362, "fp32": 183},
               "4090": {"bf16": 165, "fp16": 165, "fp32": 83}, "3090": {"bf16": 71, "fp16": 71, "fp32": 36}}
TINY = ["train.seq_len=64", "train.batch_size=8", "model.n_layers=1", "logging.mlflow=false",
        "logging.tensorboard=false", "train.eval_every=0", "train.save_every=0", "logging.stats_every=0",
        "runtime.num_workers=1"]


# ------------------------------------------------------------------------------------------ FLOPs
def _num_cmp(t: int, l: int, d: int) -> int:
    return (t - l) // d + 1 if t >= l else 0


def attention_flops_per_seq(cfg: RunConfig) -> float:
    """Forward attention FLOPs of one layer over one sequence of T tokens (QK^T and PV, all heads)."""
    T, m, n = cfg.train.seq_len, cfg.model, cfg.nsa
    per_key = 2 * (m.d_k + m.d_v)
    keys = 0
    for t in range(T):                                     # host-side formula, not a hot path
        keys += _num_cmp(t + 1, n.l, n.d) + min(n.n_sel * n.l_sel, t + 1) + min(n.w, t + 1)
    return float(per_key * keys * m.n_heads)


def model_flops_per_token(cfg: RunConfig, model: torch.nn.Module) -> dict[str, float]:
    """Training FLOPs per token (forward x3) split into dense matmuls, compression and attention."""
    T = cfg.train.seq_len
    dense = cmp = 0.0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            if ".phi_" in name:        # compression MLP: once per block per KV head, not per token
                cmp += 2 * mod.weight.numel() * _num_cmp(T, cfg.nsa.l, cfg.nsa.d) * cfg.model.n_kv_groups / T
            else:
                dense += 2 * mod.weight.numel()
    attn = attention_flops_per_seq(cfg) * cfg.model.n_layers / T
    fwd = dense + cmp + attn
    return {"dense_fwd": dense, "compress_fwd": cmp, "attention_fwd": attn, "train_per_token": 3 * fwd}


def counted_flops_per_token(cfg: RunConfig, model: torch.nn.Module, device: torch.device) -> float:
    """Cross-check: torch's FlopCounterMode over one forward+backward (sees aten ops only: exact for the
    torch backend, an undercount where Triton kernels run)."""
    from torch.utils.flop_counter import FlopCounterMode
    x = torch.randint(0, cfg.model.vocab, (1, cfg.train.seq_len + 1), device=device)
    with FlopCounterMode(display=False) as fc:
        logits = model(x[:, :-1])
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()).backward()
    model.zero_grad(set_to_none=True)
    return fc.get_total_flops() / cfg.train.seq_len


def peak_flops(device: torch.device, precision: str) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, table in PEAK_TFLOPS.items():
        if key in name:
            return table[precision] * 1e12
    return None


# ------------------------------------------------------------------------------------------ bare loop
def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def run_bare(cfg: RunConfig, steps: int, warmup: int) -> dict[str, Any]:
    from nsa.data.ray_data import iter_packed_batches
    from nsa.data.shards import check_data_path
    from nsa.model import TinyLM
    from nsa.train import build_optimizer, build_scheduler, precision_from_config
    dev = torch.device("cuda" if cfg.runtime.use_gpu and torch.cuda.is_available() else "cpu")
    torch.manual_seed(cfg.runtime.seed)
    prec = precision_from_config(cfg.runtime, dev)
    model = TinyLM.from_config(cfg.model, cfg.nsa).to(dev)
    opt = build_optimizer(model, cfg.train)
    sched = build_scheduler(opt, cfg.train)
    it = iter_packed_batches(check_data_path(cfg.data.path), cfg.train.seq_len, cfg.data.tokenizer,
                             cfg.train.batch_size, repeat=True, tiktoken_path=cfg.data.tiktoken_path)
    from nsa.train.graphed import single_device_step   # the pipeline's step-mode rule, on one device
    step, mode = single_device_step(model, opt, sched, prec, cfg.runtime, grad_clip=cfg.train.grad_clip, device=dev)
    step_ms, fetch_ms, losses, tokens = [], [], [], 0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        micro = [torch.from_numpy(next(it)).to(dev, non_blocking=True) for _ in range(cfg.train.accumulate)]
        t1 = time.perf_counter()
        res = step(micro)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # sync-ok: benchmark timing only
        t2 = time.perf_counter()
        if i >= warmup:
            step_ms.append((t2 - t0) * 1e3)
            fetch_ms.append((t1 - t0) * 1e3)
            losses.append(float(res.loss))  # the bench syncs every step anyway
            tokens = res.tokens
    p50 = statistics.median(step_ms)
    return {"mode": "bare", "step_mode": mode, "devices": 1, "device": str(dev), "tokens_per_step": tokens,
            "step_ms_p50": p50, "step_ms_p95": _pct(step_ms, 95), "fetch_ms_p50": statistics.median(fetch_ms),
            "fetch_ms_p95": _pct(fetch_ms, 95), "toks_per_s": tokens / (p50 / 1e3), "final_loss": float(res.loss),
            "mean_loss": statistics.fmean(losses), "losses": losses,
            "peak_mem_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None,
            "model": model}


# ------------------------------------------------------------------------------------------ NSA vs dense
def _preset_changed(items: tuple[str, ...]):
    """A context in which the kernel policy of a model built inside takes the device preset changed by
    FIELD=VALUE items (what --nsa-tuning compares; the library reads no such override)."""
    import contextlib
    from unittest import mock
    from nsa.ops import dispatch
    if not items:
        return contextlib.nullcontext()
    preset = dispatch.tuning_for
    return mock.patch.object(dispatch, "tuning_for", lambda dev: common.changed_tuning(list(items), preset(dev)))


def run_vs_dense(cfg: RunConfig, seqs: list[int], steps: int, warmup: int,
                 flash: tuple[str, ...] = ("preset",), tuning: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The bare loop per sequence length, model.attention=nsa (once per nsa.flash_branches value in
    `flash`, and once more with the kernel preset changed by `tuning` FIELD=VALUE items) then dense
    (same seed, same data from the start of the corpus, same steps): one row per (seq, kind) with
    tokens/s, step time, peak memory, loss; kind "nsa", "nsa[<flash_branches>]" or "nsa[<tuning>]"."""
    import dataclasses
    rows = []
    runs = [(f"nsa[{f}]" if f != "preset" else "nsa", "nsa", f, ()) for f in flash]
    if tuning:
        runs.append((f"nsa[{' '.join(tuning)}]", "nsa", "preset", tuning))
    runs.append(("dense", "dense", "preset", ()))
    for seq in seqs:
        for kind, attention, fb, items in runs:
            c = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=seq),
                                    model=dataclasses.replace(cfg.model, attention=attention),
                                    nsa=dataclasses.replace(cfg.nsa, flash_branches=fb))
            try:
                with _preset_changed(items):
                    r = run_bare(c, steps, warmup)
                r.pop("model")
            except torch.cuda.OutOfMemoryError as exc:   # report the row, keep the other lengths
                r = {"error": f"out of memory: {str(exc).splitlines()[0][:120]}"}
            r.update(seq=seq, attention=kind)
            rows.append(r)
            print(f"  seq {seq:>6} {kind:<5} " + (r.get("error") or f"{r['toks_per_s']:>9.0f} tok/s  "
                  f"{r['step_ms_p50']:>8.1f} ms  {r['step_mode']}"), flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


def _vs_dense_table(rows: list[dict[str, Any]]) -> str:
    by = {(r["seq"], r["attention"]): r for r in rows}
    kinds = list(dict.fromkeys(r["attention"] for r in rows if r["attention"] != "dense"))
    lines = ["  seq  NSA variant     NSA tok/s  dense tok/s  NSA/dense   step ms NSA/dense    peak GiB NSA/dense   "
             "mean loss NSA/dense  step mode NSA/dense", "-" * 134]
    for seq, kind in ((s, k) for s in sorted({r["seq"] for r in rows}) for k in kinds):
        n, d = by.get((seq, kind), {}), by.get((seq, "dense"), {})
        if "toks_per_s" not in n or "toks_per_s" not in d:
            lines.append(f"{seq:>6}  {kind:<14} {n.get('error', '')} {d.get('error', '')}")
            continue
        mem = (f"{n['peak_mem_gib']:.1f}/{d['peak_mem_gib']:.1f}" if n.get("peak_mem_gib") is not None else "n/a")
        lines.append(f"{seq:>6}  {kind:<14}{n['toks_per_s']:>11.0f} {d['toks_per_s']:>12.0f} {n['toks_per_s'] / d['toks_per_s']:>9.2f}x"
                     f"   {n['step_ms_p50']:>8.1f}/{d['step_ms_p50']:<8.1f}   {mem:>14}      "
                     f"{n['mean_loss']:.3f}/{d['mean_loss']:.3f}       {n['step_mode']}/{d['step_mode']}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ ray loop
def _builder():
    """The pipelines' trainer builder (nsa/launch/builder.py)."""
    from nsa.launch import builder
    return builder


def run_ray(cfg: RunConfig, sources: dict[str, str], steps: int, warmup: int, out_dir: Path) -> dict[str, Any]:
    from nsa.config import config_from_dict
    builder = _builder()
    d = cfg.to_dict()
    d["train"].update(steps=warmup + steps)
    root = cfg.logging.root if sources.get("logging.root") == "cli" else str(out_dir / "runs")
    d["logging"].update(root=root, name=f"bench-{time.strftime('%Y%m%d-%H%M%S')}")
    rcfg = config_from_dict(d)
    out = builder.launch(rcfg, sources, prefix="bench", quiet=True)
    if out.exit_code != 0:
        raise SystemExit(f"ray run failed: {out.summary.get('status')} {out.summary.get('reason', '')}")
    return {**ray_row(out.run_dir, cfg, warmup), "wall_s": out.wall_s}


def ray_row(run_dir: Path, cfg: RunConfig, warmup: int) -> dict[str, Any]:
    """Throughput of a finished pipeline run from its rank-0 heartbeats (step_end records after warm-up;
    a resumed or restarted run contributes every session's steps) and metrics.json."""
    from nsa.telemetry import read_heartbeat
    summary = json.loads((Path(run_dir) / "metrics.json").read_text())
    ends = [r for r in read_heartbeat(Path(run_dir) / "heartbeat_rank0.jsonl")
            if r["kind"] == "step_end" and r["step"] > warmup and "step_ms" in r]
    if not ends:
        raise ValueError(f"{run_dir}: no step_end heartbeats after step {warmup}")
    step_ms = [r["step_ms"] for r in ends]
    fetch_ms = [r["fetch_ms"] for r in ends]
    world = int(summary.get("world_size", 1))
    tokens = cfg.train.batch_size * cfg.train.seq_len * cfg.train.accumulate * world
    p50, p95 = statistics.median(step_ms), _pct(step_ms, 95)
    if "gpu_step_ms" in ends[-1] and isinstance(summary.get("step_ms_p50"), float):
        # CUDA: the host runs ahead of the device, so host times per step mean little; the loop's rolling
        # percentiles hold every steady step's device-measured period (warm-up/capture/eval excluded)
        p50, p95 = summary["step_ms_p50"], summary["step_ms_p95"]
    return {"mode": "ray", "devices": world, "device": summary.get("device"), "tokens_per_step": tokens,
            "step_ms_p50": p50, "step_ms_p95": p95, "fetch_ms_p50": statistics.median(fetch_ms),
            "fetch_ms_p95": _pct(fetch_ms, 95), "toks_per_s": tokens / (p50 / 1e3),
            "final_loss": summary.get("final_loss"), "run_dir": str(run_dir), "step_mode": summary.get("step_mode")}


# ------------------------------------------------------------------------------------------ report
def _table(rows: list[dict[str, Any]]) -> str:
    head = f"{'mode':<5} {'dev':>3} {'tok/s':>10} {'tok/s/dev':>10} {'step p50/p95 ms':>17} " \
           f"{'fetch p50/p95 ms':>17} {'fetch%':>7} {'MFU':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
        lines.append(f"{r['mode']:<5} {r['devices']:>3} {r['toks_per_s']:>10.0f} {r['toks_per_s'] / r['devices']:>10.0f} "
                     f"{r['step_ms_p50']:>8.1f}/{r['step_ms_p95']:<8.1f} {r['fetch_ms_p50']:>8.2f}/{r['fetch_ms_p95']:<8.2f} "
                     f"{100 * r['fetch_ms_p50'] / r['step_ms_p50']:>6.1f}% {mfu:>7}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="profile (default prod_50k, or tiny_cpu with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="tiny CPU profile, few steps (crash test)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps (default 30, --tiny 4)")
    ap.add_argument("--warmup", type=int, default=None, help="unmeasured steps first (default 5, --tiny 2)")
    ap.add_argument("--skip-bare", action="store_true")
    ap.add_argument("--skip-ray", action="store_true")
    ap.add_argument("--vs-dense", type=int, nargs="+", metavar="SEQ", default=None,
                    help="bare loop only: NSA vs the dense twin (model.attention=dense) at these sequence lengths, "
                         "same data and steps; a table of tokens/s, step time, peak memory and loss with NSA/dense")
    ap.add_argument("--nsa-flash", nargs="+", default=["preset"], metavar="BRANCHES",
                    choices=["preset", "off", "win", "cmp", "win+cmp"],
                    help="--vs-dense: one NSA run per nsa.flash_branches value (branches on flash-attn)")
    ap.add_argument("--nsa-tuning", nargs="+", default=[], metavar="FIELD=VALUE",
                    help="--vs-dense: one more NSA run with the device's kernel preset changed, e.g. tile.m=1 "
                         "(values as bench_profile.py kernels --tuning)")
    common.result_args(ap)
    ap.add_argument("overrides", nargs="*", metavar="section.key=value")
    a = ap.parse_args()
    profile = a.config or str(ROOT / "pipelines" / "configs" / ("tiny_cpu.yaml" if a.tiny else "prod_50k.yaml"))
    cfg, sources = resolve_config(profile, (TINY if a.tiny else []) + list(a.overrides))
    steps, warmup = a.steps or (4 if a.tiny else 30), a.warmup if a.warmup is not None else (2 if a.tiny else 5)
    _builder().validate_inputs(cfg)                    # absolute paths, data present (auto-prepare default)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if a.vs_dense:
        rows = run_vs_dense(cfg, a.vs_dense, steps, warmup, tuple(a.nsa_flash), tuple(a.nsa_tuning))
        print(_vs_dense_table(rows))
        common.write_result({"profile": os.path.relpath(profile, ROOT), "overrides": a.overrides, "steps": steps,
                             "warmup": warmup, "config": cfg.to_dict(), "rows": rows}, "train_vs_dense", a)
        return 0
    rows: list[dict[str, Any]] = []
    model = None
    if not a.skip_bare:
        r = run_bare(cfg, steps, warmup)
        model = r.pop("model")
        rows.append(r)
    if not a.skip_ray:
        rows.append(run_ray(cfg, sources, steps, warmup, out_dir))
    if model is None:
        from nsa.model import TinyLM
        model = TinyLM.from_config(cfg.model, cfg.nsa)
    flops = model_flops_per_token(cfg, model)
    dev = torch.device("cuda" if cfg.runtime.use_gpu and torch.cuda.is_available() else "cpu")
    peak = peak_flops(dev, cfg.runtime.precision)
    for r in rows:
        r["mfu"] = flops["train_per_token"] * r["toks_per_s"] / r["devices"] / peak if peak else None
    if a.tiny:   # cross-check the analytic count against torch's counter (torch backend on CPU)
        counted = counted_flops_per_token(cfg, model.cpu(), torch.device("cpu"))
        flops["counted_train_per_token_torch_backend"] = counted
    report = {"profile": os.path.relpath(profile, ROOT), "overrides": a.overrides,
              "steps": steps, "warmup": warmup, "flops_per_token": flops, "peak_flops": peak,
              "config": cfg.to_dict(), "rows": rows}
    print(_table(rows))
    print(f"model FLOPs/token (train): {flops['train_per_token'] / 1e6:.2f} M "
          f"(dense {flops['dense_fwd'] / 1e6:.2f} M, compress {flops['compress_fwd'] / 1e6:.3f} M, "
          f"attention {flops['attention_fwd'] / 1e6:.2f} M per forward)"
          + (f"; torch counter {flops['counted_train_per_token_torch_backend'] / 1e6:.2f} M"
             if "counted_train_per_token_torch_backend" in flops else ""))
    common.write_result(report, "train", a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
