"""NSA tensor ops: the public op, decode, the reference oracle and backend dispatch.

    o, block_idx = nsa_attention(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates,
                                 l=32, d=16, l_sel=64, n_sel=16, w=512, scale=None, backend="auto")
"""
from __future__ import annotations

import torch

from .common import NSAParams, num_cmp_tokens, validate_hparams
from .custom_op import traced_attention
from .decode import nsa_decode
from .dispatch import KernelPolicy, resolve_backend, triton_module  # noqa: F401 - public names
from .eager import eager_attention
from .fallbacks import count_fallback, fallback_counts, reset_fallback_counts
from .reference import causal_attention, nsa_reference
from .tuning import KernelTuning, tuning_for

__all__ = ["nsa_attention", "nsa_decode", "nsa_reference", "causal_attention", "KernelPolicy",
           "resolve_backend", "fallback_counts", "count_fallback", "reset_fallback_counts",
           "validate_hparams", "num_cmp_tokens", "NSAParams", "KernelTuning", "tuning_for"]


def nsa_attention(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_slc: torch.Tensor,
                  v_slc: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor, *,
                  l: int = 32, d: int = 16, l_sel: int = 64, n_sel: int = 16, w: int = 512,
                  scale: float | None = None, backend: str | KernelPolicy = "auto",
                  tile: int | None = None, recompute: bool | None = None,
                  tuning: KernelTuning | None = None,
                  allow_flash: bool = True, flash_branches: str = "preset") -> tuple[torch.Tensor, torch.Tensor]:
    """Native Sparse Attention over a full sequence (docs/nsa.md).

    q [B,T,HQ,dk]; k_cmp/v_cmp [B,N,H,dk|dv] compressed (N = floor((T-l)/d)+1, 0 when T < l);
    k_slc/v_slc/k_win/v_win [B,T,H,dk|dv] raw; gates [B,T,HQ,3] (cmp, slc, win), already in [0,1].
    Query head hq uses KV head hq // (HQ // H). Returns (o [B,T,HQ,dv] in q.dtype,
    block_idx [B,T,H,n_sel] int64 ascending, -1 for unused slots). backend: "reference" | "torch"
    | "triton" | "auto" or a resolved KernelPolicy. Differentiable in q, every k/v and gates.
    torch backend knobs: `tile` query-tile size (default 128 on CPU; on CUDA up to 1024 within an
    element budget, batched.auto_tile); `recompute` re-runs each tile in backward instead of keeping
    its intermediates (default: whenever there is more than one tile, so backward memory is linear
    in T). recompute=False keeps every tile's logits (quadratic in T) for ~1.5-2x less op time;
    use it when the caller already checkpoints the layer. `tuning`: the kernels' launch parameters
    (nsa/ops/tuning.py; None: the policy's, i.e. the preset of this device). allow_flash=False
    (nsa.allow_flash_attn=false) keeps every branch off flash-attn whatever tuning.flash says;
    flash_branches (nsa.flash_branches) replaces tuning.flash: "preset" (keep), "off", "win", "cmp", "win+cmp".
    Under torch.compile the call is traced as the custom op nsa::attention (nsa/ops/custom_op.py);
    eagerly it runs nsa/ops/eager.py directly.
    """
    if torch.compiler.is_compiling():   # a flag read: eager calls skip the custom-op dispatch
        return traced_attention(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, l=l, d=d, l_sel=l_sel,
                                n_sel=n_sel, w=w, scale=scale, backend=backend, tile=tile,
                                recompute=recompute, tuning=tuning, allow_flash=allow_flash,
                                flash_branches=flash_branches)
    return eager_attention(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, l=l, d=d, l_sel=l_sel,
                           n_sel=n_sel, w=w, scale=scale, backend=backend, tile=tile, recompute=recompute,
                           tuning=tuning, allow_flash=allow_flash, flash_branches=flash_branches, graphs=True)
