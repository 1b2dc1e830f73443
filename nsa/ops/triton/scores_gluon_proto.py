"""Experiment: block scores in Gluon (TMA ring for K~, wgmma q K~ and the fp16-split map, head sum through shared
memory), stored per chunk; the ranking in a Triton kernel over the stored chunks (scores._merge_chunk, the same
tail as scores._select_kernel). Paper shape only: G=16, d=128, l=32, d=16, l_sel=64, tiles of 4 tokens."""
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from nsa.ops.common import LOG2E
from nsa.ops.triton.scores import GRID_BITS, _bitonic_sort, _merge_chunk

tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

BTK = 4        # tokens per tile
NBJ = 15       # selection blocks per chunk
NBJP = 16
BN = 64        # compressed tokens per chunk


@gluon.jit
def _gscore(Q, kc_desc, LSE, SCR, T, N, H, n_tiles, nchmax, scale_log2, sqb, sqt, sqh,
            G: gl.constexpr, M: gl.constexpr, D: gl.constexpr, BNK: gl.constexpr, NBJC: gl.constexpr,
            NBJ_PAD: gl.constexpr, R: gl.constexpr, LC: gl.constexpr, L_CMP: gl.constexpr, STRIDE: gl.constexpr,
            LSEL: gl.constexpr, NSTAGE: gl.constexpr, num_warps: gl.constexpr):
    ROWS: gl.constexpr = G * M
    pid_m = n_tiles - 1 - gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BNK, 16])
    mma_y: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, NBJ_PAD, 16])
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, ld))
    cq = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
    t = (pid_m * M + r // G).to(gl.int64)
    x = gl.load(Q + b.to(gl.int64) * sqb + t[:, None] * sqt + (h * G + r % G)[:, None] * sqh + cq[None, :],
                mask=(t < T)[:, None], other=0.0)
    qa = gl.convert_layout(x, gl.DotOperandLayout(operand_index=0, parent=mma_s, k_width=2))
    rs = gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma_s))
    tok = pid_m * M + rs // G
    row_ok = tok < T
    lse = gl.load(LSE + (b.to(gl.int64) * T + tok) * (H * G) + h * G + rs % G, mask=row_ok, other=0.0)
    lse2 = gl.where(row_ok & (lse > float("-inf")), lse * 1.4426950408889634, float("inf"))
    t_last = gl.minimum(pid_m * M + M - 1, T - 1)
    n_ch = gl.cdiv(gl.maximum(t_last // LSEL - 1, 0), NBJC)
    # the band map cnt [BN, NBJ_PAD] fp16 in shared memory (wgmma's B operand)
    cl: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [num_warps, 1], [1, 0])
    rr = gl.arange(0, BNK, layout=gl.SliceLayout(1, cl))[:, None]
    cc = gl.arange(0, NBJ_PAD, layout=gl.SliceLayout(0, cl))[None, :]
    ov = gl.minimum(rr, cc * R + R - 1) - gl.maximum(rr - (LC - 1), cc * R) + 1
    cnt = gl.where((ov > 0) & (cc < NBJC), ov, 0).to(gl.float16)
    c_smem = gl.allocate_shared_memory(gl.float16, [BNK, NBJ_PAD],
                                       gl.NVMMASharedLayout.get_default_for([BNK, NBJ_PAD], gl.float16), cnt)
    y_smem = gl.allocate_shared_memory(gl.float32, [ROWS, NBJ_PAD], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    k_smem = gl.allocate_shared_memory(kc_desc.dtype, [NSTAGE, BNK, D], kc_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NSTAGE):
        mbarrier.init(bars.index(i), count=1)
    row_b = b * N
    for i in gl.static_range(NSTAGE - 1):
        if i < n_ch:
            mbarrier.expect(bars.index(i), kc_desc.block_type.nbytes)
            tma_load(kc_desc, [row_b + i * NBJC * R - (LC - 1), h * D], bars.index(i), k_smem.index(i))
    kk = gl.arange(0, BNK, layout=gl.SliceLayout(0, mma_s))
    s_zero = gl.zeros([ROWS, BNK], gl.float32, layout=mma_s)
    y_zero = gl.zeros([ROWS, NBJ_PAD], gl.float32, layout=mma_y)
    L3: gl.constexpr = gl.BlockedLayout([1, G // 2, 1], [1, 2, 16], [num_warps, 1, 1], [2, 1, 0])
    so: gl.constexpr = gl.SliceLayout(1, L3)
    ot = gl.arange(0, M, layout=gl.SliceLayout(1, so))[:, None]
    oj = gl.arange(0, NBJ_PAD, layout=gl.SliceLayout(0, so))[None, :]
    scr = SCR + (pid_bh.to(gl.int64) * n_tiles + pid_m) * (nchmax * M * NBJ_PAD)
    for c in range(n_ch):
        nxt = c + NSTAGE - 1
        if nxt < n_ch:
            cta_barrier()
            s2 = nxt % NSTAGE
            mbarrier.expect(bars.index(s2), kc_desc.block_type.nbytes)
            tma_load(kc_desc, [row_b + nxt * NBJC * R - (LC - 1), h * D], bars.index(s2), k_smem.index(s2))
        slot = c % NSTAGE
        mbarrier.wait(bars.index(slot), phase=(c // NSTAGE) & 1)
        xs = warpgroup_mma(qa, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        xs = warpgroup_mma_wait(num_outstanding=0, deps=(xs, ))
        ki = c * NBJC * R - (LC - 1) + kk
        vis = ((ki * STRIDE + L_CMP - 1)[None, :] <= tok[:, None]) & ((ki >= 0) & (ki < N))[None, :]
        p = gl.where(vis, gl.exp2(xs * scale_log2 - lse2[:, None]), 0.0)
        hi = p.to(gl.float16)
        lo = ((p - hi.to(gl.float32)) * 4096.0).to(gl.float16)
        la = gl.convert_layout(lo, gl.DotOperandLayout(operand_index=0, parent=mma_y, k_width=2))
        ha = gl.convert_layout(hi, gl.DotOperandLayout(operand_index=0, parent=mma_y, k_width=2))
        y = warpgroup_mma(la, c_smem, y_zero, use_acc=False, is_async=True)
        y = warpgroup_mma_wait(num_outstanding=0, deps=(y, ))
        y = y * (1.0 / 4096.0)
        y = warpgroup_mma(ha, c_smem, y, is_async=True)
        y = warpgroup_mma_wait(num_outstanding=0, deps=(y, ))
        cta_barrier()
        y_smem.store(y)
        cta_barrier()
        s = gl.sum(y_smem.reshape([M, G, NBJ_PAD]).load(L3), axis=1)      # [M, NBJ_PAD]: the head sum
        gl.store(scr + c * (M * NBJ_PAD) + ot * NBJ_PAD + oj, s)
    for i in gl.static_range(NSTAGE):
        mbarrier.invalidate(bars.index(i))


@triton.jit
def _rank_kernel(SCR, BI, sbb, sbt, sbh, T, H, n_tiles, nchmax, G: tl.constexpr, L_CMP: tl.constexpr,
                 STRIDE: tl.constexpr, LSEL: tl.constexpr, NSEL: tl.constexpr, BT: tl.constexpr, NBJ: tl.constexpr,
                 NBJ_PAD: tl.constexpr, KR: tl.constexpr, LOGKR: tl.constexpr, LOGNB: tl.constexpr, IB: tl.constexpr,
                 KEY64: tl.constexpr):
    pid_m = n_tiles - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    ttok = pid_m * BT + tl.arange(0, BT)
    cur = ttok // LSEL
    t_last = tl.minimum(pid_m * BT + BT - 1, T - 1)
    n_ch = tl.cdiv(tl.maximum(t_last // LSEL - 1, 0), NBJ)
    scr = SCR + (pid_bh.to(tl.int64) * n_tiles + pid_m) * (nchmax * BT * NBJ_PAD)
    r_ = tl.arange(0, BT)[:, None] * NBJ_PAD + tl.arange(0, NBJ_PAD)[None, :]
    if KEY64:
        run = tl.full([BT, KR], -1, tl.int64)
    else:
        run = tl.full([BT, KR], -1, tl.int32)
    for c in range(0, n_ch):
        s = tl.load(scr + c * (BT * NBJ_PAD) + r_)
        run = _merge_chunk(run, s, c * NBJ, cur, BT, NBJ, NBJ_PAD, KR, LOGKR, LOGNB, IB, KEY64,
                           G, L_CMP, STRIDE, False, scr, False)
    pos = tl.arange(0, KR)[None, :]
    nf = tl.minimum(cur + 1, 3)[:, None]
    base = tl.maximum(NSEL - nf, 0)
    kf = pos - base
    jrun = (((1 << IB) - 1) - (run & ((1 << IB) - 1))).to(tl.int32)
    big = 2147483647
    val = tl.where((pos < base) & (run >= 0), jrun, big)
    forced = tl.where(kf == 0, cur[:, None], tl.where(kf == 1, 0, cur[:, None] - 1))
    val = tl.where((kf >= 0) & (kf < tl.minimum(nf, NSEL)), forced, val)
    val = _bitonic_sort(val, BT, KR, LOGKR, 0)
    out = tl.where(val == big, -1, val).to(tl.int64)
    tl.store(BI + b * sbb + ttok.to(tl.int64)[:, None] * sbt + h * sbh + pos, out,
             mask=(ttok < T)[:, None] & (pos < NSEL))


def select_blocks_g(q, k_cmp, lse_cmp, *, l, d, l_sel, n_sel, scale, stages=3, rank_warps=1, only=None, M=4):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    B, T, HQ, dk = q.shape
    N, H = k_cmp.shape[1], k_cmp.shape[2]
    G = HQ // H
    assert G == 16 and dk == 128 and l == 32 and d == 16 and l_sel == 64
    R, LC = l_sel // d, l // d
    nsb = triton.cdiv(T, l_sel)
    n_tiles = triton.cdiv(T, M)
    nchmax = triton.cdiv(nsb, NBJ) + 1
    scr = torch.empty(B * H * n_tiles * nchmax * M * NBJP, device=q.device, dtype=torch.float32)
    lay = gl.NVMMASharedLayout.get_default_for([BN, dk], gl.bfloat16)
    kd = TensorDescriptor(k_cmp, [B * N, H * dk], [k_cmp.stride(1), 1], [BN, dk], lay)
    if only != "rank":
        _gscore[(n_tiles, B * H)](q, kd, lse_cmp.contiguous(), scr, T, N, H, n_tiles, nchmax, scale * LOG2E,
                                  q.stride(0), q.stride(1), q.stride(2), G=G, M=M, D=dk, BNK=BN, NBJC=NBJ,
                                  NBJ_PAD=NBJP, R=R, LC=LC, L_CMP=l, STRIDE=d, LSEL=l_sel, NSTAGE=stages, num_warps=M)
    bi = torch.empty(B, T, H, n_sel, device=q.device, dtype=torch.int64)
    if only == "score":
        return bi
    kr = triton.next_power_of_2(max(n_sel, 2))
    ib = max(1, (nsb - 1).bit_length())
    _rank_kernel[(n_tiles, B * H)](scr, bi, bi.stride(0), bi.stride(1), bi.stride(2), T, H, n_tiles, nchmax, G=G,
                                   L_CMP=l, STRIDE=d, LSEL=l_sel, NSEL=n_sel, BT=M, NBJ=NBJ, NBJ_PAD=NBJP, KR=kr,
                                   LOGKR=kr.bit_length() - 1, LOGNB=NBJP.bit_length() - 1, IB=ib,
                                   KEY64=GRID_BITS + ib > 31, num_warps=rank_warps)
    return bi


# ---------------- warp-specialized variant: 4 consumer warpgroups (4 tokens each) + a producer warp
import os as _os
WG = gl.constexpr(16)
WM = gl.constexpr(4)       # tokens per consumer
WNC = gl.constexpr(4)      # consumers
WBN = gl.constexpr(64)
WNBJ = gl.constexpr(15)
WNBJP = gl.constexpr(16)
WD = gl.constexpr(128)
WR = gl.constexpr(4)
WLC = gl.constexpr(2)
WLCMP = gl.constexpr(32)
WSTR = gl.constexpr(16)
WLSEL = gl.constexpr(64)
WNS = gl.constexpr(int(_os.environ.get("GS_STAGES", "4")))


@gluon.jit
def _ws_prod(kc_desc, k_smem, full, empty, n_ch, row_b, h):
    for c in range(n_ch):
        s = c % WNS
        mbarrier.wait(empty.index(s), phase=((c // WNS) & 1) ^ 1)
        mbarrier.expect(full.index(s), kc_desc.block_type.nbytes)
        tma_load(kc_desc, [row_b + c * WNBJ * WR - (WLC - 1), h * WD], full.index(s), k_smem.index(s))


@gluon.jit
def _ws_cons(Q, LSE, scr, k_smem, full, empty, c_smem, b, h, tile, w, n_ch, T, N, H, scale_log2, sqb, sqt, sqh):
    ROWS: gl.constexpr = WG * WM
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, WBN, 16])
    mma_y: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, WNBJP, 16])
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    t0 = tile * (WM * WNC) + w * WM
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, ld))
    cq = gl.arange(0, WD, layout=gl.SliceLayout(0, ld))
    t = (t0 + r // WG).to(gl.int64)
    x = gl.load(Q + b.to(gl.int64) * sqb + t[:, None] * sqt + (h * WG + r % WG)[:, None] * sqh + cq[None, :],
                mask=(t < T)[:, None], other=0.0)
    qa = gl.convert_layout(x, gl.DotOperandLayout(operand_index=0, parent=mma_s, k_width=2))
    rs = gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma_s))
    tok = t0 + rs // WG
    row_ok = tok < T
    lse = gl.load(LSE + (b.to(gl.int64) * T + tok) * (H * WG) + h * WG + rs % WG, mask=row_ok, other=0.0)
    lse2 = gl.where(row_ok & (lse > float("-inf")), lse * 1.4426950408889634, float("inf"))
    kk = gl.arange(0, WBN, layout=gl.SliceLayout(0, mma_s))
    s_zero = gl.zeros([ROWS, WBN], gl.float32, layout=mma_s)
    y_zero = gl.zeros([ROWS, WNBJP], gl.float32, layout=mma_y)
    yb: gl.constexpr = gl.BlockedLayout([16, 1], [4, 8], [1, 4], [0, 1])
    L3: gl.constexpr = gl.BlockedLayout([1, 16, 1], [4, 1, 8], [1, 1, 4], [2, 1, 0])
    so: gl.constexpr = gl.SliceLayout(1, L3)
    ot = gl.arange(0, WM, layout=gl.SliceLayout(1, so))[:, None]
    oj = gl.arange(0, WNBJP, layout=gl.SliceLayout(0, so))[None, :]
    for c in range(n_ch):
        slot = c % WNS
        mbarrier.wait(full.index(slot), phase=(c // WNS) & 1)
        xs = warpgroup_mma(qa, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        xs = warpgroup_mma_wait(num_outstanding=0, deps=(xs, ))
        mbarrier.arrive(empty.index(slot), count=1)
        ki = c * WNBJ * WR - (WLC - 1) + kk
        vis = ((ki * WSTR + WLCMP - 1)[None, :] <= tok[:, None]) & ((ki >= 0) & (ki < N))[None, :]
        p = gl.where(vis, gl.exp2(xs * scale_log2 - lse2[:, None]), 0.0)
        hi = p.to(gl.float16)
        lo = ((p - hi.to(gl.float32)) * 4096.0).to(gl.float16)
        la = gl.convert_layout(lo, gl.DotOperandLayout(operand_index=0, parent=mma_y, k_width=2))
        ha = gl.convert_layout(hi, gl.DotOperandLayout(operand_index=0, parent=mma_y, k_width=2))
        y = warpgroup_mma(la, c_smem, y_zero, use_acc=False, is_async=True)
        y = warpgroup_mma_wait(num_outstanding=0, deps=(y, ))
        y = y * (1.0 / 4096.0)
        y = warpgroup_mma(ha, c_smem, y, is_async=True)
        y = warpgroup_mma_wait(num_outstanding=0, deps=(y, ))
        y3 = gl.convert_layout(gl.reshape(gl.convert_layout(y, yb), [WM, WG, WNBJP]), L3)
        s = gl.sum(y3, axis=1)
        gl.store(scr + c * (WM * WNC * WNBJP) + (w * WM + ot) * WNBJP + oj, s)


@gluon.jit
def _gscore_ws(Q, kc_desc, LSE, SCR, T, N, H, n_tiles, nchmax, scale_log2, sqb, sqt, sqh, num_warps: gl.constexpr):
    pid_m = n_tiles - 1 - gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    t_last = gl.minimum(pid_m * (WM * WNC) + WM * WNC - 1, T - 1)
    n_ch = gl.cdiv(gl.maximum(t_last // WLSEL - 1, 0), WNBJ)
    cl: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [num_warps, 1], [1, 0])
    rr = gl.arange(0, WBN, layout=gl.SliceLayout(1, cl))[:, None]
    cc = gl.arange(0, WNBJP, layout=gl.SliceLayout(0, cl))[None, :]
    ov = gl.minimum(rr, cc * WR + WR - 1) - gl.maximum(rr - (WLC - 1), cc * WR) + 1
    cnt = gl.where((ov > 0) & (cc < WNBJ), ov, 0).to(gl.float16)
    c_smem = gl.allocate_shared_memory(gl.float16, [WBN, WNBJP],
                                       gl.NVMMASharedLayout.get_default_for([WBN, WNBJP], gl.float16), cnt)
    k_smem = gl.allocate_shared_memory(kc_desc.dtype, [WNS, WBN, WD], kc_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [WNS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [WNS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(WNS):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=WNC)
    scr = SCR + (pid_bh.to(gl.int64) * n_tiles + pid_m) * (nchmax * WM * WNC * WNBJP)
    ca = (Q, LSE, scr, k_smem, full, empty, c_smem, b, h, pid_m)
    cb = (n_ch, T, N, H, scale_log2, sqb, sqt, sqh)
    gl.warp_specialize([(_ws_cons, ca + (pid_m * 0, ) + cb), (_ws_cons, ca + (pid_m * 0 + 1, ) + cb),
                        (_ws_cons, ca + (pid_m * 0 + 2, ) + cb), (_ws_cons, ca + (pid_m * 0 + 3, ) + cb),
                        (_ws_prod, (kc_desc, k_smem, full, empty, n_ch, b * N, h))], [4, 4, 4, 1],
                       [112, 112, 112, 24])
    for i in gl.static_range(WNS):
        mbarrier.invalidate(full.index(i))
        mbarrier.invalidate(empty.index(i))


def select_blocks_ws(q, k_cmp, lse_cmp, *, l, d, l_sel, n_sel, scale, only=None, rank_warps=1):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    B, T, HQ, dk = q.shape
    N, H = k_cmp.shape[1], k_cmp.shape[2]
    M = 16
    nsb = triton.cdiv(T, l_sel)
    n_tiles = triton.cdiv(T, M)
    nchmax = triton.cdiv(nsb, NBJ) + 1
    scr = torch.empty(B * H * n_tiles * nchmax * M * NBJP, device=q.device, dtype=torch.float32)
    lay = gl.NVMMASharedLayout.get_default_for([BN, dk], gl.bfloat16)
    kd = TensorDescriptor(k_cmp, [B * N, H * dk], [k_cmp.stride(1), 1], [BN, dk], lay)
    if only != "rank":
        _gscore_ws[(n_tiles, B * H)](q, kd, lse_cmp.contiguous(), scr, T, N, H, n_tiles, nchmax, scale * LOG2E,
                                     q.stride(0), q.stride(1), q.stride(2), num_warps=4)
    bi = torch.empty(B, T, H, n_sel, device=q.device, dtype=torch.int64)
    if only == "score":
        return bi
    kr = triton.next_power_of_2(max(n_sel, 2))
    ib = max(1, (nsb - 1).bit_length())
    _rank_kernel[(n_tiles, B * H)](scr, bi, bi.stride(0), bi.stride(1), bi.stride(2), T, H, n_tiles, nchmax, G=16,
                                   L_CMP=l, STRIDE=d, LSEL=l_sel, NSEL=n_sel, BT=M, NBJ=NBJ, NBJ_PAD=NBJP, KR=kr,
                                   LOGKR=kr.bit_length() - 1, LOGNB=NBJP.bit_length() - 1, IB=ib,
                                   KEY64=GRID_BITS + ib > 31, num_warps=rank_warps)
    return bi
