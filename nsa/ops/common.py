"""Shared helpers for every NSA op path: hyper-parameter checks, block geometry, input validation.

Conventions (all paths):
- Query head ``hq`` belongs to KV group ``hq // G`` with ``G = HQ // H`` (the usual GQA layout,
  the same as ``k.repeat_interleave(G, dim=head)``).
- Selection-score comparison: scores are normalised so that they sum to 1 over blocks
  (``s * d / (G * l)``), then rounded to a grid of ``2**-SCORE_BITS``. Two scores equal on that grid
  are a tie and go to the lower block index. This makes exact ties (and rounding-level near ties)
  resolve the same way in fp64, fp32, prefill and decode, whatever the summation order.
- Forced blocks, by priority when ``n_sel`` is smaller than their number: the block containing
  ``t``, then block 0, then the block before the one containing ``t``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LOG2E = 1.4426950408889634   # log2(e): exp(x) = exp2(x * LOG2E), the kernels work in log2 units
SCORE_BITS = 20
# priority bonus of forced blocks, in units of the score grid (scores are <= 2**SCORE_BITS)
FORCED_STEP = 2 ** (SCORE_BITS + 1)
# the GPU score kernels' fp16-split block map takes 2**SCORE_MAP_SHIFT p (the shift taken off lse in log2 units),
# so its low part needs no scaling (nsa/ops/triton/scores.py and scores_gluon.py, which must agree bitwise)
SCORE_MAP_SHIFT = 12
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class NSAParams:
    """Block geometry of NSA; validated on construction."""

    l: int = 32
    d: int = 16
    l_sel: int = 64
    n_sel: int = 16
    w: int = 512

    def __post_init__(self) -> None:
        validate_hparams(self.l, self.d, self.l_sel, self.n_sel, self.w)

    @property
    def r(self) -> int:
        """Stride chunks per compression block (l / d)."""
        return self.l // self.d

    @property
    def u(self) -> int:
        """Stride chunks per selection block (l_sel / d)."""
        return self.l_sel // self.d


def validate_hparams(l: int, d: int, l_sel: int, n_sel: int, w: int) -> None:
    """Raise ValueError naming the field when the NSA block geometry is invalid."""
    for name, val in (("l", l), ("d", d), ("l_sel", l_sel), ("n_sel", n_sel), ("w", w)):
        if isinstance(val, bool) or not isinstance(val, int):
            raise ValueError(f"{name} must be a Python int, got {type(val).__name__} ({val!r})")
        if val <= 0:
            raise ValueError(f"{name} must be positive, got {val}")
    check_block_geometry(l, d, l_sel)


def check_block_geometry(l: int, d: int, l_sel: int, prefix: str = "") -> None:
    """The one home of NSA's block-geometry rule (positive ints assumed): compression blocks of l
    tokens at stride d overlap but leave no gaps (l >= d), and both block lengths are whole numbers
    of strides (d | l, d | l_sel). prefix names the fields' owner in messages (e.g. "nsa.")."""
    if l < d:
        raise ValueError(f"{prefix}l={l} must be >= {prefix}d={d} (compression blocks may overlap, not "
                         "leave gaps); raise l or lower d")
    if l % d != 0:
        raise ValueError(f"{prefix}d={d} must divide {prefix}l={l} (the compression block length)")
    if l_sel % d != 0:
        raise ValueError(f"{prefix}d={d} must divide {prefix}l_sel={l_sel} (the selection block length)")


def num_cmp_tokens(T: int, l: int, d: int) -> int:
    """Compressed tokens of a T-token sequence: floor((T - l) / d) + 1, or 0 when T < l."""
    return 0 if T < l else (T - l) // d + 1


def visible_cmp(t: int, l: int, d: int) -> int:
    """Compressed blocks visible to the query at position t (block i visible iff i*d + l - 1 <= t)."""
    return num_cmp_tokens(t + 1, l, d)


def num_sel_blocks(t_end: int, l_sel: int) -> int:
    """Selection blocks starting at or before position t_end - 1 (ceil(t_end / l_sel))."""
    return (t_end + l_sel - 1) // l_sel


