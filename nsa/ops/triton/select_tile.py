"""Selection branch on query tiles: m consecutive tokens x the G query heads of one KV head per program.

Consecutive tokens pick overlapping blocks (their forced blocks coincide, and on trained models so do
many scored ones), so a program that owns m tokens loads each block of the tile's *union* of
selections once instead of once per token. Rows of a program are (token of the tile, query head)
pairs packed as r -> token t0 + r // G, head h*G + r % G (rows >= m*G are padding; the row count is
a power of two >= 16 for tl.dot). Every row still attends exactly its own token's blocks: the union
carries, per block, a bit mask of the tile's tokens that selected it (bit i <-> token t0 + i), so the
per-row mask is `(bits >> i) & 1` and the causal limit `key <= token` inside the block.

Preprocessing (tile_unions; on CUDA one kernel, one program per (tile, b, kv head); no host sync):
per (b, kv head, tile) the ascending union of the tile's selected blocks, its size and the per-block
token bits. tile_union_fraction gives the policy's measure (loaded blocks relative to per-token).

Backward: dq per tile program over the union (gate folded into p as in select.slc_bwd). dK/dV without
atomics by select.py's walk (per block, the tokens that selected it): K/V are loaded once per program
there already, so tiles save nothing in dK/dV.

Cost: a tile does union_fraction * m times the per-token MMA work to load union_fraction of its K/V, so
m comes from measured unions (docs/kernels.md); the planner (nsa/ops/plan.py) picks it per call.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..tuning import TILE_MAX_M, SelectTuning, TileLaunch, TileTuning
from ._utils import dot_precision, next_pow2
from .attn import online_softmax_step
from .select import _bwd_args, dq_buffer, slc_dkdv
from .qsum import QAdd, add_q_terms, q_add_args
from .tile_gluon import gtile_dq, gtile_fwd
from .tile_group import group_tokens, permuted

LOG2E = 1.4426950408889634
MAX_M = TILE_MAX_M    # token bits of a union entry live in one int32
_NONE = torch.iinfo(torch.int64).max   # sort key of "no block" in the torch path (after every real block)


class TileUnion(NamedTuple):
    """Per (b, kv head, tile) union of the tile's selections; all [B, H, n_tiles, m*n_sel] int32 except size."""

    blocks: torch.Tensor   # ascending block ids, -1 after the union
    bits: torch.Tensor     # bit i set iff the token at position tile*m + i selected that block (0 after the union)
    size: torch.Tensor     # [B, H, n_tiles] int32: entries of the union
    # [B, H, T] int32: the token at each position (tile_group.py: tiles of similar tokens); None: position = token
    perm: torch.Tensor | None = None

    def perm_arg(self) -> torch.Tensor:
        """The kernels' PERM argument: perm, or any int32 tensor where there is none (then unread)."""
        return self.perm if self.perm is not None else self.size


def _sorted_tiles(block_idx: torch.Tensor, m: int):
    """block_idx [B,T,H,S] -> (sorted keys [B,H,nt,m*S] int64 with _NONE for padding, order, first, last)."""
    B, T, H, S = block_idx.shape
    nt = triton.cdiv(T, m)
    bi = block_idx.permute(0, 2, 1, 3)                                          # [B, H, T, S]
    if nt * m > T:   # the last tile's missing tokens select nothing
        bi = torch.nn.functional.pad(bi, (0, 0, 0, nt * m - T), value=-1)
    x = bi.reshape(B, H, nt, m * S).to(torch.int64).contiguous()   # kernels index it flat
    key = torch.where(x >= 0, x, _NONE)
    skey, order = torch.sort(key, dim=-1)
    valid = skey != _NONE
    edge = torch.full_like(skey[..., :1], -1)
    first = valid & (skey != torch.cat([edge, skey[..., :-1]], -1))
    last = valid & (skey != torch.cat([skey[..., 1:], edge], -1))
    return skey, order, first, last


