"""Prototype: the decode step's split-K compressed attention (no block-score partials) in two forms.

    python bench/proto_cmp_decode.py [--B 16] [--S 65536]

"flat":   [G, BN] score tiles, as nsa.ops.triton.decode._cmp_kernel: every key tile needs row max /
          row sum reductions across the program's warps.
"warps":  [NW, G, BW] tiles and batched dots: each of NW slices of a key tile keeps its own running
          softmax (one warp each when Triton puts the batch on the warps), merged once at the end.
"load":   the flat kernel's loads and grid with no maths (plain loads: Triton pipelines only loads that
          feed a dot, so this is latency-bound, not a roof).
"tma":    the flat kernel with K/V tiles loaded by TMA (host tensor descriptors).
Prints the cold-L2 microseconds of each (CUDA graph replay) and TB/s over the compressed K/V; checks
both against torch. A probe for issue 4's decode target, not library code.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_decode import graphed, time_cold, time_hot  # noqa: E402


@triton.jit
def _step(q, k, v, ok, m, l, acc, scale_log2):
    """One online-softmax step of q [G, D] over the key tile k/v [BN, D] (valid columns ok)."""
    s = tl.dot(q, tl.trans(k)) * scale_log2
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l, acc


@triton.jit
def _flat_kernel(Q, KC, VC, CM, CL, CO, N, H, NCH, SUBS, scale_log2,
                 G: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, TMA: tl.constexpr):
    """KC/VC: pointers, or with TMA host tensor descriptors over [B, N, H, D] (TMA tile loads)."""
    h = tl.program_id(0)
    c = tl.program_id(1)
    b = tl.program_id(2)
    b64 = b.to(tl.int64)
    g = tl.arange(0, G)
    od = tl.arange(0, D)
    HQ = H * G
    q = tl.load(Q + (b64 * HQ + h * G + g)[:, None] * D + od[None, :])
    m = tl.full([G], float("-inf"), tl.float32)
    l = tl.zeros([G], tl.float32)
    acc = tl.zeros([G, D], tl.float32)
    for st in range(c * SUBS, tl.minimum(c * SUBS + SUBS, tl.cdiv(N, BN))):
        ki = st * BN + tl.arange(0, BN)
        ok = ki < N
        if TMA:
            k = tl.reshape(KC.load([b, st * BN, h, 0]), [BN, D])
            v = tl.reshape(VC.load([b, st * BN, h, 0]), [BN, D])
        else:
            rows = ((b64 * N + ki) * H + h)[:, None] * D + od[None, :]
            k = tl.load(KC + rows, mask=ok[:, None], other=0.0)
            v = tl.load(VC + rows, mask=ok[:, None], other=0.0)
        m, l, acc = _step(q, k, v, ok, m, l, acc, scale_log2)
    part = ((b64 * NCH + c) * HQ + h * G + g)
    tl.store(CM + part, m)
    tl.store(CL + part, l)
    tl.store(CO + part[:, None] * D + od[None, :], acc)


@triton.jit
def _load_kernel(Q, KC, VC, CM, CL, CO, N, H, NCH, SUBS, scale_log2,
                 G: tl.constexpr, D: tl.constexpr, BN: tl.constexpr):
    """The flat kernel's loads with no maths (K + V summed elementwise): the memory roof of its grid."""
    h = tl.program_id(0)
    c = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    od = tl.arange(0, D)
    HQ = H * G
    acc = tl.zeros([BN, D], tl.float32)
    for st in range(c * SUBS, tl.minimum(c * SUBS + SUBS, tl.cdiv(N, BN))):
        ki = st * BN + tl.arange(0, BN)
        ok = ki < N
        rows = ((b * N + ki) * H + h)[:, None] * D + od[None, :]
        acc += tl.load(KC + rows, mask=ok[:, None], other=0.0).to(tl.float32)
        acc += tl.load(VC + rows, mask=ok[:, None], other=0.0).to(tl.float32)
    part = ((b * NCH + c) * HQ + h * G)
    tl.store(CO + part * D + od, tl.sum(acc, 0))