def overlap_matrix(n_cmp: int, n_blocks: int, l: int, d: int, l_sel: int,
                   dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """[n_cmp, n_blocks]: raw tokens shared by compression block i and selection block j."""
    i = torch.arange(n_cmp, dtype=torch.int64)[:, None]
    j = torch.arange(n_blocks, dtype=torch.int64)[None, :]
    lo = torch.maximum(i * d, j * l_sel)
    hi = torch.minimum(i * d + l, (j + 1) * l_sel)
    return (hi - lo).clamp_min(0).to(dtype)


def score_scale(G: int, l: int, d: int) -> float:
    """Multiplier taking raw importance scores to the integer comparison grid."""
    return float(2 ** SCORE_BITS) * d / (G * l)


def safe_scale(scale: float | None, dk: int) -> float:
    if scale is None:
        return dk ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a float or None, got {type(scale).__name__}")
    if not (scale > 0.0 and scale < float("inf")):
        raise ValueError(f"scale must be positive and finite, got {scale}")
    return float(scale)


_NAMES = ("q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates")


def validate_inputs(tensors: dict[str, torch.Tensor], p: NSAParams, *, pos0: int = 0,
                    win_pos0: int = 0, decode: bool = False,
                    check_lengths: bool = True) -> tuple[int, int, int, int, int, int]:
    """Check shapes/dtypes/devices of the op's inputs; return (B, Tq, HQ, H, dk, dv).

    Prefill (decode=False): q/gates/k_slc/v_slc/k_win/v_win share T, and k_cmp/v_cmp hold exactly
    num_cmp_tokens(T) tokens. Decode: queries sit at pos0.., k_slc/v_slc hold S = pos0 + Tq tokens,
    the window buffer starts at win_pos0 and ends at S, k_cmp holds at least the visible tokens.
    check_lengths=False skips the token-count checks (device-side positions: capacity buffers).
    """
    for name in _NAMES:
        x = tensors[name]
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must have rank 4, got shape {tuple(x.shape)}")
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be a floating tensor (fp16/bf16/fp32/fp64), got {x.dtype}")
    q, gates = tensors["q"], tensors["gates"]
    B, Tq, HQ, dk = q.shape
    H, dv = tensors["k_slc"].shape[2], tensors["v_slc"].shape[3]
    if Tq < 1:
        raise ValueError(f"q must hold at least one token (dim 1), got shape {tuple(q.shape)}")
    for name in _NAMES[1:]:
        x = tensors[name]
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}; move all inputs to one device")
        if name != "gates" and x.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {x.dtype} but q has {q.dtype}; cast q/k/v to one dtype")
        if x.shape[0] != B:
            raise ValueError(f"{name} has batch {x.shape[0]} but q has {B}")
    if tuple(gates.shape) != (B, Tq, HQ, 3):
        raise ValueError(f"gates must have shape [B, T, HQ, 3] = {(B, Tq, HQ, 3)}, got {tuple(gates.shape)}")
    if H < 1 or HQ % H != 0:
        raise ValueError(f"q heads HQ={HQ} must be a multiple of the k/v heads H={H} (k_slc dim 2)")
    head_dims = {"k_cmp": dk, "k_slc": dk, "k_win": dk, "v_cmp": dv, "v_slc": dv, "v_win": dv}
    for name, want in head_dims.items():
        x = tensors[name]
        if x.shape[2] != H:
            raise ValueError(f"{name} has {x.shape[2]} heads (dim 2) but k_slc has H={H}")
        if x.shape[3] != want:
            kind = "d_k (q's last dim)" if name.startswith("k") else "d_v (v_slc's last dim)"
            raise ValueError(f"{name} has last dim {x.shape[3]} but {kind} is {want}")
    if check_lengths:
        _validate_lengths(tensors, p, Tq, pos0, win_pos0, decode)
    return B, Tq, HQ, H, dk, dv