def _tile_unions_torch(block_idx: torch.Tensor, m: int) -> TileUnion:
    """tile_unions in torch ops (two segmented sorts, a cumsum and a cummax): the CPU path, where the
    interpreted kernel would be slow, and the kernel's cross-check."""
    S = block_idx.shape[3]
    skey, order, first, last = _sorted_tiles(block_idx, m)
    tokbit = torch.bitwise_left_shift(torch.ones_like(order), order // S)     # token of each entry
    # a token lists a block at most once, so the OR of a run's bits is their sum: run totals from the
    # inclusive cumsum minus its value just before the run (carried forward by a cummax, cs is monotone)
    cs = torch.cumsum(tokbit, -1)
    before = torch.cummax(torch.where(first, cs - tokbit, 0), -1).values
    total = cs - before
    skey2, order2 = torch.sort(torch.where(last, skey, _NONE), dim=-1)       # one entry per block, ascending
    ok = skey2 != _NONE
    bits = torch.where(ok, torch.gather(total, -1, order2), 0)
    bits = torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits)                # bit 31 as int32's sign bit
    return TileUnion(blocks=torch.where(ok, skey2, -1).to(torch.int32).contiguous(),
                     bits=bits.to(torch.int32).contiguous(), size=last.sum(-1, dtype=torch.int32).contiguous())



