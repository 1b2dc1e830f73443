"""Batched, tiled torch NSA ("torch" backend): prefill and decode share this core.

Queries are processed in tiles of `tile` tokens (a Python loop over tiles, never over tokens).
Per tile: compressed attention + importance scores in fp32, deterministic top-n selection,
selected-block attention (block-masked dense product while the key range is short, per-query
block gather beyond), banded window attention, gated sum. Under autograd every tile runs inside
torch.utils.checkpoint, so what is kept for backward is O(T) and per-tile intermediates are
recomputed: peak memory grows linearly in T for forward and backward. No host syncs.
"""
from __future__ import annotations

from functools import partial

import torch
from torch.utils.checkpoint import checkpoint as _checkpoint

from .common import (NSAParams, heads_major, heads_major_out, num_cmp_tokens, num_sel_blocks,
                     visible_cmp)
from .compress import block_scores, cmp_attention
from .select import select_blocks, slc_dense, slc_gather, to_blocks
from .tuning import TorchTuning
from .window import win_attention


def auto_tile(device_type: str, B: int, HQ: int, S: int, p: NSAParams, dense_limit: int,
              tuning: TorchTuning) -> int:
    """Query-tile size: tuning.cpu_tile off CUDA; on CUDA the largest multiple of 64 in
    [tile_min, tile_max] whose fp32 logits, B * HQ * tile * keys_per_row, stay under tile_budget."""
    if device_type != "cuda":
        return tuning.cpu_tile
    keys = num_cmp_tokens(S, p.l, p.d) + min(S, dense_limit) + min(S, p.w)
    tile = tuning.tile_budget // max(1, B * HQ * keys)
    return int(min(tuning.tile_max, max(tuning.tile_min, tile // 64 * 64)))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tile(q_t: torch.Tensor, g_t: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor,
          k_slc: torch.Tensor, v_slc: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor,
          kb: torch.Tensor | None, vb: torch.Tensor | None, *, t0: int, p: NSAParams,
          scale: float, G: int, win_pos0: int, dense_limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One query tile at absolute positions [t0, t0 + tq).

    q_t [B, tq, HQ, dk], g_t [B, tq, HQ, 3]; kb/vb optional block copies of k_slc/v_slc
    (select.to_blocks) for the gather path -> (o [B, tq, HQ, dv] in q's dtype,
    block_idx [B, tq, H, n_sel]).
    """
    B, tq, HQ, dk = q_t.shape
    H, t1 = HQ // G, t0 + tq
    acc = _acc_dtype(q_t.dtype)
    with torch.autocast(device_type=q_t.device.type, enabled=False):
        pos = torch.arange(t0, t1, device=q_t.device)
        # fold the softmax scale into q where that loses nothing (q already in the acc dtype)
        qs, scale = (q_t * scale, 1.0) if q_t.dtype == acc else (q_t, scale)
        q2 = heads_major(qs, H, G)  # [B, H, G*tq, dk]
        n_vis = min(visible_cmp(t1 - 1, p.l, p.d), k_cmp.shape[1])
        o_cmp, p_grp = cmp_attention(q2, k_cmp, v_cmp, pos, t0, n_vis, p, scale, G, acc)
        nb = num_sel_blocks(t1, p.l_sel)
        if p_grp is None:
            scores = torch.zeros(B, H, tq, nb, dtype=acc, device=q_t.device)
        else:
            scores = block_scores(p_grp, nb, p)
        idx = select_blocks(scores, pos, p, G)  # [B, H, tq, n_sel]
        if t1 <= dense_limit:
            o_slc = heads_major_out(slc_dense(q2, k_slc, v_slc, idx, pos, t1, p, scale, G, acc))
        else:
            qg = qs.reshape(B, tq, H, G, dk).permute(0, 2, 1, 3, 4)  # [B, H, tq, G, dk]
            o_slc = slc_gather(qg, k_slc, v_slc, idx, pos, p, scale, acc, kb, vb)
            o_slc = o_slc.permute(0, 2, 1, 3, 4).reshape(B, tq, HQ, -1)
        o_win = heads_major_out(win_attention(q2, k_win, v_win, pos, t0, t1, win_pos0, p.w,
                                              scale, G, acc))
        g = g_t.to(acc)
        o = g[..., 0:1] * heads_major_out(o_cmp) + g[..., 1:2] * o_slc + g[..., 2:3] * o_win
    return o.to(q_t.dtype), idx.permute(0, 2, 1, 3)


def nsa_torch(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_slc: torch.Tensor,
              v_slc: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor, *,
              p: NSAParams, scale: float, pos0: int = 0, win_pos0: int = 0, tile: int | None = None,
              dense_factor: float | None = None, checkpoint: bool | None = None,
              tuning: TorchTuning | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled NSA over queries at absolute positions pos0 .. pos0 + Tq - 1 (inputs already validated).

    q [B,Tq,HQ,dk], gates [B,Tq,HQ,3]; k_slc/v_slc [B,S,H,*] (S = pos0 + Tq); k_win/v_win from
    absolute position win_pos0 to S; k_cmp/v_cmp [B,N,H,*]. Returns (o [B,Tq,HQ,dv] in q.dtype,
    block_idx [B,Tq,H,n_sel] int64). `checkpoint=None`: recompute tiles in backward whenever
    autograd is recording and there is more than one tile.
    """
    B, Tq, HQ, _ = q.shape
    G = HQ // k_slc.shape[2]
    tuning = tuning or TorchTuning()
    if dense_factor is None:
        dense_factor = tuning.dense_factor
    dense_limit = int(dense_factor * p.n_sel * p.l_sel)
    if tile is None:
        tile = auto_tile(q.device.type, B, HQ, pos0 + Tq, p, dense_limit, tuning)
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tile must be a positive int or None, got {tile!r}")
    n_tiles = (Tq + tile - 1) // tile
    if checkpoint is None:
        needs_grad = torch.is_grad_enabled() and any(
            x.requires_grad for x in (q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates))
        checkpoint = needs_grad and n_tiles > 1
    kb = vb = None
    S = k_slc.shape[1]
    # block copies pay off when the gathered volume exceeds one pass over the cache (not decode)
    if pos0 + Tq > dense_limit and Tq * p.n_sel * p.l_sel >= S:
        with torch.autocast(device_type=q.device.type, enabled=False):
            kb, vb = to_blocks(k_slc, p.l_sel), to_blocks(v_slc, p.l_sel)
    outs, idxs = [], []
    for a in range(0, Tq, tile):
        b = min(a + tile, Tq)
        fn = partial(_tile, t0=pos0 + a, p=p, scale=scale, G=G, win_pos0=win_pos0,
                     dense_limit=dense_limit)
        args = (q[:, a:b], gates[:, a:b], k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, kb, vb)
        if checkpoint:
            o, idx = _checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
        else:
            o, idx = fn(*args)
        outs.append(o)
        idxs.append(idx)
    if n_tiles == 1:
        return outs[0], idxs[0]
    return torch.cat(outs, 1), torch.cat(idxs, 1)
