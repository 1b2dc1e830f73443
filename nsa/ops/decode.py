"""Decode / chunked-prefill entry: queries at absolute offset pos0 against cached keys.

Uses the same tiled core as prefill (batched.nsa_torch with a query offset), so decode and
prefill run the same arithmetic and choose the same blocks.
"""
from __future__ import annotations

import torch

from .batched import nsa_torch
from .common import NSAParams, safe_scale, validate_inputs
from .dispatch import _check_requested, cached_policy, count_fallback
from .reference import nsa_reference


def nsa_decode(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_slc: torch.Tensor,
               v_slc: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor, *,
               pos0: int, win_pos0: int, l: int, d: int, l_sel: int, n_sel: int, w: int,
               scale: float | None = None, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """NSA for queries at absolute positions pos0 .. pos0 + Tq - 1 (Tq usually 1).

    q [B,Tq,HQ,dk], gates [B,Tq,HQ,3]; k_slc/v_slc [B,S,H,*] raw tokens 0..S-1 (S = pos0 + Tq);
    k_cmp/v_cmp [B,N,H,*] compressed tokens 0..N-1 (per-query visibility still applied);
    k_win/v_win [B,Sw,H,*] raw keys for positions win_pos0 .. S-1, win_pos0 <= max(0, pos0 - w + 1).
    Returns (o [B,Tq,HQ,dv] in q.dtype, block_idx [B,Tq,H,n_sel]), equal to nsa_attention over the
    full sequence at those positions. backend "triton" falls back to torch (counted): no decode kernel.
    """
    p = NSAParams(l, d, l_sel, n_sel, w)
    tensors = dict(q=q, k_cmp=k_cmp, v_cmp=v_cmp, k_slc=k_slc, v_slc=v_slc, k_win=k_win,
                   v_win=v_win, gates=gates)
    _check_requested(backend)
    validate_inputs(tensors, p, pos0=pos0, win_pos0=win_pos0, decode=True)
    sc = safe_scale(scale, q.shape[-1])
    used = cached_policy(backend, q.device, q.dtype).backend
    if used == "reference":
        return nsa_reference(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, l=l, d=d,
                             l_sel=l_sel, n_sel=n_sel, w=w, scale=sc, pos0=pos0, win_pos0=win_pos0)
    if used == "triton":
        count_fallback("decode:triton->torch")
    return nsa_torch(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, p=p, scale=sc,
                     pos0=pos0, win_pos0=win_pos0)