@triton.jit
def _warps_kernel(Q, KC, VC, CM, CL, CO, N, H, NCH, SUBS, scale_log2,
                  G: tl.constexpr, D: tl.constexpr, NW: tl.constexpr, BW: tl.constexpr):
    h = tl.program_id(0)
    c = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    g = tl.arange(0, G)
    od = tl.arange(0, D)
    HQ = H * G
    q = tl.load(Q + (b * HQ + h * G + g)[:, None] * D + od[None, :])
    qb = tl.broadcast_to(q[None, :, :], [NW, G, D])
    m = tl.full([NW, G], float("-inf"), tl.float32)
    l = tl.zeros([NW, G], tl.float32)
    acc = tl.zeros([NW, G, D], tl.float32)
    w = tl.arange(0, NW)[:, None, None]
    kk = tl.arange(0, BW)[None, :, None]
    d3 = od[None, None, :]
    for st in range(c * SUBS, tl.minimum(c * SUBS + SUBS, tl.cdiv(N, NW * BW))):
        ki = st * (NW * BW) + w * BW + kk                                   # [NW, BW, 1]
        ok = ki < N
        rows = ((b * N + ki) * H + h) * D + d3
        k = tl.load(KC + rows, mask=ok, other=0.0)                          # [NW, BW, D]
        v = tl.load(VC + rows, mask=ok, other=0.0)
        s = tl.dot(qb, tl.permute(k, (0, 2, 1))) * scale_log2               # [NW, G, BW]
        s = tl.where(tl.permute(ok, (0, 2, 1)), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 2))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, :, None])
        alpha = tl.exp2(m - m_safe)
        l = l * alpha + tl.sum(p, 2)
        acc = acc * alpha[:, :, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    mx = tl.max(m, 0)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    wt = tl.exp2(m - mx_safe[None, :])
    part = ((b * NCH + c) * HQ + h * G + g)
    tl.store(CM + part, mx)
    tl.store(CL + part, tl.sum(wt * l, 0))
    tl.store(CO + part[:, None] * D + od[None, :], tl.sum(wt[:, :, None] * acc, 0))


def run(kind, q, kc, vc, nch, subs, sc, cfg):
    B, HQ, D = q.shape
    N, H = kc.shape[1], kc.shape[2]
    cm = torch.empty(B, nch, HQ, device=q.device)
    cl = torch.empty_like(cm)
    co = torch.empty(B, nch, HQ, D, device=q.device)
    if kind == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor
        kd = TensorDescriptor.from_tensor(kc, [1, cfg["bn"], 1, D])
        vd = TensorDescriptor.from_tensor(vc, [1, cfg["bn"], 1, D])
        _flat_kernel[(H, nch, B)](q, kd, vd, cm, cl, co, N, H, nch, subs, sc * 1.4426950408889634,
                                  G=HQ // H, D=D, BN=cfg["bn"], TMA=True, num_warps=cfg["warps"],
                                  num_stages=cfg["stages"])
    elif kind == "load":
        _load_kernel[(H, nch, B)](q, kc, vc, cm, cl, co, N, H, nch, subs, sc, G=HQ // H, D=D, BN=cfg["bn"],
                                  num_warps=cfg["warps"], num_stages=cfg["stages"])
    elif kind == "flat":
        _flat_kernel[(H, nch, B)](q, kc, vc, cm, cl, co, N, H, nch, subs, sc * 1.4426950408889634,
                                  G=HQ // H, D=D, BN=cfg["bn"], TMA=False, num_warps=cfg["warps"],
                                  num_stages=cfg["stages"])
    else:
        _warps_kernel[(H, nch, B)](q, kc, vc, cm, cl, co, N, H, nch, subs, sc * 1.4426950408889634,
                                   G=HQ // H, D=D, NW=cfg["nw"], BW=cfg["bw"], num_warps=cfg["warps"],
                                   num_stages=cfg["stages"])
    return cm, cl, co


def merged(cm, cl, co):
    mx = cm.max(1, keepdim=True).values
    w = torch.exp2(cm - mx)
    return (w[..., None] * co).sum(1) / (w * cl).sum(1)[..., None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, nargs="+", default=[16, 1])
    ap.add_argument("--S", type=int, default=65536)
    ap.add_argument("--reps", type=int, default=100)
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    HQ, H, D = 64, 4, 128
    N = (a.S - 32) // 16 + 1
    sms = torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else 4
    cfgs = [("flat", dict(bn=64, warps=4, stages=3)), ("flat", dict(bn=64, warps=4, stages=4)),
            ("flat", dict(bn=64, warps=4, stages=3, per_sm=4)), ("flat", dict(bn=32, warps=4, stages=4, per_sm=4)),
            ("flat", dict(bn=64, warps=4, stages=2, per_sm=8)), ("flat", dict(bn=128, warps=8, stages=3)),
            ("load", dict(bn=64, warps=4, stages=3)), ("load", dict(bn=64, warps=4, stages=3, per_sm=4)),
            ("load", dict(bn=64, warps=8, stages=4, per_sm=2)),
            ("warps", dict(nw=4, bw=16, warps=4, stages=3)),
            ("tma", dict(bn=64, warps=4, stages=3)), ("tma", dict(bn=64, warps=4, stages=4)),
            ("tma", dict(bn=128, warps=4, stages=3)), ("tma", dict(bn=64, warps=4, stages=3, per_sm=4)),
            ("tma", dict(bn=128, warps=8, stages=3))]
    for B in a.B:
        torch.manual_seed(0)
        q = torch.randn(B, HQ, D, device=dev, dtype=dt)
        kc = torch.randn(B, N, H, D, device=dev, dtype=dt)
        vc = torch.randn(B, N, H, D, device=dev, dtype=dt)
        sc = D ** -0.5
        qf, kf, vf = q.float().view(B, H, HQ // H, D), kc.float(), vc.float()
        ref = torch.softmax(torch.einsum("bhgd,bnhd->bhgn", qf, kf) * sc, -1)
        ref = torch.einsum("bhgn,bnhd->bhgd", ref, vf).reshape(B, HQ, D)
        gb = 2 * B * N * H * D * kc.element_size() / 1e9
        print(f"B={B} S={a.S}: compressed K/V {gb * 1e3:.0f} MB")
        if dev == "cuda":   # the same bytes through cuDNN's dense decode (GQA): the reference rate
            import torch.nn.functional as F
            from torch.nn.attention import SDPBackend, sdpa_kernel
            qd, kd, vd = q.view(B, HQ, 1, D), kc.transpose(1, 2), vc.transpose(1, 2)

            def dense():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)
            try:
                rp = graphed(dense)
                us = time_cold(rp, a.reps)
                print(f"  cuDNN dense decode over the same K/V: cold {us:6.1f} us ({gb / us * 1e3:.2f} TB/s)")
            except Exception as exc:  # noqa: BLE001
                print(f"  cuDNN dense decode: {type(exc).__name__}: {str(exc)[:120]}")
        for kind, cfg in cfgs:
            tile = cfg["nw"] * cfg["bw"] if kind == "warps" else cfg["bn"]
            nsub = triton.cdiv(N, tile)
            want = max(1, cfg.get("per_sm", 2) * sms // (B * H))
            subs = triton.cdiv(nsub, min(want, nsub))
            nch = triton.cdiv(nsub, subs)
            try:
                o = merged(*run(kind, q, kc, vc, nch, subs, sc, cfg))
                err = ((o - ref).norm() / ref.norm()).item() if kind != "load" else float("nan")
                if dev == "cuda":
                    rp = graphed(lambda: run(kind, q, kc, vc, nch, subs, sc, cfg))
                    us, hot = time_cold(rp, a.reps), time_hot(rp, a.reps)
                    print(f"  {kind:<5} {str(cfg):<48} err {err:.1e}  cold {us:6.1f} us ({gb / us * 1e3:.2f} TB/s)"
                          f"  hot {hot:6.1f}")
                else:
                    print(f"  {kind:<5} {str(cfg):<48} err {err:.1e}")
            except Exception as exc:  # noqa: BLE001 - a config this Triton refuses
                print(f"  {kind:<5} {str(cfg):<48} failed: {type(exc).__name__}: {str(exc)[:200]}")


if __name__ == "__main__":
    main()
