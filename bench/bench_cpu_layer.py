"""CPU benchmark: one NSA attention layer (or the bare op) against dense causal SDPA, forward+backward.

    python bench/bench_cpu_layer.py [--sizes 256,1024,2048,4096,8192] [--what layer,op] [--reps 3]
                                    [--threads N]

Shapes: dim 256, HQ 8, H 2, d_k = d_v = 32; NSA l=32, d=16, l_sel=64, n_sel=16, w=512; B=1, fp32.
"layer" = nsa.NSAAttention(backend="torch") (projections, MLP compression, gates, RoPE) against a
dense layer with the same q/k/v/o projection shapes + F.scaled_dot_product_attention(causal, GQA).
"op" = nsa.ops.nsa_attention(backend="torch") on random inputs against SDPA on the same q/k/v.

Timing: median wall time of `reps` forward+backward passes after one warm-up pass.
Memory: each (impl, T) runs in a fresh subprocess. After the warm-up pass the kernel's resident
high-water mark is reset (/proc/self/clear_refs <- 5) and the RSS taken; peak = VmHWM after the
timed passes minus that RSS: the extra resident memory one forward+backward needs (torch's CPU
allocations are plain malloc/mmap, so RSS sees them; the reset keeps one-time costs such as code
paging out). Where the reset is refused, ru_maxrss is used (hwm_reset=false in the JSON).
peak_first_call_mib (first pass, one-time costs included) is recorded too. Writes
bench/out/cpu_layer_<stamp>.json (--save: also bench/results/cpu_layer.json).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import common

DIM, HQ, H, DK, DV = 256, 8, 2, 32, 32
HP = common.HP
ROOT = common.ROOT


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _reset_peak() -> bool:
    """Reset the kernel's resident high-water mark (VmHWM) of this process (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return _maxrss_mib()


class DenseAttention(torch.nn.Module):
    """Dense GQA layer with the NSA layer's q/k/v/o shapes (one k/v set instead of three)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(DIM, HQ * DK, bias=False)
        self.kv = torch.nn.Linear(DIM, H * (DK + DV), bias=False)
        self.o = torch.nn.Linear(HQ * DV, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, HQ, DK).transpose(1, 2)
        k, v = self.kv(x).view(B, T, H, DK + DV).transpose(1, 2).split([DK, DV], -1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(o.transpose(1, 2).reshape(B, T, HQ * DV))


def _make_step(impl: str, what: str, T: int):
    """A closure running one forward+backward, built outside the measured region."""
    gen = torch.Generator().manual_seed(0)
    if what == "layer":
        if impl == "nsa":
            from nsa import NSAAttention
            mod = NSAAttention(DIM, HQ, H, DK, DV, **HP, backend="torch")
        else:
            mod = DenseAttention()
        x = torch.randn(1, T, DIM, generator=gen, requires_grad=True)

        def step() -> None:
            mod(x).square().mean().backward()
        return step
    from nsa.ops import nsa_attention
    from nsa.ops.testing import make_inputs
    xs = make_inputs(1, T, HQ, H, DK, DV, l=HP["l"], d=HP["d"], requires_grad=True)
    if impl == "nsa":
        def step() -> None:
            o, _ = nsa_attention(*xs, **HP, backend="torch")
            o.square().mean().backward()
    else:
        q, k, v = (x.transpose(1, 2) for x in (xs[0], xs[3], xs[4]))

        def step() -> None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            o.square().mean().backward()
    return step


def run_one(impl: str, what: str, T: int, reps: int) -> dict:
    """Measure in this process (called in a fresh subprocess per configuration)."""
    step = _make_step(impl, what, T)
    rss_setup = _rss_mib()
    t0 = time.perf_counter()
    step()  # warm-up: pages in code, one-time buffers
    warm = time.perf_counter() - t0
    peak_cold = _maxrss_mib() - rss_setup
    gc.collect()
    reset = _reset_peak()
    rss0 = _rss_mib()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = (_hwm_mib() if reset else _maxrss_mib()) - rss0
    return dict(impl=impl, what=what, T=T, reps=reps, warmup_s=warm, median_s=statistics.median(times),
                min_s=min(times), peak_extra_mib=peak, peak_first_call_mib=peak_cold,
                hwm_reset=reset, threads=torch.get_num_threads())


def _spawn(impl: str, what: str, T: int, reps: int, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, __file__, "--child", f"{impl}:{what}:{T}:{reps}:{threads}"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        return dict(impl=impl, what=what, T=T, error=out.stderr.strip().splitlines()[-1:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256,1024,2048,4096,8192")
    ap.add_argument("--what", default="layer,op", help="comma list of layer, op")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads in each measurement (0: torch's default)")
    ap.add_argument("--host-cost", choices=("sm90", "cpu"), default=None,
                    help="instead: the op's host work per eager fwd+bwd at --sizes, kernels as counted no-ops, "
                         "planned as an H200 (sm90) or this CPU (nsa/ops/host_cost.py)")
    common.result_args(ap)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.host_cost:
        common.write_result(common.host_cost_rows([int(s) for s in args.sizes.split(",")], args.host_cost),
                            "host_cost", args)
        return
    if args.child:
        impl, what, T, reps, threads = args.child.split(":")
        if int(threads) > 0:
            torch.set_num_threads(int(threads))
        print(json.dumps(run_one(impl, what, int(T), int(reps))))
        return
    rows = []
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus; median (min) seconds")
    print(f"{'what':6} {'T':>6} {'nsa s':>15} {'dense s':>15} {'ratio':>6} {'nsa MiB':>9} "
          f"{'dense MiB':>9}")
    for what in args.what.split(","):
        for T in (int(s) for s in args.sizes.split(",")):
            reps = args.reps if T <= 4096 else max(1, args.reps - 1)
            nsa = _spawn("nsa", what, T, reps, args.threads)
            dense = _spawn("dense", what, T, reps, args.threads)
            rows += [nsa, dense]
            if "error" in nsa or "error" in dense:
                print(what, T, "ERROR", nsa.get("error"), dense.get("error"))
                continue
            ns = f"{nsa['median_s']:.3f} ({nsa['min_s']:.3f})"
            ds = f"{dense['median_s']:.3f} ({dense['min_s']:.3f})"
            print(f"{what:6} {T:>6} {ns:>15} {ds:>15} "
                  f"{nsa['median_s'] / dense['median_s']:>6.2f} {nsa['peak_extra_mib']:>9.1f} "
                  f"{dense['peak_extra_mib']:>9.1f}", flush=True)
    meta = dict(python=platform.python_version(), cpus=os.cpu_count(),
                load_avg=os.getloadavg(), threads=args.threads or torch.get_num_threads(),
                shapes=dict(dim=DIM, HQ=HQ, H=H, d_k=DK, d_v=DV, B=1, **HP),
                memory="VmHWM after the timed passes minus RSS after warm-up (high-water reset via "
                       "/proc/self/clear_refs), fresh subprocess per row",
                timing="median (and min) of reps fwd+bwd after one warm-up")
    common.write_result(dict(meta=meta, rows=rows), "cpu_layer", args)


if __name__ == "__main__":
    main()
