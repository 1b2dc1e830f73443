"""FlashAttention-4's Hopper backward without its passes over q's rows before and after the main kernel.

FA4's backward entry runs three kernels: a preprocess (D = rowsum(o * dO) - dlse and lse * log2(e) per query
row, and zeroing an fp32 accumulator of dq, [B, heads, S_r * d] with S_r the rows rounded up to the dq tile),
the main kernel (adds dq into that accumulator), and a postprocess (accumulator * scale -> dq in the input
dtype). For the NSA op's flash branches, whose D the NSA backward already has (branch_sums.py), both the
pre- and the postprocess are passes over [T, HQ, d] that the op can do without:

- the preprocess reads dO (1 GB per branch at 64k, paper shape) to form a D it is then told to discard
  (o is passed as zero rows, dlse = -D). `rows_pre` writes D and lse * log2(e) from [heads, T] vectors
  and the accumulator is zeroed by a memset;
- the postprocess reads the 2 GB fp32 accumulator and writes dq, which q's gradient kernels then read again
  (qsum.py). With `keep_dq`, the accumulator itself is handed on (an `Accum`) and those kernels read it in
  their epilogue (qsum.add_q_terms): one read of the accumulator instead of a read, a write and a read.

The accumulator is not row-major: each dq tile of M query rows x d columns is stored as the main kernel's two
MMA warpgroups hold it in registers (FA4's postprocess reads it back the same way). `acc_rows` / `acc_cols`
give an element's offset in closed form for the configurations FA4 picks on sm_90 for d = 64 (M = 128, two
warpgroups over rows) and d = 128 (M = 64, two over columns); `accum_a` checks FA4's own choice against them
and returns None for anything else (then FA4's postprocess runs). tests/test_fa4_accum.py compares the
formula with FA4's postprocess on a GPU, element by element.

The preprocess is replaced wherever D is given (FlashBranchTuning.row_sums), the postprocess where the caller
keeps the accumulator (FlashBranchTuning.fa4_accum). Everything goes through FA4's private backward entry with
two of its module functions swapped for the call (`_bwd_preprocess`, `_bwd_postprocess_convert`); the callers
keep their fallback to FA4's public autograd where anything here raises.
"""
from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


class Accum(NamedTuple):
    """FA4's fp32 dq accumulator of one backward call: buf [B', NH, s_r * d] (query row s of batch b', head h
    at tile layout offset (b' * NH + h) * s_r * d + acc_rows(s) + acc_cols(col)); dq = buf * scale."""
    buf: torch.Tensor
    s_r: int
    a: int
    scale: float


