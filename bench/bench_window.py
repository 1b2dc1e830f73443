"""Benchmark: the sliding-window branch on our Triton kernel vs compiled FlexAttention (block mask).

The kernel policy runs the window branch on nsa/ops/triton/attn.py; this script measures the
alternative the issue names (FlexAttention compiled with a sliding-window block mask; flash-attn is
not installable on the GPU machines here) on the same inputs: B=1, HQ=64, H=4, d=128, bf16, w=512,
causal window (key j visible to query t iff t - w < j <= t), GQA.

    python bench/bench_window.py [--T 8192 16384 32768 65536] [--w 512]

ours fwd = attn_fwd; ours fwd+bwd = attn_fwd + attn_bwd (gate 1) with delta = rowsum(dO * o)
computed once outside the timing: in the NSA op that row sum is the window gate's gradient, which the
op computes anyway (flex computes it inside its backward, so its time includes it). flex runs on
[B, H, T, d] contiguous copies (the layout it is fastest on; the transposes our [B, T, H, d] layout
would need are not timed, which favours flex). Checks flex's output against ours (relative RMS) so
both compute the same mask. Prints a table and writes bench/out/window_<date>.json (and a copy under
$OUT).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_attention import cuda_time, save_json  # noqa: E402
from nsa.ops.triton import attn  # noqa: E402


def ours(q, k, v, do, w, sc):
    ones = torch.ones(q.shape[:-1], device=q.device, dtype=q.dtype)

    def fwd():
        return attn.attn_fwd(q, k, v, stride=1, offset=0, window=w, scale=sc)

    o0 = fwd()[0]
    delta = (do.float() * o0.float()).sum(-1)

    def fwd_bwd():
        o, lse = fwd()
        return attn.attn_bwd(q, k, v, do, lse, delta, ones, stride=1, offset=0, window=w, scale=sc)

    return fwd, fwd_bwd


def flex(q, k, v, do, w, sc):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def sliding(b, h, qi, ki):
        return (ki <= qi) & (qi - ki < w)

    T = q.shape[1]
    bm = create_block_mask(sliding, None, None, T, T, device=q.device)
    fa = torch.compile(flex_attention, dynamic=False)
    qt, kt, vt, dot = (x.transpose(1, 2).contiguous() for x in (q, k, v, do))
    qg, kg, vg = (x.detach().requires_grad_() for x in (qt, kt, vt))

    def fwd():
        with torch.no_grad():
            return fa(qt, kt, vt, block_mask=bm, scale=sc, enable_gqa=True)

    def fwd_bwd():
        o = fa(qg, kg, vg, block_mask=bm, scale=sc, enable_gqa=True)
        return torch.autograd.grad(o, (qg, kg, vg), dot)

    return fwd, fwd_bwd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    ap.add_argument("--w", type=int, default=512)
    ap.add_argument("--HQ", type=int, default=64)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    dev = torch.cuda.get_device_name()
    res = {"device": dev, "torch": torch.__version__, "w": a.w, "rows": []}
    print(f"{dev}  torch {torch.__version__}  w={a.w}  HQ={a.HQ} H={a.H} d={a.d} bf16 (ms; x = flex / ours)")
    print(f"{'T':>7} {'ours fwd':>9} {'flex fwd':>9} {'x':>6} {'ours f+b':>9} {'flex f+b':>9} {'x':>6}  flex rel err")
    for T in a.T:
        torch.manual_seed(T)
        r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
        q, k, v, do = r(1, T, a.HQ, a.d), r(1, T, a.H, a.d), r(1, T, a.H, a.d), r(1, T, a.HQ, a.d)
        sc = a.d ** -0.5
        row = {"T": T}
        of, ofb = ours(q, k, v, do, a.w, sc)
        row["ours_fwd_ms"] = cuda_time(of, a.warmup, a.iters)
        row["ours_fwd_bwd_ms"] = cuda_time(ofb, a.warmup, a.iters)
        try:
            ff, ffb = flex(q, k, v, do, a.w, sc)
            o_f = ff().transpose(1, 2).float()
            o_o = of()[0].float()
            row["flex_rel_err"] = ((o_f - o_o).norm() / o_o.norm()).item()
            row["flex_fwd_ms"] = cuda_time(ff, a.warmup, a.iters)
            row["flex_fwd_bwd_ms"] = cuda_time(ffb, a.warmup, a.iters)
        except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON
            row["flex_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        res["rows"].append(row)
        if "flex_error" in row:
            print(f"{T:>7} {row['ours_fwd_ms']:9.3f} {'-':>9} {'-':>6} {row['ours_fwd_bwd_ms']:9.3f}  flex: "
                  f"{row['flex_error']}")
        else:
            print(f"{T:>7} {row['ours_fwd_ms']:9.3f} {row['flex_fwd_ms']:9.3f} "
                  f"{row['flex_fwd_ms'] / row['ours_fwd_ms']:6.2f} {row['ours_fwd_bwd_ms']:9.3f} "
                  f"{row['flex_fwd_bwd_ms']:9.3f} {row['flex_fwd_bwd_ms'] / row['ours_fwd_bwd_ms']:6.2f}  "
                  f"{row['flex_rel_err']:.2e}", flush=True)
    save_json(res, "window", copy_to=os.environ.get("OUT"))


if __name__ == "__main__":
    main()
