"""RoPE and the branch-major layout of the NSA layer's projections in one pass (NSAAttention.project).

The fused qkv GEMM gives y [B, T, HQ*dk + 3H*dk + 3H*dv] with row blocks [q | k_cmp k_slc k_win |
v_cmp v_slc v_win]. One kernel launch reads y once and writes
  q [B, T, HQ, dk]      RoPE'd
  k [3, B, T, H, dk]    RoPE'd, branch-major (k[c] is branch c's contiguous [B, T, H, dk])
  v [3, B, T, H, dv]    branch-major
and in backward the same kernel (BWD) applies the inverse rotation to dq / dk and scatters dq, dk, dv
into one dy of y's shape. The torch path it replaces (nsa/layers/rope.py apply_rope plus two permute
copies) runs ~30 elementwise kernels over fp32 intermediates forward and more backward.

Numerics are apply_rope's, bit for bit: the cos/sin tables [T, dk/2] (fp32) come from the same torch
code (rope_cos_sin), the rotation is x1*cos - x2*sin, x2*cos + x1*sin in fp32 with every product
rounded on its own (enable_fp_fusion=False: no FMA contraction, like torch's separate kernels), cast
back to y's dtype; backward is autograd's dx1 = g1*cos + g2*sin, dx2 = g2*cos - g1*sin.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ...config.env import triton_interpreter
from ._utils import next_pow2

SUPPORTED = (torch.float16, torch.bfloat16, torch.float32)
TILE = 4096   # elements of a program's widest tile [rows, max(dk/2, dv)]: 32 per thread at 4 warps


def block_rows(dk: int, dv: int) -> int:
    """Tokens per program (one program moves one head of them; grid: row blocks x heads): 64 at d_k = d_v
    = 64, fewer for wider heads so the tiles stay in registers."""
    return max(16, min(64, TILE // next_pow2(max(dk // 2, dv))))


@triton.jit
def _cast(x, dtype: tl.constexpr, INTERP: tl.constexpr):
    """fp32 x -> dtype rounded to nearest even. Triton's interpreter truncates fp32 -> bf16 (a GPU rounds),
    so under INTERP bf16 is rounded here by the bits (finite values; the CPU tests compare bit for bit)."""
    if INTERP and dtype == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return u.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def _branch_rows(P0, P1, P2, r, i, H: tl.constexpr, D: tl.constexpr):
    """Pointers [BLOCK] to rows r (int64) of head i, i.e. head i % H of branch i // H, in that branch's
    [n_rows, H, D] tensor P0 / P1 / P2."""
    off = r * (H * D) + (i % H) * D
    br = i // H
    if br == 0:
        p = P0 + off
    elif br == 1:
        p = P1 + off
    else:
        p = P2 + off
    return p


@triton.jit
def _rope_layout(Y, COS, SIN, Q, K0, K1, K2, V0, V1, V2, n_rows, T, HQ: tl.constexpr, H: tl.constexpr, DK: tl.constexpr,
                 DV: tl.constexpr, HALF_P: tl.constexpr, DV_P: tl.constexpr, BLOCK: tl.constexpr,
                 BWD: tl.constexpr, INTERP: tl.constexpr):
    """Program (row block, head slot j) between the packed rows Y [n_rows, C] and Q [n_rows, HQ, DK], the
    branches' K0..K2 [n_rows, H, DK] and V0..V2 [n_rows, H, DV]: slots j < HQ + 3H rotate q head j or k head
    j - HQ, the 3H slots after copy v heads. Forward reads Y and writes the rest; BWD (the transpose)
    reads their gradients and writes Y's, rotating by -angle (sin negated: the same products, exactly)."""
    C: tl.constexpr = (HQ + 3 * H) * DK + 3 * H * DV
    HALF: tl.constexpr = DK // 2
    NROT: tl.constexpr = HQ + 3 * H
    j = tl.program_id(1)
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = r < n_rows
    if j < NROT:
        c = tl.arange(0, HALF_P)
        m = ok[:, None] & (c[None, :] < HALF)
        tab = (r % T)[:, None] * HALF + c[None, :]
        cs = tl.load(COS + tab, mask=m, other=0.0)
        sn = tl.load(SIN + tab, mask=m, other=0.0)
        packed = Y + r[:, None] * C + j * DK + c[None, :]
        if j < HQ:
            split = Q + (r * (HQ * DK) + j * DK)[:, None] + c[None, :]
        else:
            split = _branch_rows(K0, K1, K2, r, j - HQ, H, DK)[:, None] + c[None, :]
        if BWD:
            src, dst, sn = split, packed, -sn
        else:
            src, dst = packed, split
        x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
        tl.store(dst, _cast(x1 * cs - x2 * sn, Y.dtype.element_ty, INTERP), mask=m)
        tl.store(dst + HALF, _cast(x2 * cs + x1 * sn, Y.dtype.element_ty, INTERP), mask=m)
    else:   # names of their own: a compiled if/else merges same-named values, whose shapes differ here
        cv = tl.arange(0, DV_P)
        mv = ok[:, None] & (cv[None, :] < DV)
        packed_v = Y + r[:, None] * C + NROT * DK + (j - NROT) * DV + cv[None, :]
        split_v = _branch_rows(V0, V1, V2, r, j - NROT, H, DV)[:, None] + cv[None, :]
        if BWD:
            tl.store(packed_v, tl.load(split_v, mask=mv, other=0.0), mask=mv)
        else:
            tl.store(split_v, tl.load(packed_v, mask=mv, other=0.0), mask=mv)


