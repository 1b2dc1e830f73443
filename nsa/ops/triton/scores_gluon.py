"""Block scores + top-n with the score pass in Gluon (Triton's explicit-layout dialect) for Hopper.

scores.select_blocks' kernel runs each chunk as a dependent chain (load K~, q K~, exp, the fp16-split map onto
selection blocks, head sum, ranking) in two 8-warp programs per SM; its K~ loads stay synchronous because the
relay's CTA barriers keep Triton's pipeliner off the loop. Here the same arithmetic
runs in two kernels:

- the score pass (Gluon, warp-specialized): one program per (16 tokens, b, kv head), as the Triton tile; a
  producer warp fills a ring of K~ chunks by TMA ([64 compressed tokens, d] boxes, empty / full mbarriers per
  slot) and four consumer warpgroups, each the 64 rows (4 tokens x 16 heads) of 4 tokens, walk it without waiting
  for each other: q K~ and the two fp16 map products on wgmma, the causal mask only on chunks that need it (the
  Triton kernel's three loops), the head sum in the wgmma accumulator's own layout. Each chunk's block scores
  [16 tokens, 16 blocks] fp32 go to a per-program scratch (chunks x 1 KB: 1.2 GB at T=64k, H=4; calls that would
  need more than MAX_SCRATCH_BYTES keep the Triton kernel);
- the ranking (Triton, scores.rank_stored): one program per tile ranks the stored chunks in order with
  scores._merge_chunk and places the forced blocks as scores._select_kernel does (scores.store_blocks).

The scores are the Triton kernel's operation for operation (the same products, the same head-sum order in the
same accumulator layout), so block_idx is the same bit for bit (GPU test). Faster at long T only
(docs/kernels.md, scores); ScoreTuning.gluon_min_t chooses where.

Eligible (nsa/ops/plan.py, _scores_gluon_ok): CUDA compute capability 9.x with Gluon, bf16 / fp16, the paper's geometry (G = 16
query heads per KV head, d_k = 128, l = 32, d = 16, l_sel = 64, n_sel <= 16), K~ addressable as 2-D [B*N, H*d_k]
with 16-byte aligned rows. Everything else, and every call on a device where the kernel once failed to build or
launch, runs the Triton kernel (counted, warned once). tests/test_triton_scores.py compiles it for sm_90 on the CPU
and checks the ranking kernel in the interpreter; the GPU test compares block_idx with the Triton kernel's.
"""
from __future__ import annotations

import functools
import warnings
from types import MappingProxyType

import torch
import triton

from ..common import LOG2E, SCORE_MAP_SHIFT
from .. import fallbacks
from ..fallbacks import count_fallback

# the shape the score pass is written for (read-only: ops keep no public mutable module state)
GEOMETRY = MappingProxyType(dict(G=16, dk=128, l=32, d=16, l_sel=64))
TILE = 16          # tokens per program: four consumer warpgroups of 4 tokens
CHUNK = 64         # compressed tokens per chunk (one TMA box)
NBJ = 15           # selection blocks a chunk covers: (CHUNK - l/d + 1) // (l_sel/d)
NBJ_PAD = 16
STAGES = 4         # K~ ring slots (16 KB each)
# the stored scores grow as T^2 (tiles x chunks): past this the Triton kernel, which stores none (1.2 GB at T=64k,
# B=1, H=4; 4.7 GB at 128k)
MAX_SCRATCH_BYTES = 2 << 30


def scratch_bytes(B: int, T: int, H: int, l_sel: int) -> int:
    """Bytes of the stored chunk scores of a call: [B*H, tiles, chunks, TILE, NBJ_PAD] fp32."""
    return B * H * triton.cdiv(T, TILE) * (triton.cdiv(triton.cdiv(T, l_sel), NBJ) + 1) * TILE * NBJ_PAD * 4


