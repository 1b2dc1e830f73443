"""The obviously-correct NSA oracle (docs/nsa.md), written for clarity, not speed.

Loops over query positions (and over batch/KV head for the selection), computes in fp64 and
returns in q's dtype. Differentiable through plain torch ops, so it also gives reference
gradients. Every fast path is tested against this file.
"""
from __future__ import annotations

import torch

from .common import (FORCED_STEP, NSAParams, overlap_matrix, safe_scale, score_scale,
                     validate_inputs, visible_cmp)

__all__ = ["nsa_reference", "reference_block_scores", "reference_select_blocks",
           "reference_select_one", "causal_attention"]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """Plain causal GQA attention in fp64. q [B,T,HQ,dk], k [B,T,H,dk], v [B,T,H,dv] -> [B,T,HQ,dv]."""
    B, T, HQ, dk = q.shape
    G = HQ // k.shape[2]
    scale = safe_scale(scale, dk)
    kk = k.double().repeat_interleave(G, dim=2)
    vv = v.double().repeat_interleave(G, dim=2)
    logits = torch.einsum("bthk,bshk->bhts", q.double(), kk) * scale
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    p = logits.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("bhts,bshv->bthv", p, vv).to(q.dtype)


def _softmax_attend(qh: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """qh [B,H,G,dk], k [B,H,L,dk], v [B,H,L,dv], mask [B,H,L] -> (out [B,H,G,dv], p [B,H,G,L])."""
    logits = torch.einsum("bhgk,bhlk->bhgl", qh, k) * scale
    if mask is not None:
        logits = logits.masked_fill(~mask[:, :, None, :], float("-inf"))
    p = logits.softmax(-1)
    return torch.einsum("bhgl,bhlv->bhgv", p, v), p


def reference_block_scores(p_cmp: torch.Tensor, n_blocks: int, p: NSAParams,
                           overlap: torch.Tensor | None = None) -> torch.Tensor:
    """Importance s[b, h, j] = sum_{heads g of group h} sum_i p_cmp[b,h,g,i] * overlap(i, j) / d.

    p_cmp [B, H, G, n] (probabilities over the n visible compressed tokens) -> [B, H, n_blocks] fp64.
    `overlap` may pass a precomputed (larger) common.overlap_matrix to slice from.
    """
    n = p_cmp.shape[-1]
    if overlap is None:
        overlap = overlap_matrix(n, n_blocks, p.l, p.d, p.l_sel)
    M = overlap[:n, :n_blocks].to(device=p_cmp.device, dtype=torch.float64)
    return torch.einsum("bhgi,ij->bhj", p_cmp.double(), M) / p.d


def reference_select_one(scores: list[float], t: int, p: NSAParams, G: int) -> list[int]:
    """Selected blocks for one query at position t from its group's raw scores (len >= t//l_sel+1).

    Eligible: j*l_sel <= t. Forced (by priority): block of t, block 0, block before. The rest by
    score on the comparison grid (common.SCORE_BITS), ties to the lower index. Ascending, -1 padded.
    """
    cur = t // p.l_sel
    mult = score_scale(G, p.l, p.d)

    def key(j: int) -> tuple[int, int]:
        prio = 3 if j == cur else 2 if j == 0 else 1 if j == cur - 1 else 0
        grid = int(round(scores[j] * mult))  # round half to even, like torch.round
        return (prio * FORCED_STEP + grid, -j)

    ranked = sorted(range(cur + 1), key=key, reverse=True)
    chosen = sorted(ranked[: p.n_sel])
    return chosen + [-1] * (p.n_sel - len(chosen))


def reference_select_blocks(scores: torch.Tensor, t: int, p: NSAParams, G: int) -> torch.Tensor:
    """scores [B, H, n_blocks] for the query at t -> block_idx [B, H, n_sel] int64."""
    B, H, _ = scores.shape
    rows = scores.detach().double().cpu().tolist()  # sync-ok: the oracle ranks on the host by design; never on a hot path
    out = [[reference_select_one(rows[b][h], t, p, G) for h in range(H)] for b in range(B)]
    return torch.tensor(out, dtype=torch.int64, device=scores.device).view(B, H, p.n_sel)


def nsa_reference(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_slc: torch.Tensor,
                  v_slc: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor, *,
                  l: int = 32, d: int = 16, l_sel: int = 64, n_sel: int = 16, w: int = 512,
                  scale: float | None = None, pos0: int = 0, win_pos0: int = 0,
                  return_branches: bool = False):
    """Reference NSA. Same arguments as nsa_attention (plus decode offsets pos0/win_pos0).

    Returns (o [B,Tq,HQ,dv] in q.dtype, block_idx [B,Tq,H,n_sel] int64); with return_branches
    also a dict of fp64 branch outputs "o_cmp", "o_slc", "o_win" [B,Tq,HQ,dv] and "scores"
    (list over queries of [B,H,n_blocks] fp64 importance scores).
    """
    p = NSAParams(l, d, l_sel, n_sel, w)
    tensors = dict(q=q, k_cmp=k_cmp, v_cmp=v_cmp, k_slc=k_slc, v_slc=v_slc, k_win=k_win,
                   v_win=v_win, gates=gates)
    # decode-style (lenient N) checks: nsa_attention has already applied the strict prefill ones
    B, Tq, HQ, H, dk, dv = validate_inputs(tensors, p, pos0=pos0, win_pos0=win_pos0, decode=True)
    G = HQ // H
    scale = safe_scale(scale, dk)
    # fp64, head-major: [B, H, L, d*]
    kc, vc, ks, vs, kw, vw = (x.double().permute(0, 2, 1, 3)
                              for x in (k_cmp, v_cmp, k_slc, v_slc, k_win, v_win))
    qd, gd = q.double(), gates.double()
    S = pos0 + Tq
    overlap = overlap_matrix(k_cmp.shape[1], S // l_sel + 1, l, d, l_sel).to(q.device)
    outs, idxs = [], []
    br = {"o_cmp": [], "o_slc": [], "o_win": [], "scores": []}
    for i in range(Tq):
        t = pos0 + i
        qh = qd[:, i].reshape(B, H, G, dk)
        # compressed branch over visible blocks; exactly 0 when none is visible
        n_vis = visible_cmp(t, l, d)
        n_blocks = t // l_sel + 1
        if n_vis > 0:
            o_cmp, p_cmp = _softmax_attend(qh, kc[:, :, :n_vis], vc[:, :, :n_vis], scale)
            scores = reference_block_scores(p_cmp.detach(), n_blocks, p, overlap)
        else:
            o_cmp = qh.new_zeros(B, H, G, dv)
            scores = qh.new_zeros(B, H, n_blocks)
        # selection: chosen blocks' raw tokens that are <= t
        sel = reference_select_blocks(scores, t, p, G)  # [B, H, n_sel]
        tok_block = torch.arange(t + 1, device=q.device) // l_sel  # [t+1]
        mask = (tok_block[None, None, :, None] == sel[:, :, None, :]).any(-1)  # [B, H, t+1]
        o_slc, _ = _softmax_attend(qh, ks[:, :, : t + 1], vs[:, :, : t + 1], scale, mask)
        # sliding window over absolute [max(0, t-w+1), t]
        lo = max(0, t - w + 1) - win_pos0
        o_win, _ = _softmax_attend(qh, kw[:, :, lo: t + 1 - win_pos0], vw[:, :, lo: t + 1 - win_pos0], scale)
        g = gd[:, i].reshape(B, H, G, 3)
        o = g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win
        outs.append(o.reshape(B, HQ, dv))
        idxs.append(sel)
        if return_branches:
            for name, val in (("o_cmp", o_cmp), ("o_slc", o_slc), ("o_win", o_win)):
                br[name].append(val.reshape(B, HQ, dv))
            br["scores"].append(scores)
    o = torch.stack(outs, 1).to(q.dtype)
    block_idx = torch.stack(idxs, 1)
    if not return_branches:
        return o, block_idx
    for name in ("o_cmp", "o_slc", "o_win"):
        br[name] = torch.stack(br[name], 1)
    return o, block_idx, br