@triton.jit
def _union_kernel(BI, UB, UBITS, USZ, KEYS, sbb, sbt, sbh, T, H, NT, STRIDE, NS,
                  M: tl.constexpr, S: tl.constexpr, UW: tl.constexpr, LP: tl.constexpr,
                  SIZE_ONLY: tl.constexpr):
    """One program per (tile n, b*H + h). Entry e of the tile is slot e % S of token n*M + e // S. The
    entries become int32 keys block * 32 + token (tokens < MAX_M = 32, blocks < 2**26), sorted ascending,
    so each block's entries form one run of at most M keys in token order. Through KEYS (this program's LP
    int32 slots) every entry sees its predecessor and the M - 1 keys after it: it is the run's first iff
    its block differs from its predecessor's, a first entry's bits are its run's tokens, and its rank among
    the distinct blocks is the prefix count of first entries (a register tensor cannot be shifted or
    sliced, hence KEYS). One sort instead of all-pairs compares of the entries (faster: docs/kernels.md).
    Program k handles tile n = k * STRIDE and writes its size to USZ[b*H + h, k] (NS slots per head):
    STRIDE > 1 samples tiles (size only)."""
    n = tl.program_id(0) * STRIDE
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    out = (pid_bh.to(tl.int64) * NT + n) * UW
    e = tl.arange(0, LP)
    tok = (n * M + e // S).to(tl.int64)
    ok = (e < UW) & (tok < T)
    x = tl.load(BI + b * sbb + tok * sbt + h * sbh + e % S, mask=ok, other=-1).to(tl.int32)
    key = tl.sort(tl.where(ok & (x >= 0), x * 32 + e // S, 2147483647))
    kbase = KEYS + (pid_bh.to(tl.int64) * NS + tl.program_id(0)) * LP
    tl.store(kbase + e, key)
    tl.debug_barrier()    # every key stored before any thread reads its neighbours
    valid = key != 2147483647
    blk = key >> 5
    prev = tl.load(kbase + e - 1, mask=e > 0, other=-1)
    first = valid & ((prev >> 5) != blk)
    size = tl.sum(first.to(tl.int32), 0)
    tl.store(USZ + pid_bh.to(tl.int64) * NS + tl.program_id(0), size)
    if not SIZE_ONLY:
        bits = tl.full([LP], 1, tl.int32) << (key & 31)
        for d in tl.static_range(1, M):   # the run's later entries: the same block, other tokens
            nxt = tl.load(kbase + e + d, mask=e + d < LP, other=2147483647)
            bits += tl.where((nxt != 2147483647) & ((nxt >> 5) == blk), 1 << (nxt & 31), 0)
        rank = tl.cumsum(first.to(tl.int32), 0) - 1
        tl.store(UB + out + rank, blk, mask=first)
        tl.store(UBITS + out + rank, bits, mask=first)
        tail = (e >= size) & (e < UW)
        tl.store(UB + out + e, tl.full([LP], -1, tl.int32), mask=tail)
        tl.store(UBITS + out + e, tl.zeros([LP], tl.int32), mask=tail)


def _check_m(m: int) -> None:
    if not 1 <= m <= MAX_M:
        raise ValueError(f"tile size m must be in 1..{MAX_M}, got {m}")


def _run_union(block_idx: torch.Tensor, m: int, size_only: bool, stride: int = 1):
    """(blocks, bits, size [B,H,ns]) of tiles 0, stride, 2*stride, ... (ns of them; stride > 1: sizes only)."""
    _check_m(m)
    B, T, H, S = block_idx.shape
    nt, uw = triton.cdiv(T, m), m * S
    ns = triton.cdiv(nt, stride)
    dev = block_idx.device
    size = torch.empty(B, H, ns, device=dev, dtype=torch.int32)
    blocks = size if size_only else torch.empty(B, H, nt, uw, device=dev, dtype=torch.int32)
    bits = size if size_only else torch.empty(B, H, nt, uw, device=dev, dtype=torch.int32)
    lp = max(16, next_pow2(uw))
    keys = torch.empty(B * H * ns * lp, device=dev, dtype=torch.int32)   # scratch: each program's sorted entries
    _union_kernel[(ns, B * H)](block_idx, blocks, bits, size, keys, block_idx.stride(0), block_idx.stride(1),
                               block_idx.stride(2), T, H, nt, stride, ns, M=m, S=S, UW=uw, LP=lp,
                               SIZE_ONLY=size_only or stride > 1, num_warps=2)
    return blocks, bits, size


def tile_unions(block_idx: torch.Tensor, m: int, group: int = 0,
                n_blocks: int | None = None) -> TileUnion:
    """block_idx [B,T,H,n_sel] (ascending, -1 padded; unit stride in n_sel) -> TileUnion for tiles of
    m consecutive tokens, or with group = W of m similar tokens of each window of W (tile_group.py). On
    CUDA one kernel launch (_union_kernel; two with group), else torch ops; no host sync. n_blocks: a bound on the
    block ids for the grouping (group_tokens)."""
    perm = None
    if group:
        perm = group_tokens(block_idx, m, group, n_blocks)
        block_idx = permuted(block_idx, perm)
    if not block_idx.is_cuda:
        _check_m(m)
        return _tile_unions_torch(block_idx, m)._replace(perm=perm)
    blocks, bits, size = _run_union(block_idx, m, size_only=False)
    return TileUnion(blocks=blocks, bits=bits, size=size, perm=perm)


def tile_union_sizes(block_idx: torch.Tensor, m: int) -> torch.Tensor:
    """[B, H, n_tiles] int32 union sizes (no host sync)."""
    if not block_idx.is_cuda:
        _check_m(m)
        return _sorted_tiles(block_idx, m)[3].sum(-1, dtype=torch.int32)
    return _run_union(block_idx, m, size_only=True)[2]


def tile_union_fraction(block_idx: torch.Tensor, m: int) -> torch.Tensor:
    """0-dim fp32 tensor on block_idx's device: sum of union sizes / (B*H*n_tiles*m*n_sel), i.e. the
    K/V blocks a tile kernel loads relative to the per-token kernel (1.0 for m=1). No host sync."""
    sizes = tile_union_sizes(block_idx, m)
    return sizes.sum(dtype=torch.float32) / float(max(1, sizes.numel() * m * block_idx.shape[3]))


# ----------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _tile_rows(Q, PERM, b, h, n, T, sqb, sqt, sqh, offs_d, G: tl.constexpr, M: tl.constexpr, ROWS: tl.constexpr,
               D: tl.constexpr, HAS_PERM: tl.constexpr):
    """Rows of tile n: token index in the tile, absolute token (int64), query head, row validity, q. PERM
    (HAS_PERM; this (b, h)'s [T] of TileUnion.perm): the token at each position."""
    rows = tl.arange(0, ROWS)
    ti = rows // G
    tok = (n * M + ti).to(tl.int64)
    if HAS_PERM:
        tok = tl.load(PERM + tok, mask=(ti < M) & (tok < T), other=T).to(tl.int64)
    row_ok = (ti < M) & (tok < T)
    hq = (h * G + rows % G).to(tl.int64)
    ti = tl.where(row_ok, ti, 0)   # keeps the bit shift in range for padding rows
    q = tl.load(Q + b * sqb + tok[:, None] * sqt + hq[:, None] * sqh + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    return ti, tok, hq, row_ok, q


@triton.jit
def _tile_fwd_kernel(Q, K, V, UB, UBITS, USZ, PERM, O, LSE, sqb, sqt, sqh, skb, skt, skh, svb, svt, svh,
                     sob, sot, soh, T, H, NT, scale_log2,
                     G: tl.constexpr, M: tl.constexpr, ROWS: tl.constexpr, UW: tl.constexpr,
                     LSEL: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr,
                     BDV: tl.constexpr, BS: tl.constexpr, DOT_PREC: tl.constexpr,
                     HAS_PERM: tl.constexpr):
    n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    ti, tok, hq, row_ok, q = _tile_rows(Q, PERM + pid_bh.to(tl.int64) * T, b, h, n, T, sqb, sqt, sqh, offs_dk, G,
                                        M, ROWS, DK, HAS_PERM)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BDV], tl.float32)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    u_base = (pid_bh.to(tl.int64) * NT + n) * UW
    nu = tl.load(USZ + pid_bh.to(tl.int64) * NT + n)
    NSUB: tl.constexpr = (LSEL + BS - 1) // BS          # key tiles per block
    for it in range(nu * NSUB):                          # one flat loop: one key tile per pipeline stage
        j = tl.load(UB + u_base + it // NSUB).to(tl.int64)
        bits = tl.load(UBITS + u_base + it // NSUB)
        kk = (it % NSUB) * BS + tl.arange(0, BS)
        kp = j * LSEL + kk                                                  # [BS] key positions
        k_ok = (kk < LSEL) & (kp < T)
        k = tl.load(k_base + kp[:, None] * skt + offs_dk[None, :],
                    mask=k_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
        v = tl.load(v_base + kp[:, None] * svt + offs_dv[None, :],
                    mask=k_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
        member = (((bits >> ti) & 1) != 0) & row_ok                         # [ROWS] row's token chose j
        vis = member[:, None] & k_ok[None, :] & (kp[None, :] <= tok[:, None])
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2
        s = tl.where(vis, s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_PREC)
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    tl.store(O + b * sob + tok[:, None] * sot + hq[:, None] * soh + offs_dv[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(LSE + (b * T + tok) * (H * G) + hq, lse, mask=row_ok)


@triton.jit
def _tile_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, GATE, UB, UBITS, USZ, PERM, DQ, DQ_IN, GC, SLOT, GW, sgc,
                        gc_n, gc_h, gc_s, gw_t, gw_h, gw_g, gw_s,
                        sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sdb, sdt, sdh, sgt,
                        T, H, NT, scale_log2, scale,
                        G: tl.constexpr, M: tl.constexpr, ROWS: tl.constexpr, UW: tl.constexpr,
                        LSEL: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr,
                        BDV: tl.constexpr, BS: tl.constexpr, HAS_GATE: tl.constexpr, ACC_DQ: tl.constexpr,
                        DOT_PREC: tl.constexpr, HAS_GC: tl.constexpr, HAS_GW: tl.constexpr,
                        GC_ACC: tl.constexpr, GW_ACC: tl.constexpr, HAS_PERM: tl.constexpr):
    n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    ti, tok, hq, row_ok, q = _tile_rows(Q, PERM + pid_bh.to(tl.int64) * T, b, h, n, T, sqb, sqt, sqh, offs_dk, G,
                                        M, ROWS, DK, HAS_PERM)
    do = tl.load(DO + b * sdb + tok[:, None] * sdt + hq[:, None] * sdh + offs_dv[None, :],
                 mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    ridx = (b * T + tok) * (H * G) + hq
    lse = tl.load(LSE + ridx, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + ridx, mask=row_ok, other=0.0)
    if HAS_GATE:   # the branch's dO is gate * dO: applied to p (dS = g p (dP - delta)), as slc_bwd
        gate = tl.load(GATE + ridx * sgt, mask=row_ok, other=0.0).to(tl.float32)
    else:
        gate = tl.full([ROWS], 1.0, tl.float32)
    dq = tl.zeros([ROWS, BDK], tl.float32)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    u_base = (pid_bh.to(tl.int64) * NT + n) * UW
    nu = tl.load(USZ + pid_bh.to(tl.int64) * NT + n)
    NSUB: tl.constexpr = (LSEL + BS - 1) // BS
    for it in range(nu * NSUB):
        j = tl.load(UB + u_base + it // NSUB).to(tl.int64)
        bits = tl.load(UBITS + u_base + it // NSUB)
        kk = (it % NSUB) * BS + tl.arange(0, BS)
        kp = j * LSEL + kk
        k_ok = (kk < LSEL) & (kp < T)
        k = tl.load(k_base + kp[:, None] * skt + offs_dk[None, :],
                    mask=k_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
        v = tl.load(v_base + kp[:, None] * svt + offs_dv[None, :],
                    mask=k_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
        member = (((bits >> ti) & 1) != 0) & row_ok
        vis = member[:, None] & k_ok[None, :] & (kp[None, :] <= tok[:, None])
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2
        p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0) * gate[:, None]           # g * p
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)
    dq = dq * scale
    dq_off = ridx[:, None] * DK + offs_dk[None, :]                                  # contiguous dq
    dq_mask = row_ok[:, None] & (offs_dk[None, :] < DK)
    if ACC_DQ:
        dq += tl.load(DQ_IN + dq_off, mask=dq_mask, other=0.0)
    dq = add_q_terms(dq, GC, SLOT, GW, sgc, gc_n, gc_h, gc_s, gw_t, gw_h, gw_g, gw_s, b, tok * (H * G) + hq, row_ok,
                     dq_off, offs_dk, DK, HAS_GC, HAS_GW, GC_ACC, GW_ACC)
    tl.store(DQ + dq_off, dq.to(DQ.dtype.element_ty), mask=dq_mask)


# ----------------------------------------------------------------------------------------------
# launchers


def _meta(q: torch.Tensor, G: int, m: int, dk: int, dv: int, l_sel: int, un: TileUnion) -> dict:
    bdk, bdv = max(16, next_pow2(dk)), max(16, next_pow2(dv))
    return dict(G=G, M=m, UW=un.blocks.shape[-1], LSEL=l_sel, DK=dk, DV=dv, BDK=bdk, BDV=bdv,
                DOT_PREC=dot_precision(q.dtype, q.is_cuda))


def _keys(tn: TileTuning, keys: int, l_sel: int, bdk: int) -> int:
    return min(max(16, next_pow2(l_sel)), keys if bdk <= 128 else min(keys, tn.big_keys))


def _launch(tn: TileTuning, pair: tuple[TileLaunch, TileLaunch], rows: int, l_sel: int, bdk: int) -> dict:
    ln = tn.launch(pair, rows)
    return dict(BS=_keys(tn, ln.keys, l_sel, bdk), num_warps=ln.warps, num_stages=ln.stages)


def _union(block_idx: torch.Tensor, m: int, union: TileUnion | None) -> TileUnion:
    un = union if union is not None else tile_unions(block_idx, m)
    if un.blocks.shape[-1] != m * block_idx.shape[3]:
        raise ValueError(f"union: built for another tile size (width {un.blocks.shape[-1]}, "
                         f"m*n_sel = {m * block_idx.shape[3]}); pass tile_unions(block_idx, m)")
    return un


def slc_fwd_tile(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor, *,
                 l_sel: int, scale: float, m: int, union: TileUnion | None = None,
                 tuning: TileTuning | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                 combine=None, gluon_stages: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """As select.slc_fwd (q [B,T,HQ,dk], k/v [B,T,H,*], block_idx [B,T,H,n_sel] -> (o, lse fp32
    [B,T,HQ])) with one program per m consecutive tokens x G heads. union: tile_unions(block_idx, m)
    when the caller already has it (the backward reuses it). tuning: launch parameters (None: the
    preset of q's device; its m is not read, m is the argument). out: as slc_fwd's.
    combine: a function.Combine (the caller passes one under TileTuning.gluon_combine) whose out then holds
    the op's output: written by the Gluon forward's epilogue or, when that does not
    run, by combine.run. gluon_stages: the plan's Gluon forward (ring slots; 0: the Triton kernel)."""
    tn = tuning or TileTuning()
    B, T, HQ, dk = q.shape
    H, dv = k.shape[2], v.shape[3]
    G = HQ // H
    un = _union(block_idx, m, union)
    nt = un.size.shape[2]
    o, lse = out if out is not None else (torch.empty(B, T, HQ, dv, device=q.device, dtype=q.dtype),
                                          torch.empty(B, T, HQ, device=q.device, dtype=torch.float32))
    if gluon_stages and gtile_fwd(q, k, v, un, o, lse, m=m, scale=scale, stages=gluon_stages,
                                  combine=combine):
        return o, lse
    meta = _meta(q, G, m, dk, dv, l_sel, un)
    rows = max(16, next_pow2(m * G))
    _tile_fwd_kernel[(nt, B * H)](
        q, k, v, un.blocks, un.bits, un.size, un.perm_arg(), o, lse, q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2), T, H, nt, scale * LOG2E, ROWS=rows,
        HAS_PERM=un.perm is not None,
        **_launch(tn, tn.fwd, rows, l_sel, meta["BDK"]), **meta)
    if combine is not None:
        combine.run(o)
    return o, lse


def tile_dq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
            delta: torch.Tensor, gate: torch.Tensor | None, un: TileUnion, *, l_sel: int, scale: float, m: int,
            dq_in: torch.Tensor | None = None, dq_dtype: torch.dtype | None = None,
            tuning: TileTuning | None = None, dq_out: torch.Tensor | None = None,
            add: QAdd | None = None, gluon_stages: int = 0) -> torch.Tensor:
    """dq of slc_fwd_tile (plus dq_in and add's terms, qsum.py) on query tiles of m tokens walking the
    union `un`; dq_out as select.slc_dq's; gluon_stages: the plan's Gluon dq (0: Triton)."""
    tn = tuning or TileTuning()
    B, T, HQ, dk = q.shape
    H, dv = k.shape[2], v.shape[3]
    meta = _meta(q, HQ // H, m, dk, dv, l_sel, un)
    nt = un.size.shape[2]
    g_arg, lse, delta, strides = _bwd_args(q, k, v, do, lse, delta, gate)
    dq = dq_out if dq_out is not None else dq_buffer(q, dq_in, dq_dtype)
    if gluon_stages and gtile_dq(q, k, v, do, lse, delta, g_arg, un, dq, dq_in, strides[-1], m=m, scale=scale,
                                 stages=gluon_stages, has_gate=gate is not None, add=add):
        return dq
    rows = max(16, next_pow2(m * HQ // H))
    add_args, add_kw = q_add_args(add, dq)
    _tile_bwd_dq_kernel[(nt, B * H)](
        q, k, v, do, lse, delta, g_arg, un.blocks, un.bits, un.size, un.perm_arg(), dq,
        dq if dq_in is None else dq_in, *add_args, *strides, T, H, nt, scale * LOG2E, scale, ROWS=rows,
        HAS_GATE=gate is not None, HAS_PERM=un.perm is not None,
        ACC_DQ=dq_in is not None, **add_kw, **_launch(tn, tn.dq, rows, l_sel, meta["BDK"]), **meta)
    return dq


def slc_bwd_tile(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor, do: torch.Tensor,
                 lse: torch.Tensor, delta: torch.Tensor, gate: torch.Tensor | None, *, l_sel: int, scale: float,
                 m: int, chunk: int = 1024, dq_in: torch.Tensor | None = None, dq_dtype: torch.dtype | None = None,
                 union: TileUnion | None = None, tuning: TileTuning | None = None,
                 select: SelectTuning | None = None, later: list | None = None, dq_gluon: int = 0, walk=None
                 ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Gradients of slc_fwd_tile with select.slc_bwd's contract: do is the op's dO (gate applied to p
    inside), delta = rowsum(dO * o_slc) fp32 [B,T,HQ], gate [B,T,HQ] view or None, dq_in accumulated
    (in place when dq_dtype is fp32), chunk = queries per dK/dV program. dq on the tiles (dq_gluon: the
    plan's Gluon dq slots), dK/dV by select.py's walk over each block's tokens (walk: the plan's).
    tuning / select: launch parameters of the tile kernels / of the walk. later: append the dq kernel
    there as a task (qsum.DeferredDq) and return None for dq."""
    tn = tuning or TileTuning()
    un = _union(block_idx, m, union)
    kw = dict(l_sel=l_sel, scale=scale, m=m, dq_in=dq_in, dq_dtype=dq_dtype, tuning=tn, gluon_stages=dq_gluon)
    if later is None:
        dq = tile_dq(q, k, v, do, lse, delta, gate, un, **kw)
    else:
        later.append(lambda out, add: tile_dq(q, k, v, do, lse, delta, gate, un, **kw, dq_out=out, add=add))
        dq = None
    return (dq, *slc_dkdv(q, k, v, block_idx, do, lse, delta, gate, l_sel=l_sel, scale=scale, chunk=chunk,
                          tuning=select or SelectTuning(), walk=walk))
