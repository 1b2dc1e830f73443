"""How local a selection is, from its block indices alone: what query tiles (m consecutive tokens sharing
their blocks' K/V loads) and key tiles (kb consecutive blocks sharing their tokens' q / dO gathers) would
save against the per-token and per-block kernels. Reported by bench/ and bench/capture_inputs.py; the
op's own per-call tile choice samples the same union (nsa.ops.triton.select_tile.tile_choice)."""
from __future__ import annotations

import statistics

import torch

LOCALITY_M = (1, 2, 4, 8, 16)
KEY_LOCALITY_KB = (1, 2, 4, 8)
GROUP_WINDOWS = (4, 8, 16, 32, 64)   # group_locality's windows (W = m: consecutive tiles)


def locality(block_idx: torch.Tensor, ms=LOCALITY_M, start: int | None = None) -> dict[int, float]:
    """{m: union of the selections of m consecutive tokens / (m * n_sel)} for block_idx [B, T, H, n_sel]
    (the op's layout, -1 = unused slot), over tokens start.. (default T // 2, the second half) cut to
    whole tiles, mean over batch and KV heads: the K/V blocks a tile kernel loads relative to the
    per-token kernel (1.0 at m = 1 when every slot is used). Tensor ops only (select_tile's
    tile_union_fraction); one host read per m."""
    from nsa.ops.triton.select_tile import tile_union_fraction
    T = block_idx.shape[1]
    start = T // 2 if start is None else start
    out = {}
    for m in ms:
        n = (T - start) // m * m
        if n == 0:
            raise ValueError(f"locality: {T - start} tokens from {start} hold no tile of m={m}; use a longer T")
        out[m] = float(tile_union_fraction(block_idx[:, start:start + n], m))   # sync-ok: report
    return out


def key_locality(block_idx: torch.Tensor, kbs=KEY_LOCALITY_KB, start: int | None = None) -> dict[int, float]:
    """{kb: distinct (token, tile of kb consecutive blocks) pairs / (token, block) pairs} for block_idx
    [B, T, H, n_sel] (ascending, -1 = unused), over tokens start.. (default T // 2): the q / dO rows a
    dK/dV walk over key tiles of kb blocks would gather relative to the walk per block (1.0 at kb = 1).
    Such a walk computes kb * 64 keys per gathered row, so its masked work is kb times this fraction of
    the per-block walk's. Tensor ops only; one host read per kb."""
    T = block_idx.shape[1]
    start = T // 2 if start is None else start
    bi = block_idx[:, start:]
    ok = bi >= 0
    pairs = int(ok.sum())   # sync-ok: report
    if pairs == 0:
        raise ValueError(f"key_locality: no selected block among tokens {start}..{T - 1}")
    out = {}
    for kb in kbs:
        tile = torch.where(ok, bi // kb, -1)
        # ascending within a token's row: a tile is new where it differs from the slot before
        new = ok.clone()
        new[..., 1:] &= tile[..., 1:] != tile[..., :-1]
        out[kb] = int(new.sum()) / pairs   # sync-ok: report
    return out


def group_locality(block_idx: torch.Tensor, m: int = 4, windows=GROUP_WINDOWS, start: int | None = None
                   ) -> dict[int, float]:
    """{W: union fraction (as locality's) of tiles of m tokens regrouped within windows of W consecutive tokens
    (TileTuning.group's greedy, nsa/ops/triton/tile_group.py); W = m: consecutive tokens, locality()[m]}, over
    tokens start.. (default T // 2, rounded down to whole windows). What TileTuning.group would save in the
    tile kernels' K/V loads and masked work. Tensor ops and one grouping kernel per W; one host read per W."""
    from nsa.ops.triton.select_tile import tile_union_fraction
    from nsa.ops.triton.tile_group import group_tokens, permuted
    T = block_idx.shape[1]
    wmax = max(windows)
    start = (T // 2 if start is None else start) // wmax * wmax
    n = (T - start) // wmax * wmax
    if n == 0:
        raise ValueError(f"group_locality: {T - start} tokens from {start} hold no window of {wmax}; use a longer T")
    out = {}
    for w in windows:
        bi = block_idx if w == m else permuted(block_idx, group_tokens(block_idx, m, w))
        out[w] = float(tile_union_fraction(bi[:, start:start + n], m))   # sync-ok: report
    return out


def mean_locality(tables: list[dict[int, float]]) -> dict[int, float]:
    """Mean over layers (or inputs) of locality() tables."""
    return {m: statistics.fmean(t[m] for t in tables) for m in tables[0]}
