"""Top-n block selection and selected-block attention for one query tile (batched torch path)."""
from __future__ import annotations

import torch

from .common import FORCED_STEP, NSAParams, mask_bias, masked_probs, score_scale


def _static_key(pos: torch.Tensor, nb: int, p: NSAParams) -> torch.Tensor:
    """[tq, nb] int64 part of the selection key that does not depend on scores.

    Eligible block j (j * l_sel <= t): forced priority * FORCED_STEP * nb + (nb - 1 - j) (the
    lower index wins ties). Ineligible: a large negative offset, so the full key stays < 0.
    """
    j = torch.arange(nb, device=pos.device)
    cur = (pos // p.l_sel)[:, None]  # [tq, 1]
    prio = torch.where(j == cur, 3, torch.where(j == 0, 2, torch.where(j == cur - 1, 1, 0)))
    key = prio * (FORCED_STEP * nb) + (nb - 1 - j)
    return torch.where(j <= cur, key, -(2 ** 62))


def select_blocks(scores: torch.Tensor, pos: torch.Tensor, p: NSAParams, G: int) -> torch.Tensor:
    """scores [B, H, tq, nb] raw importance (acc dtype) -> block_idx [B, H, tq, n_sel] int64.

    One integer key per block makes the top-n deterministic: forced priority, then the score on
    the comparison grid, then the lower index (common.py documents the rule). Ineligible blocks
    get negative keys and come back as -1. Ascending, -1 padding last.
    """
    nb = scores.shape[-1]
    grid = torch.round(scores * score_scale(G, p.l, p.d)).to(torch.int64)  # [B, H, tq, nb]
    key = grid * nb + _static_key(pos, nb, p)
    k = min(p.n_sel, nb)
    val, idx = key.topk(k, dim=-1)
    idx = torch.where(val >= 0, idx, nb).sort(-1).values  # invalid slots sort last
    idx = torch.where(idx == nb, -1, idx)
    if k < p.n_sel:
        idx = torch.nn.functional.pad(idx, (0, p.n_sel - k), value=-1)
    return idx


def slc_dense(q2: torch.Tensor, k_slc: torch.Tensor, v_slc: torch.Tensor, idx: torch.Tensor,
              pos: torch.Tensor, t_end: int, p: NSAParams, scale: float, G: int,
              acc: torch.dtype) -> torch.Tensor:
    """Selected-block attention as a block-masked dense product over keys [0, t_end).

    Cheap when t_end is a small multiple of n_sel * l_sel (one big matmul, no gathers).
    q2 [B, H, G*tq, dk]; k_slc/v_slc [B, S, H, *]; idx [B, H, tq, n_sel] -> [B, H, G, tq, dv] acc.
    """
    B, H, GT, _ = q2.shape
    tq = GT // G
    nb = (t_end + p.l_sel - 1) // p.l_sel
    ks = k_slc[:, :t_end].permute(0, 2, 3, 1)  # [B, H, dk, L]
    vs = v_slc[:, :t_end].permute(0, 2, 1, 3)  # [B, H, L, dv]
    blk = torch.full((B, H, tq, nb + 1), float("-inf"), dtype=acc, device=idx.device)
    blk.scatter_(-1, torch.where(idx < 0, nb, idx), 0.0)  # -1 slots land in the spare column
    tok_blk = torch.arange(t_end, device=idx.device) // p.l_sel  # [L]
    future = torch.arange(t_end, device=idx.device)[None, :] > pos[:, None]  # [tq, L]
    bias = blk[..., tok_blk] + mask_bias(future, acc)  # [B, H, tq, L]: 0 = selected and <= t
    prob = masked_probs((q2 @ ks).view(B, H, G, tq, t_end), scale, bias[:, :, None], acc)
    o = prob.to(vs.dtype).view(B, H, GT, t_end) @ vs
    return o.view(B, H, G, tq, -1).to(acc)


def to_blocks(x: torch.Tensor, l_sel: int) -> torch.Tensor:
    """[B, S, H, D] -> [B*H*nb, l_sel*D] block-contiguous copy (zero padded to nb*l_sel tokens).

    Lets slc_gather fetch whole selected blocks with one index_select (contiguous rows) instead
    of a per-token gather; costs one O(S) copy per call, made once outside the tile loop.
    """
    B, S, H, D = x.shape
    nb = (S + l_sel - 1) // l_sel
    x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, nb * l_sel - S))
    return x.reshape(B, nb, l_sel, H, D).permute(0, 3, 1, 2, 4).reshape(B * H * nb, l_sel * D)


def _gather_blocks(x: torch.Tensor, xb: torch.Tensor | None, idx: torch.Tensor,
                   l_sel: int) -> torch.Tensor:
    """Selected blocks' rows: x [B, S, H, D], idx [B, H, tq, n] -> [B, H, tq, n * l_sel, D].

    With the block copy xb (to_blocks) one contiguous row per block; without it (decode: few
    queries, long cache) a per-token gather that reads only the selected tokens.
    """
    B, S, H, D = x.shape
    tq, n = idx.shape[2:]
    blk = idx.clamp_min(0)
    if xb is not None:
        nb = xb.shape[0] // (B * H)
        rows = (torch.arange(B * H, device=idx.device).view(B, H, 1, 1) * nb + blk).flatten()
        return xb.index_select(0, rows).view(B, H, tq, n * l_sel, D)
    tok = (blk[..., None] * l_sel + torch.arange(l_sel, device=idx.device)).flatten(-2)
    bi = torch.arange(B, device=idx.device).view(B, 1, 1, 1)
    hi = torch.arange(H, device=idx.device).view(1, H, 1, 1)
    return x[bi, tok.clamp_max(S - 1), hi]


def slc_gather(qg: torch.Tensor, k_slc: torch.Tensor, v_slc: torch.Tensor, idx: torch.Tensor,
               pos: torch.Tensor, p: NSAParams, scale: float, acc: torch.dtype,
               kb: torch.Tensor | None = None, vb: torch.Tensor | None = None) -> torch.Tensor:
    """Selected-block attention over each query's gathered n_sel * l_sel keys.

    Memory per tile ~ tq * n_sel * l_sel * (dk + dv) per KV head, independent of T.
    qg [B, H, tq, G, dk]; k_slc/v_slc [B, S, H, *]; idx [B, H, tq, n_sel]; kb/vb optional block
    copies (to_blocks). Returns [B, H, tq, G, dv] in acc dtype.
    """
    offs = torch.arange(p.l_sel, device=idx.device)
    tok = idx[..., None] * p.l_sel + offs  # [B, H, tq, n_sel, l_sel]; < 0 for unused slots
    blocked = ((idx[..., None] < 0) | (tok > pos[:, None, None])).flatten(-2)  # [B, H, tq, K]
    ks = _gather_blocks(k_slc, kb, idx, p.l_sel)  # [B, H, tq, K, dk]
    vs = _gather_blocks(v_slc, vb, idx, p.l_sel)  # [B, H, tq, K, dv]
    logits = qg @ ks.transpose(-1, -2)  # [B, H, tq, G, K]
    prob = masked_probs(logits, scale, mask_bias(blocked, acc)[:, :, :, None], acc)
    return (prob.to(vs.dtype) @ vs).to(acc)
