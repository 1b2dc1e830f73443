"""Compressed branch alone: the Triton kernel (attn.py) vs the residue-split dense SDPA (cmp_dense.py).

    python bench/bench_cmp_dense.py --T 8192 65536

Paper sizes (l=32, d=16; B=1, HQ=64, H=4, d=128, bf16). For each T and dense backend: forward and
forward+backward milliseconds (median of CUDA-event timings) and the relative error of o, lse and
the three gradients against the Triton kernel. Prints a table, writes bench/out/cmp_dense_<date>.json.
"""
from __future__ import annotations

import datetime as dt
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_attention import cuda_time, save_json, t_args  # noqa: E402
from nsa.ops.common import num_cmp_tokens  # noqa: E402
from nsa.ops.triton import attn, cmp_dense  # noqa: E402


def rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main() -> None:
    ap = t_args(__doc__)
    a = ap.parse_args()
    B, HQ, H, dk, dv, l, d = 1, 64, 4, 128, 128, 32, 16
    sc = dk ** -0.5
    res = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "probe": cmp_dense.probe("cuda:0", torch.bfloat16, dk, dv), "T": {}}
    print("probe:", res["probe"], flush=True)
    rows = []
    for T in a.T:
        N = num_cmp_tokens(T, l, d)
        g = torch.Generator(device="cuda").manual_seed(T)
        mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        q, kc, vc, do = mk(B, T, HQ, dk), mk(B, N, H, dk), mk(B, N, H, dv), mk(B, T, HQ, dv)
        o_t, lse_t = attn.attn_fwd(q, kc, vc, stride=d, offset=l - 1, window=0, scale=sc)
        delta = (do.float() * o_t.float()).sum(-1)
        gq, gk, gv = attn.attn_bwd(q, kc, vc, do, lse_t, delta, None, stride=d, offset=l - 1, window=0, scale=sc)
        out = {"triton": {
            "fwd_ms": cuda_time(lambda: attn.attn_fwd(q, kc, vc, stride=d, offset=l - 1, window=0, scale=sc),
                                2, a.iters),
            "fwd_bwd_ms": cuda_time(lambda: (lambda o, s: attn.attn_bwd(
                q, kc, vc, do, s, (do.float() * o.float()).sum(-1), None, stride=d, offset=l - 1, window=0,
                scale=sc))(*attn.attn_fwd(q, kc, vc, stride=d, offset=l - 1, window=0, scale=sc)), 2, a.iters)}}
        for be in cmp_dense.BACKENDS:
            try:
                x = [t.clone().requires_grad_() for t in (q, kc, vc)]

                def fwd():
                    with torch.no_grad():
                        return cmp_dense.cmp_attention_dense(*x, l=l, d=d, scale=sc, backend=be)

                def fwd_bwd():
                    o, _ = cmp_dense.cmp_attention_dense(*x, l=l, d=d, scale=sc, backend=be)
                    return torch.autograd.grad(o, x, do)

                o, lse = cmp_dense.cmp_attention_dense(*x, l=l, d=d, scale=sc, backend=be)
                grads = torch.autograd.grad(o, x, do)
                o2, _ = cmp_dense.cmp_attention_dense(*x, l=l, d=d, scale=sc, backend=be)
                same = all(torch.equal(u, w) for u, w in zip(grads, torch.autograd.grad(o2, x, do)))
                fin = torch.isfinite(lse_t)
                err = {"o": rel(o, o_t), "lse_max_abs": float((lse[fin] - lse_t[fin]).abs().max()),
                       "lse_inf_equal": bool((torch.isinf(lse) == torch.isinf(lse_t)).all()),
                       "dq": rel(grads[0], gq), "dk": rel(grads[1], gk), "dv": rel(grads[2], gv),
                       "bitwise_repeatable_grads": same}
                out[be] = {"fwd_ms": cuda_time(fwd, 2, a.iters), "fwd_bwd_ms": cuda_time(fwd_bwd, 2, a.iters),
                           "err_vs_triton": err}
            except Exception as exc:  # noqa: BLE001 - report and go on
                out[be] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(f"T={T} {be}: {out[be]}", flush=True)
        res["T"][T] = out
        for be, v in out.items():
            if "fwd_ms" in v:
                rows.append((T, be, v["fwd_ms"], v["fwd_bwd_ms"], out["triton"]["fwd_ms"] / v["fwd_ms"],
                             out["triton"]["fwd_bwd_ms"] / v["fwd_bwd_ms"]))
        torch.cuda.empty_cache()
    print(f"\n{res['device']}  torch {res['torch']}")
    print(f"{'T':>6} {'impl':>7} {'fwd ms':>8} {'f+b ms':>8} {'x fwd':>6} {'x f+b':>6}  (x = Triton / impl)")
    for r in rows:
        print(f"{r[0]:>6} {r[1]:>7} {r[2]:>8.2f} {r[3]:>8.2f} {r[4]:>6.2f} {r[5]:>6.2f}")
    save_json(res, "cmp_dense", a.copy_to)


if __name__ == "__main__":
    main()
