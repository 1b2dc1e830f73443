"""Compressed branch and selection importance scores for one query tile (batched torch path).

Everything here runs in the accumulation dtype (fp32, or fp64 for fp64 inputs): the compressed
probabilities feed the block selection, which must not depend on low-precision rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import NSAParams, mask_bias, masked_probs, safe_softmax


def cmp_attention(q2: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, pos: torch.Tensor,
                  t0: int, n_vis: int, p: NSAParams, scale: float, G: int,
                  acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Compressed attention of a query tile.

    q2 [B, H, G*tq, dk] (any float dtype; `scale` is what remains to apply), k_cmp/v_cmp [B, N, H, dk|dv] (N >= n_vis),
    pos [tq] absolute query positions (t0 = the first), n_vis = blocks visible to the last query.
    Returns o [B, H, G, tq, dv] (acc dtype; exactly 0 where nothing is visible) and the group-summed
    probabilities p_grp [B, H, tq, n_vis] (detached, acc dtype), or None when n_vis == 0.
    """
    B, H, GT, _ = q2.shape
    tq = GT // G
    dv = v_cmp.shape[-1]
    if n_vis == 0:
        return q2.new_zeros(B, H, G, tq, dv, dtype=acc), None
    kc = k_cmp[:, :n_vis].permute(0, 2, 3, 1).to(acc)  # [B, H, dk, n]
    vc = v_cmp[:, :n_vis].permute(0, 2, 1, 3).to(acc)  # [B, H, n, dv]
    logits = (q2.to(acc) @ kc).view(B, H, G, tq, n_vis)
    i = torch.arange(n_vis, device=pos.device)
    visible = (i[None, :] * p.d + (p.l - 1)) <= pos[:, None]  # [tq, n]
    if t0 >= p.l - 1:  # every query sees a block: the plain fused softmax is safe
        prob = masked_probs(logits, scale, mask_bias(~visible, acc), acc)  # [B, H, G, tq, n]
    else:
        prob = safe_softmax(logits * scale, visible)
    o = (prob.view(B, H, GT, n_vis) @ vc).view(B, H, G, tq, dv)
    return o, prob.detach().sum(2)


def block_scores(p_grp: torch.Tensor, n_blocks: int, p: NSAParams) -> torch.Tensor:
    """Raw importance s[..., j] = sum_i p_grp[..., i] * overlap(i, j) / d for j < n_blocks.

    p_grp [B, H, tq, n] -> [B, H, tq, n_blocks]. Uses the stride-chunk structure instead of the
    dense overlap matrix: compression block i covers chunks i .. i+r-1 (r = l/d, each chunk d
    tokens, contributing d/d = 1 per chunk), selection block j covers chunks j*u .. j*u+u-1.
    """
    n = p_grp.shape[-1]
    C = n_blocks * p.u  # chunks of the eligible blocks (>= n, since l >= d)
    chunk = F.pad(p_grp, (0, C - n))
    mass = chunk
    for k in range(1, p.r):  # mass[c] = sum_{k < r} p[c - k]
        mass = mass + F.pad(chunk, (k, 0))[..., :C]
    return mass.view(*mass.shape[:-1], n_blocks, p.u).sum(-1)
