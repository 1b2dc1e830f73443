"""Sliding-window branch for one query tile: banded attention over keys [t0 - w + 1, t1)."""
from __future__ import annotations

import torch

from .common import mask_bias, masked_probs


def win_attention(q2: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, pos: torch.Tensor,
                  t0: int, t1: int, win_pos0: int, w: int, scale: float, G: int,
                  acc: torch.dtype) -> torch.Tensor:
    """q2 [B, H, G*tq, dk] for absolute positions pos = [t0, t1); k_win/v_win [B, Sw, H, *] holding
    absolute positions win_pos0 .. win_pos0 + Sw - 1. Returns [B, H, G, tq, dv] in acc dtype.
    Each query sees [max(0, t - w + 1), t]; the band is cut from the tile's key range, so memory
    is O(tq * (tq + w)) per tile.
    """
    B, H, GT, _ = q2.shape
    tq = GT // G
    lo = max(0, t0 - w + 1)
    kw = k_win[:, lo - win_pos0: t1 - win_pos0].permute(0, 2, 3, 1)  # [B, H, dk, L]
    vw = v_win[:, lo - win_pos0: t1 - win_pos0].permute(0, 2, 1, 3)  # [B, H, L, dv]
    L = t1 - lo
    kpos = torch.arange(lo, t1, device=pos.device)
    outside = (kpos[None, :] > pos[:, None]) | (kpos[None, :] <= pos[:, None] - w)  # [tq, L]
    prob = masked_probs((q2 @ kw).view(B, H, G, tq, L), scale, mask_bias(outside, acc), acc)
    o = prob.to(vw.dtype).view(B, H, GT, L) @ vw
    return o.view(B, H, G, tq, -1).to(acc)