def _launch(y, cos, sin, q, ks, vs, hq: int, h: int, bwd: bool) -> None:
    """One program per (block_rows tokens, head slot): HQ + 3H rotated heads, then 3H value heads."""
    B, T = y.shape[:2]
    dk, dv = q.shape[-1], vs[0].shape[-1]
    if B * T == 0:
        return
    rows = block_rows(dk, dv)
    grid = (triton.cdiv(B * T, rows), hq + 6 * h)
    _rope_layout[grid](y, cos, sin, q, *ks, *vs, B * T, T, HQ=hq, H=h, DK=dk, DV=dv, HALF_P=next_pow2(dk // 2),
                       DV_P=next_pow2(dv), BLOCK=rows, BWD=bwd, INTERP=triton_interpreter(), num_warps=4,
                       enable_fp_fusion=False)


class _RopeLayout(torch.autograd.Function):
    """Outputs q and the branches' k and v as planes of two branch-major buffers; backward takes the six
    branch gradients as they come (no stack into one buffer first)."""

    @staticmethod
    def forward(ctx, y, cos, sin, hq, h, dk, dv):
        B, T = y.shape[:2]
        y = y.contiguous()
        q = y.new_empty(B, T, hq, dk)
        ks = y.new_empty(3, B, T, h, dk).unbind(0)
        vs = y.new_empty(3, B, T, h, dv).unbind(0)
        _launch(y, cos, sin, q, ks, vs, hq, h, bwd=False)
        ctx.save_for_backward(cos, sin)
        ctx.heads, ctx.y_meta = (hq, h), (y.shape, y.dtype)
        return (q, *ks, *vs)

    @staticmethod
    @once_differentiable
    def backward(ctx, gq, *g):
        cos, sin = ctx.saved_tensors
        shape, dtype = ctx.y_meta
        dy = gq.new_empty(shape, dtype=dtype)   # every element written: q, k and v cover y's columns
        g = [t.contiguous() for t in g]
        _launch(dy, cos, sin, gq.contiguous(), g[:3], g[3:], *ctx.heads, bwd=True)
        return dy, None, None, None, None, None, None


def rope_layout(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv_groups: int,
                d_k: int, d_v: int) -> tuple[torch.Tensor, ...]:
    """y [B, T, HQ*dk + 3H*dk + 3H*dv] (the fused qkv GEMM's output), cos/sin [T, dk/2] fp32 (rope_cos_sin at
    the tokens' positions) -> (q [B, T, HQ, dk], k_cmp, k_slc, k_win [B, T, H, dk], v_cmp, v_slc, v_win
    [B, T, H, dv]) in y's dtype: k_* and v_* are the planes of branch-major [3, B, T, H, *] buffers, q and k
    RoPE'd as apply_rope does (see module doc). Differentiable w.r.t. y (not twice)."""
    if y.dim() != 3 or y.shape[-1] != (n_heads + 3 * n_kv_groups) * d_k + 3 * n_kv_groups * d_v:
        raise ValueError(f"y: expected [B, T, {(n_heads + 3 * n_kv_groups) * d_k + 3 * n_kv_groups * d_v}] "
                         f"(HQ*dk + 3H*dk + 3H*dv), got {tuple(y.shape)}")
    if y.dtype not in SUPPORTED:
        raise ValueError(f"y has dtype {y.dtype}; rope_layout supports fp16/bf16/fp32 (use the torch path)")
    want = (y.shape[1], d_k // 2)
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != want or t.dtype != torch.float32 or t.device != y.device:
            raise ValueError(f"{name}: expected fp32 [{want[0]}, {want[1]}] on {y.device} (rope_cos_sin at the "
                             f"T tokens' positions), got {t.dtype} {tuple(t.shape)} on {t.device}")
    return _RopeLayout.apply(y, cos.contiguous(), sin.contiguous(), n_heads, n_kv_groups, d_k, d_v)