@triton.jit
def acc_rows(r, D: tl.constexpr, A: tl.constexpr):
    """Offset of query row r's part within FA4's sm_90 dq accumulator of one (batch, head): tiles of M = 64 * A
    rows x D columns, each stored as 2 warpgroups x D / (2 * 8 / A) column groups of 8 x 128 threads x 4
    values (thread = warp * 32 + (r % 8) * 4 + (c % 8) // 2, value = ((r % 16) // 8) * 2 + c % 2, the wgmma
    accumulator's register order); A = 2: the warpgroups split the rows, A = 1: the columns (acc_cols)."""
    M: tl.constexpr = 64 * A
    return ((r // M) * (M * D) + ((r % M) // 64) * (M * D // 2) + ((r % 64) // 16) * 128 + (r % 8) * 16
            + ((r % 16) // 8) * 2)


@triton.jit
def acc_cols(c, D: tl.constexpr, A: tl.constexpr):
    """Offset of column c's part (acc_rows)."""
    M: tl.constexpr = 64 * A
    NS: tl.constexpr = D * A // 2   # columns of one warpgroup
    return (c // NS) * (A * (M * D // 2)) + ((c % NS) // 8) * 512 + ((c % 8) // 2) * 4 + (c % 2)


def accum_offsets(s_r: int, d: int, a: int) -> torch.Tensor:
    """[s_r, d] int64 offsets of acc_rows + acc_cols in torch (the CPU tests' stand-in accumulators)."""
    r = torch.arange(s_r).view(-1, 1)
    c = torch.arange(d).view(1, -1)
    M, NS = 64 * a, d * a // 2
    rows = (r // M) * (M * d) + ((r % M) // 64) * (M * d // 2) + ((r % 64) // 16) * 128 + (r % 8) * 16 \
        + ((r % 16) // 8) * 2
    cols = (c // NS) * (a * (M * d // 2)) + ((c % NS) // 8) * 512 + ((c % 8) // 2) * 4 + (c % 2)
    return rows + cols


def to_accum(dq: torch.Tensor, scale: float, a: int) -> Accum:
    """dq [B', S, NH, d] -> the Accum FA4 would have left for it (buf * scale == dq in fp32): "reference"
    backend's stand-in, so the CPU tests read the layout the kernels read on the device."""
    B, S, NH, d = dq.shape
    M = 64 * a
    s_r = -(-S // M) * M
    src = torch.zeros(B, NH, s_r, d, dtype=torch.float32, device=dq.device)
    src[:, :, :S] = dq.float().transpose(1, 2) / scale
    buf = torch.full((B, NH, s_r * d), float("nan"), dtype=torch.float32, device=dq.device)
    buf[:, :, accum_offsets(s_r, d, a).to(dq.device).view(-1)] = src.reshape(B, NH, -1)
    return Accum(buf, s_r, a, scale)


def reference_a(head_dim: int) -> int:
    """The atom layout FA4's sm_90 table picks by head dim (accum_a's cases), for the "reference" stand-in."""
    return 2 if head_dim <= 64 else 1


@functools.lru_cache(maxsize=None)
def accum_a(head_dim: int) -> int | None:
    """A of acc_rows for FA4's sm_90 backward at this head dim (causal and windowed alike), or None where its
    configuration is not one the formula covers (two MMA warpgroups, no swapped dQ MMA, M = 64 * A rows) or
    this FA4 does not say (its table of configurations is private)."""
    try:
        from flash_attn.cute.interface import _tile_size_bwd_sm90
        cfgs = [_tile_size_bwd_sm90(head_dim, head_dim, causal, not causal) for causal in (True, False)]
    except (ImportError, AttributeError, TypeError):
        return None
    ok = all(c == cfgs[0] for c in cfgs) and head_dim % 32 == 0
    c = cfgs[0]
    ok = ok and c.num_wg == 2 and not c.dQ_swapAB and not c.dQ_single_wg and c.m_block_size == 64 * c.AtomLayoutMdQ
    return c.AtomLayoutMdQ if ok else None


@triton.jit
def _rows_pre_kernel(LSE, DLSE, DPSUM, LSE2, S, S_R, n, BLOCK: tl.constexpr):
    """Row i = bh * S_R + s of FA4's [B', NH, S_R] dpsum / lse_log2: -dlse and lse * log2(e) (0 for -inf)
    for s < S; 0 and +inf past S. lse / dlse contiguous [B', NH, S]."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    s = i % S_R
    src = (i // S_R) * S + s
    real = ok & (s < S)
    lse = tl.load(LSE + src, mask=real, other=float("inf"))
    dl = tl.load(DLSE + src, mask=real, other=0.0)
    tl.store(DPSUM + i, -dl, mask=ok)
    tl.store(LSE2 + i, tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634), mask=ok)


def rows_pre(lse: torch.Tensor, dlse: torch.Tensor, dpsum: torch.Tensor, lse_log2: torch.Tensor) -> None:
    """FA4's preprocess for o = 0: dpsum = -dlse and lse_log2 = lse * log2(e), padded as FA4 pads."""
    B, NH, S = lse.shape
    s_r = dpsum.shape[-1]
    n = B * NH * s_r
    if n:
        _rows_pre_kernel[(triton.cdiv(n, 1024),)](lse.contiguous(), dlse.contiguous(), dpsum, lse_log2, S, s_r, n,
                                                  BLOCK=1024, num_warps=4)


def zero_rows(like: torch.Tensor) -> torch.Tensor:
    """A tensor shaped like `like` whose every row is one zero row (stride 0 but in the last dim)."""
    return like.new_zeros(like.shape[-1]).expand(like.shape)


@contextlib.contextmanager
def _swapped(mod, **fns):
    """Module functions replaced for the block (FA4's backward looks them up at call time)."""
    old = {k: getattr(mod, k) for k in fns}
    for k, f in fns.items():
        setattr(mod, k, f)
    try:
        yield
    finally:
        for k, f in old.items():
            setattr(mod, k, f)


def fa4_bwd(q, k, v, o, do, lse, d_rows, *, scale: float, window: int | None, keep_dq: bool):
    """(dq or Accum, dk, dv) of causal attention (window: the `window` most recent keys) through FA4's backward
    entry. d_rows (D, lse's layout) given: o is not read and FA4's preprocess is rows_pre + a memset; keep_dq
    (and a configuration accum_a covers): dq is the Accum, not converted."""
    from flash_attn.cute import interface as fi
    wl, wr = (window - 1, 0) if window is not None else (None, None)
    if d_rows is None:
        out, dlse = o, None
    else:
        out, dlse = zero_rows(o), -d_rows
    state: dict = {}
    orig_pre, orig_post = fi._bwd_preprocess, fi._bwd_postprocess_convert
    # an FA4 whose functions lack the compile caches this was written against runs its own passes (no swap)
    known = all(hasattr(f, "compile_cache") for f in (orig_pre, orig_post))
    keep = known and keep_dq and accum_a(q.shape[-1]) is not None

    def pre(out_, dout, dpsum, lse_, lse_log2, dq_accum, cu_q, used_q, dlse_, *args, **kw):
        state["acc"] = dq_accum
        if d_rows is None or cu_q is not None or used_q is not None or dq_accum is None or lse_log2 is None \
                or dpsum.dim() != 3 or kw.get("row_max") is not None:
            return orig_pre(out_, dout, dpsum, lse_, lse_log2, dq_accum, cu_q, used_q, dlse_, *args, **kw)
        rows_pre(lse_, dlse_, dpsum, lse_log2)
        dq_accum.zero_()

    def post(accum, output, scale_, cu, used, arch, dtype, hdim, block, threads, atom, swap, *args, **kw):
        if (keep and accum is state.get("acc") and cu is None and used is None and arch // 10 == 9 and not swap
                and threads == 256 and block == 64 * atom and kw.get("hdim_multiple_of", 32) == 32
                and kw.get("sink_tensors") is None and atom == accum_a(hdim)):
            state["keep"] = Accum(accum, accum.shape[-1] // hdim, atom, scale_)
            return
        return orig_post(accum, output, scale_, cu, used, arch, dtype, hdim, block, threads, atom, swap, *args, **kw)

    swaps = {}
    if known:   # the originals reach their compile caches through their module-level names: these stand-ins
        pre.compile_cache, post.compile_cache = orig_pre.compile_cache, orig_post.compile_cache
        swaps = dict(_bwd_preprocess=pre, _bwd_postprocess_convert=post)
    with _swapped(fi, **swaps):
        dq, dk, dv = fi._flash_attn_bwd(q, k, v, out, do, lse, softmax_scale=scale, causal=True,
                                        window_size_left=wl, window_size_right=wr, dlse=dlse)[:3]
    return state.get("keep", dq), dk, dv
