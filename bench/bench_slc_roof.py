"""How close the selection kernels are to the traffic roof of their design (token-centric: every
(token, kv head) program reads its n_sel selected K/V blocks itself).

    python bench/bench_slc_roof.py --T 8192 65536

For the block_idx the op really chooses (paper sizes, random inputs, B=1, HQ=64, H=4, d=128, bf16),
times the forward (select.slc_fwd; the whole backward for scale) and a "load only"
kernel with the same grid, loop and loads but no attention maths (it adds the tiles elementwise), so
its time is the cost of moving the bytes; the same loads feeding one small MMA per tile ("load+mma":
Triton pipelines such loads with async copies, as in the real kernels); and the plain loads from the
tokens' own neighbourhood (block t//l_sel - slot: best L2 locality). Prints ms, the bytes each program reads (L2 -> SM) and
TB/s; writes bench/out/slc_roof_<date>.json (and a copy under --copy-to).
"""
from __future__ import annotations

import datetime as dt
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_attention import HP, cuda_time, nsa_inputs, save_json, t_args  # noqa: E402
from nsa.ops.triton import nsa_attention_triton  # noqa: E402
from nsa.ops.triton import select as tsel  # noqa: E402


@triton.jit
def _load_only_kernel(K, V, BI, OUT, skt, skh, svt, svh, sbt, sbh, H,
                      LSEL: tl.constexpr, NSEL: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                      LOCAL: tl.constexpr, DOT: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    t64 = t.to(tl.int64)
    offs = tl.arange(0, D)
    if DOT:   # the tiles feed an MMA (ones[16, BS] @ tile), as in the real kernels: Triton then
        acc = tl.zeros([16, D], tl.float32)    # pipelines the loads (async copies) as it does there
        ones = tl.full([16, BS], 1.0, K.dtype.element_ty)
    else:
        acc = tl.zeros([BS, D], tl.float32)
    k_base = K + h * skh
    v_base = V + h * svh
    NSUB: tl.constexpr = (LSEL + BS - 1) // BS
    for it in range(NSEL * NSUB):
        if LOCAL:
            j = tl.maximum(t // LSEL - it // NSUB, 0).to(tl.int64)
        else:
            j = tl.load(BI + t64 * sbt + h * sbh + it // NSUB)
        kk = (it % NSUB) * BS + tl.arange(0, BS)
        kp = j * LSEL + kk
        ok = (kp >= 0) & (kp <= t)
        k = tl.load(k_base + kp[:, None] * skt + offs[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(v_base + kp[:, None] * svt + offs[None, :], mask=ok[:, None], other=0.0)
        if DOT:
            acc = tl.dot(ones, k, acc)
            acc = tl.dot(ones, v, acc)
        else:
            acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(OUT + (t64 * H + h) * D + offs, tl.sum(acc, 0))


def load_only(k, v, bi, local: bool, warps: int, stages: int, bs: int = 64, dot: bool = False):
    T, H, D = k.shape[1], k.shape[2], k.shape[3]
    out = torch.empty(T, H, D, device=k.device, dtype=torch.float32)
    _load_only_kernel[(T, H)](k, v, bi, out, k.stride(1), k.stride(2), v.stride(1), v.stride(2),
                              bi.stride(1), bi.stride(2), H, LSEL=HP["l_sel"], NSEL=HP["n_sel"], D=D,
                              BS=bs, LOCAL=local, DOT=dot, num_warps=warps, num_stages=stages)
    return out


def main() -> None:
    ap = t_args(__doc__)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_slc_roof needs a CUDA device")
    B, HQ, H, dk, dv = 1, 64, 4, 128, 128
    result = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "hp": HP, "runs": {}}
    for T in a.T:
        x = nsa_inputs(B, T, HQ, H, dk, dv)
        with torch.no_grad():
            _, bi = nsa_attention_triton(*x, **HP)
        q, ks, vs = x[0].detach(), x[3].detach(), x[4].detach()
        # bytes each (token, kv head) program reads: the visible rows of its selected blocks, K and V
        t = torch.arange(T, device="cuda").view(1, T, 1, 1)
        rows = torch.where(bi >= 0, (t - bi * HP["l_sel"] + 1).clamp(0, HP["l_sel"]), 0)
        gb = float(rows.sum()) * (dk + dv) * 2 / 1e9
        sc = dk ** -0.5
        do = torch.randn(B, T, HQ, dv, device="cuda", dtype=torch.bfloat16)
        o, lse = tsel.slc_fwd(q, ks, vs, bi, l_sel=HP["l_sel"], scale=sc)
        delta = (do.float() * o.float()).sum(-1)
        runs = {"slc_fwd": lambda: tsel.slc_fwd(q, ks, vs, bi, l_sel=HP["l_sel"], scale=sc),
                "slc_bwd (dq + dK/dV)": lambda: tsel.slc_bwd(q, ks, vs, bi, do, lse, delta, None,
                                                             l_sel=HP["l_sel"], scale=sc)}
        for warps in (2, 4):
            for stages in (2, 3):
                runs[f"load_only w{warps} s{stages}"] = (
                    lambda w=warps, s=stages: load_only(ks, vs, bi, False, w, s))
        runs["load_only local w2 s2"] = lambda: load_only(ks, vs, bi, True, 2, 2)
        for warps, stages in ((2, 2), (2, 3), (4, 2), (4, 3)):
            runs[f"load+mma w{warps} s{stages}"] = (
                lambda w=warps, s=stages: load_only(ks, vs, bi, False, w, s, dot=True))
        res = {"GB_read": round(gb, 2)}
        print(f"\nT={T}: selected K/V rows read per pass {gb:.1f} GB (L2 -> SM)")
        print(f"  {'kernel':<24} {'ms':>8} {'TB/s':>7}")
        for name, fn in runs.items():
            ms = cuda_time(fn, 2, a.iters)
            res[name] = {"ms": round(ms, 3), "TBps": round(gb / ms, 2)}
            print(f"  {name:<24} {ms:>8.3f} {gb / ms:>7.2f}")
        result["runs"][str(T)] = res
        del x, q, ks, vs, bi, do, o, lse
        torch.cuda.empty_cache()
    save_json(result, "slc_roof", a.copy_to)


if __name__ == "__main__":
    main()
