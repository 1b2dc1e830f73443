"""What the tuning values (nsa/ops/tuning.py) mean for a call of G query heads per KV head: tokens per query
tile, block order or per token, the dK/dV walk's rows / stages / prefetch and chunk, the pair partials' dtypes.

Pure rules over one sub-config and G (no call, device or tensor): nsa/ops/plan.py's select_plan applies them
to a call (with the eligibility checks only it makes), and the launchers take the WalkPlan / PairPlan it
names; offset_route is the whole route of a call whose queries sit at an offset. No torch or triton import.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WalkPlan:
    """The dK/dV walk over each selected block's token list (select.slc_dkdv)."""

    dq_pairs: bool              # also writes each (token, block) pair's dq partial
    rows: int                   # (token, head) rows per step
    group: int                  # rows per token: G packed, or next_pow2(G)
    gluon: int                  # Gluon ring slots, 0: the Triton kernel
    prefetch: bool              # token ids two steps ahead (Triton kernel)
    loop_stages: int            # tl.range stages of the step loop, 0: a plain loop


@dataclass(frozen=True)
class PairPlan:
    """The block-order partials: the forward's (token, block) o partials and the walk's dq partials."""

    dtype: str                  # fp32 | input (q's dtype) | fp16 (o / max|v|, scaled back by the merge)
    dq_dtype: str               # fp32 | input (dq is not bounded: never the scaled fp16 form)
    ids_in_regs: bool           # the forward's token ids from registers (pieces of <= 256 entries)
    group: int                  # rows per token in the walks: G packed, or next_pow2(G)


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def m_for(t, G: int) -> int:
    """Tokens per query tile under TileTuning t (1: no tiles): tiles only from t.min_g heads per KV head."""
    return t.m if G >= t.min_g else 1


def dq_stages_for(t, T: int) -> int:
    """K/V ring slots of the Gluon tile dq under TileTuning t for T tokens (0: the Triton kernel)."""
    return t.gluon_dq_short_stages if 0 < t.gluon_dq_stages and T < t.gluon_dq_short_t else t.gluon_dq_stages


def by_block(s, G: int) -> bool:
    """Whether the selection forward runs block by block under SelectTuning s."""
    return s.loop == "block" or (s.loop == "auto" and G <= s.block_max_g)


def dq_by_block(s, G: int) -> bool:
    """Whether dq comes from the dK/dV walk's pair partials under SelectTuning s."""
    return s.loop == "block" or (s.loop == "auto" and G <= s.dq_block_max_g)


def dkdv_rows_for(s, G: int, big: bool = False) -> int:
    """(query, head) rows per dK/dV step; big: padded head dims > 128 (block_dkdv_rows is measured at d = 64,
    and 128 rows would not fit sm_80's shared memory there)."""
    return s.block_dkdv_rows if dq_by_block(s, G) and not big else s.dkdv_rows


def loop_stages_for(s, dq_pairs: bool, G: int) -> int:
    """tl.range stages of the dK/dV walk's step loop (0: a plain loop), with or without dq partials."""
    if dq_pairs:
        return s.dq_walk_loop_stages if G >= s.dq_walk_loop_min_g else 0
    return s.walk_loop_stages


def prefetch_for(s, G: int, dq_pairs: bool = True) -> bool:
    """Whether the walk prefetches its token ids: not where its loop is a pipelined tl.range, which loads them."""
    return s.prefetch and dq_by_block(s, G) and not loop_stages_for(s, dq_pairs, G)


def chunk_for(s, pairs: int) -> int:
    """Tokens per dK/dV program for `pairs` (token, kv head, block) pairs: halved (down to 16) while the
    pairs fill fewer than chunk_min_items full chunks (a ragged last wave)."""
    chunk = s.chunk
    while chunk >= 32 and pairs < s.chunk_min_items * chunk:
        chunk //= 2
    return chunk


def pair_plan(s, G: int) -> PairPlan:
    """The block-order partials under SelectTuning s for G query heads per KV head."""
    dq = s.dq_pair_dtype or s.pair_dtype
    return PairPlan(s.pair_dtype, "input" if dq == "fp16" else dq, s.ids_in_regs, G if s.pack_heads else _pow2(G))


def walk_plan(s, G: int, big: bool, dq_pairs: bool, gluon_ok=lambda rows: False) -> WalkPlan:
    """The dK/dV walk under SelectTuning s for G query heads per KV head (big: head dims > 128);
    gluon_ok(rows): whether the Gluon walk takes steps of `rows` rows here (default: never, the Triton walk)."""
    rows = max(dkdv_rows_for(s, G, big), _pow2(G))
    group = pair_plan(s, G).group
    stages = s.gluon_dq_walk_stages if dq_pairs else s.gluon_walk_stages
    gluon = stages if stages and group == G and gluon_ok(rows) else 0
    return WalkPlan(dq_pairs, rows, group, gluon, prefetch_for(s, G, dq_pairs), loop_stages_for(s, dq_pairs, G))


def t_ok(min_t: int | None, T: int) -> bool:
    """Whether a switch that holds from min_t tokens on (None: never) holds at T."""
    return min_t is not None and T >= min_t


OFFSET_WHY = "queries at an offset (context parallelism): the per-token route, whose Triton kernels all take one"


def offset_route(tn, G: int, d_max: int, chunk: int) -> dict:
    """OpPlan's fields (all but arch) for a call whose queries sit at positions pos0.. > 0 of the keys (KernelTuning
    tn, G query heads per KV head, the larger head dim): both attention branches and the fused score pass on their
    Triton kernels, the per-token selection forward and dq, the Triton dK/dV walk without pair partials. Those
    kernels take the offset; the flash / dense / Gluon / block-order / tile paths do not."""
    s = tn.select
    why = tuple((c, OFFSET_WHY) for c in ("cmp", "win", "scores", "fwd", "bwd")) + (("win_entry", "own kernel"),)
    return dict(cmp="triton", win="triton", win_entry="plain", win_gate_lse=False, scores="triton", m=1, fwd="token",
                fwd_gluon=0, combine=False, bwd="token", dq_gluon=0, walk=walk_plan(s, G, d_max > 128, False),
                chunk=chunk, dq_fold=False, row_sums=False, fa4_accum=False, pairs=pair_plan(s, G),
                relayout=tn.scores.relayout, tile_group=0, tuning=tn, why=why, q_off=True)