def score_pass(q: torch.Tensor, k_cmp: torch.Tensor, lse_cmp: torch.Tensor, *, l_sel: int,
               scale: float) -> tuple[torch.Tensor, int, int] | None:
    """For a call the plan gives the Gluon score pass: every chunk's block scores (scr [B*H, tiles, chunks, TILE, NBJ_PAD] fp32,
    flat), the tile count and the chunks per tile, for scores.rank_stored; None when the Gluon kernel failed to
    build or launch (then the Triton kernel takes this device from now on)."""
    B, T, HQ, dk = q.shape
    N, H = k_cmp.shape[1], k_cmp.shape[2]
    n_tiles = triton.cdiv(T, TILE)
    nchmax = triton.cdiv(triton.cdiv(T, l_sel), NBJ) + 1
    scr = torch.empty(scratch_bytes(B, T, H, l_sel) // 4, device=q.device, dtype=torch.float32)
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        lay = gl.NVMMASharedLayout.get_default_for([CHUNK, dk], gl.bfloat16 if q.dtype == torch.bfloat16
                                                   else gl.float16)
        kd = TensorDescriptor(k_cmp, [B * N, H * dk], [k_cmp.stride(1), 1], [CHUNK, dk], lay)
        _kernel()[(n_tiles, B * H)](q, kd, lse_cmp.contiguous(), scr, T, N, H, n_tiles, nchmax, scale * LOG2E,
                                    q.stride(0), q.stride(1), q.stride(2), num_warps=4)
    except Exception as exc:  # noqa: BLE001 - Gluon is experimental: any failure means the Triton kernel
        if q.is_cuda and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise
        why = f"the Gluon score pass failed: {type(exc).__name__}: {str(exc)[:160]}"
        fallbacks.refuse("gluon_scores", (str(q.device),), why)   # the planner plans it away from now on
        count_fallback("scores_gluon->triton")
        warnings.warn(f"block selection: {why}; using the Triton kernel from now on", RuntimeWarning, stacklevel=4)
        return None
    return scr, n_tiles, nchmax


@functools.lru_cache(maxsize=None)
def _kernel():
    """The @gluon.jit score pass, built on first use (CPU-only runs never import Gluon). Its sizes are this
    factory's constants: warp_specialize hands its partitions tensors and scalars only."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    G = gl.constexpr(GEOMETRY["G"])
    M = gl.constexpr(TILE // 4)          # tokens per consumer warpgroup: 4 x 16 heads = 64 rows
    NC = gl.constexpr(4)
    BN = gl.constexpr(CHUNK)
    NB = gl.constexpr(NBJ)
    NBP = gl.constexpr(NBJ_PAD)
    D = gl.constexpr(GEOMETRY["dk"])
    R = gl.constexpr(GEOMETRY["l_sel"] // GEOMETRY["d"])      # stride chunks per selection block
    LC = gl.constexpr(GEOMETRY["l"] // GEOMETRY["d"])         # stride chunks per compression block
    L_CMP = gl.constexpr(GEOMETRY["l"])
    STRIDE = gl.constexpr(GEOMETRY["d"])
    LSEL = gl.constexpr(GEOMETRY["l_sel"])
    NS = gl.constexpr(STAGES)
    SHIFT = gl.constexpr(float(SCORE_MAP_SHIFT))            # p is formed as 2**SHIFT p (as scores.py's),
    CSCALE = gl.constexpr(2.0 ** -SCORE_MAP_SHIFT)          # the counts as cnt * 2**-SHIFT

    @gluon.jit
    def _producer(kc_desc, k_smem, full, empty, n_ch, row_b, h):
        """Chunk c's K~ rows (compressed tokens c*NB*R - (LC-1) ...; rows before the batch's first or past its
        last are masked by the consumers) into slot c % NS once every consumer released it."""
        for c in range(n_ch):
            s = c % NS
            mbarrier.wait(empty.index(s), phase=((c // NS) & 1) ^ 1)
            mbarrier.expect(full.index(s), kc_desc.block_type.nbytes)
            tma_load(kc_desc, [row_b + c * NB * R - (LC - 1), h * D], full.index(s), k_smem.index(s))

    @gluon.jit
    def _chunks(c_lo, c_hi, MASKED: gl.constexpr, qa, lse2, tok, kk, k_smem, full, empty, c_smem, scr, w, N,
                scale_log2, s_zero, y_zero, ot, oj):
        """Chunks c_lo .. c_hi-1 of one consumer: scores._scan's arithmetic (MASKED as there), the head sum
        in the accumulator's layout, the chunk's [M, NBP] scores stored."""
        so: gl.constexpr = ot.type.layout
        mma_y: gl.constexpr = y_zero.type.layout
        for c in range(c_lo, c_hi):
            slot = c % NS
            mbarrier.wait(full.index(slot), phase=(c // NS) & 1)
            xs = warpgroup_mma(qa, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            xs = warpgroup_mma_wait(num_outstanding=0, deps=(xs, ))
            mbarrier.arrive(empty.index(slot), count=1)
            if MASKED:
                ki = c * NB * R - (LC - 1) + kk
                vis = ((ki * STRIDE + L_CMP - 1)[None, :] <= tok[:, None]) & ((ki >= 0) & (ki < N))[None, :]
                p = gl.where(vis, gl.exp2(xs * scale_log2 - lse2[:, None]), 0.0)
            else:
                p = gl.exp2(xs * scale_log2 - lse2[:, None])
            # p is 2**12 p (lse2): hi + lo to ~22 bits, both against cnt * 2**-12 (exact in fp16), one wait
            hi = p.to(gl.float16)
            lo = (p - hi.to(gl.float32)).to(gl.float16)
            la = gl.convert_layout(lo, gl.DotOperandLayout(operand_index=0, parent=mma_y, k_width=2))
            ha = gl.convert_layout(hi, gl.DotOperandLayout(operand_index=0, parent=mma_y, k_width=2))
            y = warpgroup_mma(la, c_smem, y_zero, use_acc=False, is_async=True)
            y = warpgroup_mma(ha, c_smem, y, is_async=True)
            y = warpgroup_mma_wait(num_outstanding=0, deps=(y, ))
            sc = gl.convert_layout(gl.sum(gl.reshape(y, [M, G, NBP]), axis=1), so)   # [M tokens, NBP blocks]
            gl.store(scr + c * (M * NC * NBP) + (w * M + ot) * NBP + oj, sc)

    @gluon.jit
    def _consumer(Q, LSE, scr, k_smem, full, empty, c_smem, b, h, tile, w, n_ch, T, N, H, scale_log2, sqb, sqt,
                  sqh):
        """Consumer w: tokens tile*M*NC + w*M ... (rows token-major, row = ti * G + g); chunk ranges as
        scores._select_kernel's (masked, unmasked, masked), from its own first token."""
        ROWS: gl.constexpr = G * M
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BN, 16])
        mma_y: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, NBP, 16])
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        t0 = tile * (M * NC) + w * M
        r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, ld))
        cq = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        t = (t0 + r // G).to(gl.int64)
        x = gl.load(Q + b.to(gl.int64) * sqb + t[:, None] * sqt + (h * G + r % G)[:, None] * sqh + cq[None, :],
                    mask=(t < T)[:, None], other=0.0)
        qa = gl.convert_layout(x, gl.DotOperandLayout(operand_index=0, parent=mma_s, k_width=2))
        rs = gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma_s))
        tok = t0 + rs // G
        row_ok = tok < T
        lse = gl.load(LSE + (b.to(gl.int64) * T + tok) * (H * G) + h * G + rs % G, mask=row_ok, other=0.0)
        # +inf for padding rows and rows that see no compressed token: their p is exactly 0; 2**12 p for the map
        lse2 = gl.where(row_ok & (lse > float("-inf")), lse * 1.4426950408889634 - SHIFT, float("inf"))
        kk = gl.arange(0, BN, layout=gl.SliceLayout(0, mma_s))
        s_zero = gl.zeros([ROWS, BN], gl.float32, layout=mma_s)
        y_zero = gl.zeros([ROWS, NBP], gl.float32, layout=mma_y)
        L3: gl.constexpr = gl.BlockedLayout([1, 16, 1], [4, 1, 8], [1, 1, 4], [2, 1, 0])
        so: gl.constexpr = gl.SliceLayout(1, L3)
        ot = gl.arange(0, M, layout=gl.SliceLayout(1, so))[:, None]
        oj = gl.arange(0, NBP, layout=gl.SliceLayout(0, so))[None, :]
        nv_first = gl.where(t0 >= L_CMP - 1, (t0 - (L_CMP - 1)) // STRIDE + 1, 0)
        c_full = gl.minimum(gl.cdiv(gl.maximum(nv_first - BN + LC, 0), NB * R), n_ch)
        C_LO: gl.constexpr = (LC - 1 + NB * R - 1) // (NB * R)   # first chunk whose tokens are all >= 0
        _chunks(0, gl.minimum(C_LO, n_ch), True, qa, lse2, tok, kk, k_smem, full, empty, c_smem, scr, w, N,
                scale_log2, s_zero, y_zero, ot, oj)
        _chunks(C_LO, c_full, False, qa, lse2, tok, kk, k_smem, full, empty, c_smem, scr, w, N,
                scale_log2, s_zero, y_zero, ot, oj)
        _chunks(gl.maximum(C_LO, c_full), n_ch, True, qa, lse2, tok, kk, k_smem, full, empty, c_smem, scr, w, N,
                scale_log2, s_zero, y_zero, ot, oj)

    @gluon.jit
    def _score_pass(Q, kc_desc, LSE, SCR, T, N, H, n_tiles, nchmax, scale_log2, sqb, sqt, sqh,
                    num_warps: gl.constexpr):
        pid_m = n_tiles - 1 - gl.program_id(0)          # latest (most chunks) tiles first
        pid_bh = gl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        t_last = gl.minimum(pid_m * (M * NC) + M * NC - 1, T - 1)
        n_ch = gl.cdiv(gl.maximum(t_last // LSEL - 1, 0), NB)     # candidates are blocks <= cur - 2
        # overlap counts of chunk-relative compressed token r with block j0 + c: [BN, NBP], wgmma's B operand
        cl: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [num_warps, 1], [1, 0])
        rr = gl.arange(0, BN, layout=gl.SliceLayout(1, cl))[:, None]
        cc = gl.arange(0, NBP, layout=gl.SliceLayout(0, cl))[None, :]
        ov = gl.minimum(rr, cc * R + R - 1) - gl.maximum(rr - (LC - 1), cc * R) + 1
        cnt = (gl.where((ov > 0) & (cc < NB), ov, 0).to(gl.float32) * CSCALE).to(gl.float16)
        c_smem = gl.allocate_shared_memory(gl.float16, [BN, NBP],
                                           gl.NVMMASharedLayout.get_default_for([BN, NBP], gl.float16), cnt)
        k_smem = gl.allocate_shared_memory(kc_desc.dtype, [NS, BN, D], kc_desc.layout)
        full = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NS):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=NC)
        scr = SCR + (pid_bh.to(gl.int64) * n_tiles + pid_m) * (nchmax * M * NC * NBP)
        ca = (Q, LSE, scr, k_smem, full, empty, c_smem, b, h, pid_m)
        cb = (n_ch, T, N, H, scale_log2, sqb, sqt, sqh)
        # consumers 1-3 and the producer as workers (consumer 0 is the default partition); worker registers
        # 112 / 24 leave the default partition ~170 and nothing spills (sm_90, Triton 3.6)
        gl.warp_specialize([(_consumer, ca + (pid_m * 0, ) + cb), (_consumer, ca + (pid_m * 0 + 1, ) + cb),
                            (_consumer, ca + (pid_m * 0 + 2, ) + cb), (_consumer, ca + (pid_m * 0 + 3, ) + cb),
                            (_producer, (kc_desc, k_smem, full, empty, n_ch, b * N, h))], [4, 4, 4, 1],
                           [112, 112, 112, 24])
        for i in gl.static_range(NS):
            mbarrier.invalidate(full.index(i))
            mbarrier.invalidate(empty.index(i))

    return _score_pass
