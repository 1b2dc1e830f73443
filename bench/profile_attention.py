"""Per-kernel device time of one NSA forward+backward (Triton backend) under torch.profiler.

    python bench/profile_attention.py --T 8192 65536 [--iters 5] [--ops]

Paper sizes as bench_attention.py (B=1, HQ=64, H=4, d=128, bf16). Prints, per T, every kernel's
average device microseconds per call, calls per step and share of the step, and the dense SDPA
forward+backward of the same shapes for scale; writes bench/out/profile_attention_<date>.json (and a
copy under --copy-to).
"""
from __future__ import annotations

import datetime as dt
import os
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_attention import HP, nsa_inputs, save_json, t_args  # noqa: E402
from nsa.ops.triton import nsa_attention_triton  # noqa: E402


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
        dur = getattr(evt, "device_time", None) or getattr(evt, "cuda_time", 0.0)
        tot[evt.name] += dur
        cnt[evt.name] += 1
    total = sum(tot.values())
    rows = [dict(kernel=k[:90], us_per_call=round(tot[k] / cnt[k], 1), calls_per_iter=cnt[k] / iters,
                 ms_per_iter=round(tot[k] / iters / 1e3, 3), share=round(tot[k] / total, 4))
            for k in sorted(tot, key=lambda k: -tot[k])]
    return rows, total / iters / 1e3


def op_table(fn, iters: int, top: int = 25) -> list[dict]:
    """The aten ops with the most device time of their own (kernels they launched), by input shapes:
    names the producer of each glue kernel (copies, casts, adds) in the kernel table."""
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


def main() -> None:
    ap = t_args(__doc__)
    ap.add_argument("--ops", action="store_true", help="also list the aten ops with the most own device time")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_attention needs a CUDA device")
    B, HQ, H, dk, dv = 1, 64, 4, 128, 128
    result = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "hp": HP, "runs": {}}
    for T in a.T:
        x = nsa_inputs(B, T, HQ, H, dk, dv)
        do = torch.randn(B, T, HQ, dv, device="cuda", dtype=torch.bfloat16)

        def nsa_step():
            o, _ = nsa_attention_triton(*x, **HP)
            return torch.autograd.grad(o, x, do)

        qd = torch.randn(B, HQ, T, dk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kd = torch.randn(B, H, T, dk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        vd = torch.randn(B, H, T, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dod = torch.randn(B, HQ, T, dv, device="cuda", dtype=torch.bfloat16)

        def dense_step():
            o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
            return torch.autograd.grad(o, (qd, kd, vd), dod)

        rows, ms = kernel_table(nsa_step, a.iters)
        drows, dms = kernel_table(dense_step, a.iters)
        result["runs"][str(T)] = {"nsa_device_ms": round(ms, 3), "dense_device_ms": round(dms, 3),
                                  "kernels": rows, "dense_kernels": drows}
        print(f"\nT={T}: NSA fwd+bwd device {ms:.2f} ms, dense {dms:.2f} ms (ratio {dms / ms:.2f}x)")
        print(f"  {'kernel':<70} {'us/call':>9} {'calls':>6} {'ms':>8} {'share':>6}")
        for r in rows:
            print(f"  {r['kernel'][:70]:<70} {r['us_per_call']:>9} {r['calls_per_iter']:>6g} "
                  f"{r['ms_per_iter']:>8} {r['share']:>6.1%}")
        if a.ops:
            ops = op_table(nsa_step, a.iters)
            result["runs"][str(T)]["aten_ops"] = ops
            print(f"  {'aten op (own device time)':<28} {'ms':>8} {'calls':>6}  input shapes")
            for r in ops:
                print(f"  {r['op']:<28} {r['ms_per_iter']:>8} {r['calls_per_iter']:>6g}  {r['shapes']}")
        del x, qd, kd, vd
        torch.cuda.empty_cache()
    save_json(result, "profile_attention", a.copy_to)


if __name__ == "__main__":
    main()