def _validate_lengths(tensors: dict[str, torch.Tensor], p: NSAParams, Tq: int, pos0: int,
                      win_pos0: int, decode: bool) -> None:
    for name, val in (("pos0", pos0), ("win_pos0", win_pos0)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 0:
            raise ValueError(f"{name} must be a non-negative Python int, got {val!r}")
    S = pos0 + Tq
    for pair in (("k_slc", "v_slc"), ("k_win", "v_win"), ("k_cmp", "v_cmp")):
        a, b = (tensors[n].shape[1] for n in pair)
        if a != b:
            raise ValueError(f"{pair[0]} has {a} tokens but {pair[1]} has {b}; they must match")
    n_slc, n_win, n_cmp = (tensors[n].shape[1] for n in ("k_slc", "k_win", "k_cmp"))
    if n_slc != S:
        what = "pos0 + Tq" if decode else "q's T"
        raise ValueError(f"k_slc/v_slc must hold {what} = {S} tokens, got {n_slc}")
    if win_pos0 + n_win != S:
        what = f"S - win_pos0 = {S} - {win_pos0}" if decode else f"q's T = {S}"
        raise ValueError(f"k_win/v_win must hold {what} tokens, got {n_win}")
    if win_pos0 > max(0, pos0 - p.w + 1):
        raise ValueError(f"win_pos0={win_pos0} must be <= max(0, pos0 - w + 1) = {max(0, pos0 - p.w + 1)}"
                         " so the window buffer covers every query's window")
    need = num_cmp_tokens(S, p.l, p.d)
    if decode and n_cmp < need:
        raise ValueError(f"k_cmp/v_cmp must hold at least floor((S - l) / d) + 1 = {need} compressed "
                         f"tokens for S = {S}, l = {p.l}, d = {p.d}; got {n_cmp}")
    if not decode and n_cmp != need:
        raise ValueError(f"k_cmp/v_cmp must hold N = floor((T - l) / d) + 1 = {need} compressed tokens "
                         f"(0 when T < l) for T = {S}, l = {p.l}, d = {p.d}; got {n_cmp}")


def safe_softmax(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of `logits` restricted to `mask`; rows with no True give exactly 0.

    Used where a row can be empty (compressed branch before the first block completes); the
    max is detached (it cancels mathematically) so backward stays NaN-free.
    """
    x = logits.masked_fill(~mask, float("-inf"))
    m = x.detach().amax(-1, keepdim=True).clamp_min(-1e30)
    e = torch.exp(x - m)
    return e / e.sum(-1, keepdim=True).clamp_min(1e-30)


def heads_major(x: torch.Tensor, H: int, G: int) -> torch.Tensor:
    """[B, tq, H*G, D] -> [B, H, G*tq, D] (contiguous): rows of one KV head as one matmul operand."""
    B, tq, _, D = x.shape
    return x.reshape(B, tq, H, G, D).permute(0, 2, 3, 1, 4).reshape(B, H, G * tq, D)


def heads_major_out(o: torch.Tensor) -> torch.Tensor:
    """[B, H, G, tq, D] -> [B, tq, H*G, D]."""
    B, H, G, tq, D = o.shape
    return o.permute(0, 3, 1, 2, 4).reshape(B, tq, H * G, D)


def mask_bias(blocked: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """Additive mask in `acc`: 0 where allowed, -inf where `blocked`.

    Added in place to the logits instead of masked_fill: the add's backward is the identity (the
    softmax already gives 0 gradient where p = 0), where masked_fill's backward is another pass.
    """
    zero = torch.zeros((), dtype=acc, device=blocked.device)
    return torch.where(blocked, zero - float("inf"), zero)


def masked_probs(scores: torch.Tensor, scale: float, bias: torch.Tensor,
                 acc: torch.dtype) -> torch.Tensor:
    """softmax(scale * scores + bias) in `acc`; every row must keep at least one finite entry.

    `scores` is a fresh matmul output: cast (if needed), scaling and masking happen in place
    (autograd allows it, matmul saves its inputs, not its output), so one full-size tensor plus the
    probabilities exist per branch. Callers pass scale=1 when q was pre-scaled.
    """
    x = scores if scores.dtype == acc else scores.to(acc)
    if scale != 1.0:
        x = x.mul_(scale)
    return x.add_(bias).softmax(-1)


def decode_signature(t: tuple) -> tuple | None:
    """What a decode call's decisions depend on of its eight tensors (q .. gates): q's and gates' type, shape,
    strides, dtype, device; the same of the six caches but their lengths (dim 1), of which only whether they are
    empty. None where a tensor has no such attributes (validation names it)."""
    q, gates = t[0], t[7]
    try:
        return ((type(q), q.shape, q.stride(), q.dtype, q.device),
                (type(gates), gates.shape, gates.stride(), gates.dtype, gates.device),
                *((type(x), (s := x.shape)[0], s[2:], s[1] > 0, x.stride(), x.dtype, x.device) for x in t[1:7]))
    except (AttributeError, TypeError, IndexError, RuntimeError):
        return None
