"""Kernel launch parameters as data: one frozen dataclass per kernel family, bundled per device family.

The kernel policy (nsa/ops/dispatch.py) picks a `KernelTuning` with `tuning_for(device)` and carries it
as `policy.tuning`; the launchers take their part as an argument. To try another value, build a
variant with `dataclasses.replace` (or the `with_*` helpers) and pass it: nothing here is patched at
run time. No triton import here (the CPU-only install reads these too).

Values come from sweeps on an H200 (bench/bench_attention.py --sweep, bench/bench_decode.py --sweep;
the figures are in bench/RESULTS.md). Terms: rows = (query token, query head) pairs of a program;
keys = key tokens per loop step; warps / stages = Triton's num_warps / num_stages.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, Union

import torch

Warps = Union[int, Literal["auto"]]   # "auto": about 32 elements of the largest tile per thread (1..8)


@dataclass(frozen=True)
class Tile:
    """One flash-attention launch: rows per program, keys per step, num_warps, num_stages."""

    rows: int
    keys: int
    warps: int
    stages: int


@dataclass(frozen=True)
class AttnTuning:
    """Compressed / window attention (nsa/ops/triton/attn.py). `big_*` serve head dims in (128, 256]
    (the padded head dim doubles the tile, so fewer rows and stages fit in shared memory)."""

    fwd: Tile = Tile(128, 64, 8, 3)       # 3 stages beat 2 at 32k (bf16, d=128)
    dq: Tile = Tile(128, 32, 8, 3)        # best dq tile at 32k and 64k
    dkdv: Tile = Tile(32, 64, 4, 3)       # rows = query rows per step, keys = keys per program; best with gates
    big_fwd: Tile = Tile(64, 32, 8, 2)
    big_dq: Tile = Tile(32, 32, 8, 1)
    big_dkdv: Tile = Tile(16, 32, 8, 1)

    def tiles(self, big: bool) -> tuple[Tile, Tile, Tile]:
        """(fwd, dq, dkdv) for padded head dims <= 128 (big=False) or in (128, 256] (big=True)."""
        return (self.big_fwd, self.big_dq, self.big_dkdv) if big else (self.fwd, self.dq, self.dkdv)


def check_max_regs(name: str, value) -> None:
    """A register cap (ptxas .maxnreg) is None or an int in [24, 255]."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 24 <= value <= 255):
        raise ValueError(f"{name} must be None or an int in [24, 255], got {value!r}")


def check_gluon_slots(name: str, value: int, what: str) -> None:
    """A Gluon kernel's ring slots: 0 (the Triton kernel instead) or >= 2 (one slot cannot prefetch)."""
    if value == 1 or value < 0:
        raise ValueError(f"{name} must be 0 (the Triton kernel) or >= 2 ({what} ring slots of the Gluon kernel), "
                         f"got {value}")


@dataclass(frozen=True)
class SelectTuning:
    """Selected-block attention (nsa/ops/triton/select.py): forward, dq and dK/dV kernels."""

    fwd_warps: int = 2          # 2 warps edge out 4 at 64k with gates (1 is slower)
    dq_warps: int = 2
    dkdv_warps: int = 4         # 2 warps spill badly
    fwd_stages: int = 2         # 2 stages beat 1 and 3 over the whole selection backward
    dq_stages: int = 2
    dkdv_stages: int = 2
    fwd_keys: int = 64          # key rows per pipeline stage (capped by l_sel); smaller tiles were slower
    dq_keys: int = 64
    dkdv_rows: int = 32         # (query, head) rows per step of dK/dV; best with gates at 64k
    # the same where dq comes from pair partials (dq_by_block(G)): there the walk also writes them
    # (Hopper preset: 64 rows with prefetch, bench/RESULTS.md table 9)
    block_dkdv_rows: int = 32
    chunk: int = 1024           # tokens of one block's list per dK/dV program
    # halve chunk while the call's (token, kv head, block) pairs fill fewer than this many full chunks
    # (0: never): with few, long work items the dK/dV walk's last wave runs a handful of them alone
    chunk_min_items: int = 0
    pair_chunk: int = 0         # the same per block-order forward program (0: chunk)
    # the walks over a block's token list (dK/dV, block-order forward) pack each token's G head rows
    # densely (G=6: 10 tokens in 64 rows) instead of padding them to a power of two (8 tokens, 48 of
    # 64 rows useful). Measured on Hopper only: it sped up the forward and the 128-row dK/dV walk but
    # slowed the 64-row one, so the other presets keep the padded rows
    pack_heads: bool = False
    # loop order of the forward and of dq (select_block.py): "token" = one program per (token, kv head)
    # over its n_sel blocks; "block" = one program per (selected block, chunk of the tokens that chose
    # it) -- the forward writes per-pair partials merged per token, dq's partials come from the dK/dV
    # kernel's walk and are summed per token; "auto" = "block" when G = HQ/H <= block_max_g (per token
    # the MMA tile is mostly padding), else "token"
    loop: Literal["token", "block", "auto"] = "token"
    block_max_g: int = 8
    # the same for dq alone under loop="auto" (the forward keeps block_max_g): dq from the dK/dV walk's
    # pair partials needs no K/V per token, where the per-token forward beats the block-order one at
    # G=16 (its partials cost more than the per-token kernel's block loads there)
    dq_block_max_g: int = 8
    pair_rows: int = 64         # (token, head) rows per step of the block-order forward
    pair_warps: int = 4
    pair_stages: int = 2
    # forward pair partials (o): fp32, q's dtype, or "fp16": o / max|v| in fp16 (o is a convex mix of v rows,
    # so o / max|v| lies in [-1, 1]: an 11-bit mantissa at bf16's 2 bytes; the merge scales back)
    pair_dtype: Literal["fp32", "input", "fp16"] = "fp32"
    # the dK/dV walk's dq pair partials (None: pair_dtype, with "fp16" read as q's dtype: dq has no bound
    # like o's). On a trained model's inputs (64k, layers 0/5/11) bf16 o partials took dk_slc 0.4-0.9% away
    # from the per-token op (its delta = dO.o amplifies o's rounding), bf16 dq partials did not (H100,
    # bench/RESULTS.md table 9)
    dq_pair_dtype: Literal["fp32", "input", None] = None
    # the dK/dV walk over a block's token list loads each step's token ids two steps ahead, so a step's
    # q / dO / lse gathers never wait on their token-id load (H100, HQ=12/H=2/d=64 at 64 rows: the walk
    # 0.62 -> 0.59 ms at 16k, 2.70 -> 2.38 ms at 64k; at 128 rows it spilled and was slower). Only where the
    # walk also writes dq partials (prefetch_for): G=16's 32-row walk without them loses Triton's pipelining
    # with it. The block-order forward measured slower with its own prefetch, so it has none.
    prefetch: bool = False
    # the block-order forward loads a piece's token ids (pair_chunk <= 256) into registers once, so no step's
    # q gather waits on a token-id load and Triton pipelines it (H100, HQ=12/H=2/d=64: forward 0.43 -> 0.38 ms
    # at 16k, 1.85 -> 1.69 ms at 64k; bench/RESULTS.md table 9)
    ids_in_regs: bool = False
    merge_warps: int = 2
    # registers per thread of the block-order forward (ptxas .maxnreg; None: the compiler's choice). Its
    # programs wait on gathered q rows (long scoreboard), so fewer registers buy resident programs
    pair_max_regs: int | None = None
    # the step loop of the dK/dV walk without dq partials (the query-tile path's) as tl.range(num_stages=n);
    # 0: a plain loop under the kernel's dkdv_stages, which pipelines only the loads feeding its dots. At
    # the paper shape the plain loop's q / dO gathers compiled to plain loads (sm_90: 27 LDG, no LDGSTS in
    # the loop) and the walk waited on them half the time; n=3 makes them async copies a step or two ahead
    # (H100, table 15: walk 2.07 -> 1.74 ms at 8k, 16.0 -> 13.9 at 64k, captured 16.1 -> 13.7; 2 / 4 stages 2.02 / 1.71)
    walk_loop_stages: int = 0
    # the same for the walk with dq pair partials (the per-token path's), for G >= dq_walk_loop_min_g; its gathers
    # are plain loads too (production shape, sm_90: 20 LDG, no LDGSTS). H100, 64k, random (table 15): G=16 25.7 ->
    # 24.3 ms at 2 stages (3 spilled: 27.5); G=6 2.39 -> 2.73 / 2.64 / 2.66 at 2 / 3 / 4, so it keeps the prefetch
    dq_walk_loop_stages: int = 0
    dq_walk_loop_min_g: int = 1
    # the walk without dq partials on the Gluon kernel (nsa/ops/triton/walk_gluon.py: the block's K/V and
    # each step's q / dO rows by TMA, this many ring slots) where eligible (d = 128, l_sel = 64, 64-row
    # steps of whole tokens' heads), else 0: the Triton kernel. Bitwise the same dK / dV; H100, paper shape,
    # captured selections, dK/dV incl. its reduction: 14.1 -> 12.6 / 13.7 -> 12.9 ms at 64k, 3-4% at 8k;
    # 3 slots (one program per SM) 25-40% slower (bench/RESULTS.md table 16)
    gluon_walk_stages: int = 0
    # the same for the walk with dq pair partials (the per-token path's: random paper-shape inputs from 16k); bitwise
    # the Triton walk's outputs; H100, random: 5.96 -> 5.64 ms at 16k, 24.4 -> 22.9 at 64k (table 17)
    gluon_dq_walk_stages: int = 0
    # the Gluon walk without dq partials: each step's row lse / delta / gate a step ahead (token ids two; table 28)
    gluon_walk_row_prefetch: bool = True

    def __post_init__(self) -> None:
        for name in ("gluon_walk_stages", "gluon_dq_walk_stages"):
            check_gluon_slots(f"select.{name}", getattr(self, name), "q / dO")
        for name in ("walk_loop_stages", "dq_walk_loop_stages"):
            if getattr(self, name) not in (0, 2, 3, 4) or isinstance(getattr(self, name), bool):
                raise ValueError(f"select.{name} must be 0 (off), 2, 3 or 4, got {getattr(self, name)!r}")
        if isinstance(self.dq_walk_loop_min_g, bool) or not isinstance(self.dq_walk_loop_min_g, int) \
                or self.dq_walk_loop_min_g < 1:
            raise ValueError(f"select.dq_walk_loop_min_g must be an int >= 1 (query heads per KV head), "
                             f"got {self.dq_walk_loop_min_g!r}")
        check_max_regs("select.pair_max_regs", self.pair_max_regs)
        if self.loop not in ("token", "block", "auto"):
            raise ValueError(f"select.loop must be token, block or auto, got {self.loop!r}")
        if self.pair_dtype not in ("fp32", "input", "fp16"):
            raise ValueError(f"select.pair_dtype must be fp32, input or fp16, got {self.pair_dtype!r}")
        if self.dq_pair_dtype not in ("fp32", "input", None):
            raise ValueError(f"select.dq_pair_dtype must be fp32, input or null (pair_dtype), got {self.dq_pair_dtype!r}")
        if self.chunk < 1:
            raise ValueError(f"select.chunk must be >= 1 (tokens per dK/dV program), got {self.chunk}")
        if isinstance(self.chunk_min_items, bool) or not isinstance(self.chunk_min_items, int) \
                or self.chunk_min_items < 0:
            raise ValueError(f"select.chunk_min_items must be an int >= 0 (0: off), got {self.chunk_min_items!r}")
        if self.pair_chunk < 0:
            raise ValueError(f"select.pair_chunk must be >= 0 (0: select.chunk), got {self.pair_chunk}")
        for name in ("block_max_g", "dq_block_max_g"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 0:
                raise ValueError(f"select.{name} must be an int >= 0 (query heads per KV head), got {val!r}")
        for name in ("pack_heads", "prefetch", "ids_in_regs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"select.{name} must be true or false, got {getattr(self, name)!r}")

    def chunk_for(self, pairs: int) -> int:
        """Tokens per dK/dV program for a call with `pairs` (token, kv head, selected block) pairs."""
        chunk = self.chunk
        while chunk >= 32 and pairs < self.chunk_min_items * chunk:
            chunk //= 2
        return chunk

    def by_block(self, G: int) -> bool:
        """Whether the forward runs block by block for G query heads per KV head."""
        return self.loop == "block" or (self.loop == "auto" and G <= self.block_max_g)

    def dq_by_block(self, G: int) -> bool:
        """Whether dq comes from the dK/dV walk's pair partials for G query heads per KV head."""
        return self.loop == "block" or (self.loop == "auto" and G <= self.dq_block_max_g)

    def dkdv_rows_for(self, G: int, big: bool = False) -> int:
        """(query, head) rows per dK/dV step for G query heads per KV head; big: padded head dims
        above 128 (block_dkdv_rows is measured at head dim 64 only, and 128 rows would not fit sm_80's
        shared memory there)."""
        return self.block_dkdv_rows if self.dq_by_block(G) and not big else self.dkdv_rows

    def loop_stages_for(self, dq_pairs: bool, G: int) -> int:
        """tl.range stages of the dK/dV walk's step loop (0: a plain loop), with or without dq partials,
        for G query heads per KV head."""
        if dq_pairs:
            return self.dq_walk_loop_stages if G >= self.dq_walk_loop_min_g else 0
        return self.walk_loop_stages

    def prefetch_for(self, G: int, dq_pairs: bool = True) -> bool:
        """Whether the dK/dV walk (with or without dq partials) prefetches its token ids for G query heads per
        KV head: not where its step loop is a pipelined tl.range (loop_stages_for), which loads them itself."""
        return self.prefetch and self.dq_by_block(G) and not self.loop_stages_for(dq_pairs, G)


TILE_MAX_M = 32   # token bits of a tile-union entry live in one int32


@dataclass(frozen=True)
class TileLaunch:
    """One query-tile fwd or dq launch: key rows per pipeline stage (capped by l_sel), warps, stages."""

    keys: int
    warps: int
    stages: int


@dataclass(frozen=True)
class TileTuning:
    """Selection on query tiles (nsa/ops/triton/select_tile.py): m consecutive tokens x the G heads
    of a KV head per program, loading each block of the tile's union of selections once.

    m: tokens per tile; 1 runs the per-token / block-order kernels of SelectTuning (the Hopper preset tiles only G>=16:
    min_g below, bench/RESULTS.md tables 8 and 12). Rows = m*G padded to a power of two (>= 16); `fwd` and `dq` hold
    (launch for rows <= 64, launch for rows > 64). Hopper's wgmma wants >= 64 rows per program; at d=128 a 128-row fp32
    accumulator needs 8 warps to stay in registers, 64 rows fit in 4. Shared memory per stage (bf16, d=128, 64 keys): K
    + V tiles 32 KB, so 3 stages plus the q/dO operands stay under sm_80's 164 KB. H100, 64k, B=1, l_sel=64, n_sel=16,
    local selections (union 0.25 at m=4, 0.12 at m=8), fwd ms: HQ=64/H=4/d=128 m=4 (64 rows) 4 warps 3 stages 64 keys
    6.5 vs 2 stages 6.9; m=8 (128 rows) 8 warps 3 stages 32 keys 6.4 vs 2 stages 64 keys 7.5; HQ=12/H=2/d=64 m=8 (64
    rows) 1.2 (3 stages the same within 0.05); per-token 16.3 / 4.2. dq: 2 stages as fast as 3."""

    m: int = 1
    fwd: tuple[TileLaunch, TileLaunch] = (TileLaunch(64, 4, 3), TileLaunch(32, 8, 3))
    dq: tuple[TileLaunch, TileLaunch] = (TileLaunch(64, 4, 2), TileLaunch(32, 8, 2))
    big_keys: int = 32              # cap on keys per stage for padded head dims > 128
    # dK/dV: "token" walks, per block, the tokens that selected it (select.py's kernel, SelectTuning's dkdv_*:
    # every row it loads is a member); "tile" walks the tiles whose union holds the block, masking the rows of
    # tokens that did not select it (union_fraction * m times the token walk's MMA work, the same q/dO traffic).
    # H100, 8k, HQ=64, H=4, d=128: token 2.2 ms, tile (64 rows per step) 8.5 (m=1) / 12.2 (m=4) / 12.1 (m=8).
    dkdv_by: str = "token"
    # m > 1: per call, the tile kernels only when the tiles' mean union fraction (measured on the device from the
    # block indices: no host sync) is <= auto_union, else the per-token kernels (both launched, the other one's
    # programs return at once: nsa/ops/triton/guard.py); 0 = always tiles
    auto_union: float = 0.0
    # tiles only for calls whose KV heads serve at least min_g query heads (G = HQ / H), the per-token / block-order
    # kernels below: at G <= 8 the block-order kernels already fill their MMA rows with several tokens' heads, at
    # G = 16 the per-token programs have 16 rows (bench/RESULTS.md table 12)
    min_g: int = 1
    # forward on the Gluon kernel (nsa/ops/triton/tile_gluon.py: TMA ring of this many K/V slots, q in registers)
    # where it is eligible, else 0: the Triton kernel. Same output bit for bit; H100, paper shape, m=4, captured:
    # forward 10.3-13.0 -> 8.1-11.1 ms at 64k, 1.2-1.4 -> 0.9-1.2 at 8k; dq (2 slots; 3 win at 8k and one 64k
    # layer, lose at the other) 12.0-15.7 -> 10.5-12.6 ms at 64k (bench/RESULTS.md table 16)
    gluon_fwd_stages: int = 0
    gluon_dq_stages: int = 0        # the same for the tile dq kernel
    # below gluon_dq_short_t tokens (0: never) the Gluon dq on gluon_dq_short_stages slots (dq_stages_for): 3 won at
    # 8k on an H100 (table 16); on an H200 the op at 8k gains 0.3% on either captured layer (table 27)
    gluon_dq_short_t: int = 0
    gluon_dq_short_stages: int = 3
    # both Gluon kernels read each union entry's block id / bits a step before use (tile_gluon._kv_step): table 29
    gluon_union_prefetch: bool = True
    # the Gluon forward also writes the op's output (the branches' gated sum) from its tile's rows: no separate
    # combine pass (H100, paper shape, captured: op device time 6.90 -> 6.80 ms at 8k, 87.3 -> 85.0 at 64k; table 18)
    gluon_combine: bool = False
    # > 0: each tile's m tokens are the most alike of a window of `group` (8 / 16 / 32 / 64, a multiple of m)
    # consecutive tokens (a greedy per window and KV head: nsa/ops/triton/tile_group.py), so the unions, hence
    # K/V loads and masked work, shrink; 0 = consecutive. Needs dkdv_by "token". H200, captured paper shape,
    # W=32 (table 27): op f+b layer 0 -3.7 / -5.5 / -4.1% at 8k / 16k / 64k, layer 3 within 1.1%, random -0.4-2.3%
    group: int = 0
    dkdv_rows: int = 32             # "tile" walk: (token, head) rows per dK/dV step (whole tiles, >= one)
    dkdv_warps: int = 4
    dkdv_stages: int = 2

    def __post_init__(self) -> None:
        if not 1 <= self.m <= TILE_MAX_M:
            raise ValueError(f"TileTuning.m must be in 1..{TILE_MAX_M} (1: per-token kernels), got {self.m}")
        if not 0.0 <= self.auto_union <= 1.0:
            raise ValueError(f"TileTuning.auto_union must be in [0, 1] (0: always the tile kernels), "
                             f"got {self.auto_union}")
        if self.dkdv_by not in ("token", "tile"):
            raise ValueError(f"TileTuning.dkdv_by must be 'token' or 'tile', got {self.dkdv_by!r}")
        if self.min_g < 1:
            raise ValueError(f"TileTuning.min_g must be >= 1 (1: tiles at every G), got {self.min_g}")
        if self.group not in (0, 8, 16, 32, 64) or self.group % self.m or (self.group and self.dkdv_by != "token"):
            raise ValueError(f"TileTuning.group must be 0 (consecutive tokens) or 8 / 16 / 32 / 64, a multiple of m="
                             f"{self.m}, with dkdv_by='token'; got group={self.group!r}, dkdv_by={self.dkdv_by!r}")
        for f in ("gluon_fwd_stages", "gluon_dq_stages", "gluon_dq_short_stages"):
            check_gluon_slots(f"TileTuning.{f}", getattr(self, f), "K/V")
        if self.gluon_dq_short_t < 0:
            raise ValueError(f"TileTuning.gluon_dq_short_t must be >= 0 (0: never), got {self.gluon_dq_short_t}")

    def m_for(self, G: int) -> int:
        """Tokens per tile for a call whose KV heads serve G query heads (1: no tiles)."""
        return self.m if G >= self.min_g else 1

    def dq_stages_for(self, T: int) -> int:
        """K/V ring slots of the Gluon tile dq for a call of T tokens (0: the Triton kernel)."""
        return self.gluon_dq_short_stages if 0 < self.gluon_dq_stages and T < self.gluon_dq_short_t \
            else self.gluon_dq_stages

    def launch(self, pair: tuple[TileLaunch, TileLaunch], rows: int) -> TileLaunch:
        return pair[0] if rows <= 64 else pair[1]


@dataclass(frozen=True)
class ScoreTile:
    """Fused block scores + top-n (nsa/ops/triton/scores.py select_blocks).

    map_small serves tiles of <= 16 tokens with BT * BN * NBJ_PAD <= 16384, map_big the others:
    0 = head sum then band sum on CUDA cores (exact fp32); 1 = p @ cnt on tensor cores at tf32x3
    (spills; tests only) then head sum; 2 = p @ cnt as two fp16 products (hi + lo * 2**-12,
    ~22-bit p) then head sum."""

    rows: int
    min_keys: int       # min compressed tokens per chunk (BN is at least this)
    warps: int
    stages: int
    map_small: int
    map_big: int
    # registers per thread (ptxas .maxnreg; None: the compiler's choice). The kernel is latency-bound
    # (chunks of dependent dot -> exp -> map -> sort steps), so fewer registers buy resident blocks
    max_regs: int | None = None

    def __post_init__(self) -> None:
        check_max_regs("ScoreTile.max_regs", self.max_regs)


@dataclass(frozen=True)
class ScoreTuning:
    tile: ScoreTile = ScoreTile(256, 64, 8, 3, 0, 2)   # 16 tokens per tile on the exact fp32 map: best at 64k
    big: ScoreTile = ScoreTile(128, 64, 8, 2, 2, 2)    # head dims in (128, 256]
    skip_merge: bool = False   # skip a chunk's merge when no token of the tile gains (no gain on random data)
    # pass each chunk's block scores through a per-program scratch before ranking them, so the ranking
    # runs on one copy of each score instead of the head sum's replicated layout (scores._merge_chunk)
    relayout: bool = False
    # G >= 16 with the fp16-split map: add heads g and g + G/2 in fp32 before splitting (half the split and map
    # work; scores._block_sums; sm_90 loop 715 -> 594 instructions per thread). Off: the kernel gained 3-12%
    # (H100, paper shape) but the op stayed within noise, and the block scores are not bitwise the default's
    # (bench/RESULTS.md table 14)
    head_pairs: bool = False
    # from this T (None: never) calls of the paper's geometry (G=16, d_k=128, l=32, d=16, l_sel=64) take the score
    # pass in Gluon on Hopper: warp-specialized, K~ on a TMA ring, each chunk's scores stored, then ranked by a
    # Triton kernel (nsa/ops/triton/scores_gluon.py; the same blocks bit for bit)
    gluon_min_t: int | None = None
    # head dims <= 128 with G <= small_group_max_g query heads per KV head (None: `tile`). Rows hold
    # next_pow2(G) heads of a token, so few heads mean more tokens per tile for the same rows
    small_group: ScoreTile | None = None
    small_group_max_g: int = 8

    def __post_init__(self) -> None:
        if self.gluon_min_t is not None and self.gluon_min_t < 0:
            raise ValueError(f"ScoreTuning.gluon_min_t must be >= 0 or None, got {self.gluon_min_t}")

    def tile_for(self, big: bool, G: int = 16) -> ScoreTile:
        """The tile for padded head dims > 128 (big) or not, with G query heads per KV head."""
        if big:
            return self.big
        if self.small_group is not None and G <= self.small_group_max_g:
            return self.small_group
        return self.tile


@dataclass(frozen=True)
class CmpDenseTuning:
    """Compressed branch on a dense SDPA kernel (nsa/ops/triton/cmp_dense.py) instead of the Triton one.

    mode "auto": the first dense backend whose one-off probe passes, for T >= min_t with
    deterministic algorithms off (cuDNN's backward is not bitwise repeatable); "off": always the
    Triton kernel; "cudnn" / "flash" / "math": that backend (tests, benchmarks)."""

    mode: str = "auto"
    min_t: int = 16384    # below this the gated Triton kernel is as fast

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "off", "cudnn", "flash", "math"):
            raise ValueError(f"CmpDenseTuning.mode must be auto/off/cudnn/flash/math, got {self.mode!r}")


FLASH_BRANCH_MODES = ("off", "auto", "fa4", "fa2", "reference")


@dataclass(frozen=True)
class FlashBranchTuning:
    """NSA branches that are dense problems run on flash-attn (nsa/ops/flash.py) instead of the own
    kernels: `win` the sliding window, `cmp` the compressed branch's regrouped causal problem (in place
    of cuDNN / flash SDPA). Modes: "off"; "auto" = the dense backend the policy chose here when that is
    flash-attn (fa4 / fa2), else off; "fa4" / "fa2" forced; "reference" = fp32 math (CPU tests of the
    wiring). Used from T >= min_t, with d_k == d_v, fp16/bf16, deterministic algorithms off, and
    nsa.allow_flash_attn on."""

    win: str = "off"
    cmp: str = "off"
    min_t: int = 0
    # from this T, the window branch on FA4 / reference takes its backward with each KV head's query heads as
    # batches (nsa/ops/window_split.py: FA4's GQA backward slows where its fp32 dK / dV buffers leave L2); None: off
    win_split_min_t: int | None = None
    # the flash branches whose backward we call ourselves (FA4's entry, or reference) take D = rowsum(o * dO)
    # from the gate gradients instead of reading o again (nsa/ops/branch_sums.py)
    row_sums: bool = True
    # with both branches on flash-attn, the selection's dq kernels run in q's gradient node and add the
    # branches' gradients of q in their epilogue, instead of a separate sum (nsa/ops/triton/qsum.py)
    dq_fold: bool = True
    # the FA4 branches' dq left in FA4's fp32 accumulator and read by q's gradient kernels, without FA4's
    # postprocess converting it first (nsa/ops/fa4_accum.py); also routes the window below win_split_min_t
    # through FA4's backward entry (GQA, unsplit) for it and for row_sums, which there replace FA4's preprocess
    # by a rows kernel and a memset (H100, table 24: -2.15 ms of postprocess, +1.62 in the tile dq at 64k)
    fa4_accum: bool = True
    # the window's gate folded into its lse (lse - ln g_win, D = dg_win): its FA4 backward reads dO itself, so the
    # gate kernel does not write g_win * dO (1 GB at 64k, paper shape; nsa/ops/window_split.py)
    win_gate_lse: bool = True

    @classmethod
    def parse(cls, spec: str) -> "FlashBranchTuning | None":
        """nsa.flash_branches: "preset" -> None (the device preset's), "off", or "+"-joined branches
        ("win", "cmp", "win+cmp") in mode auto from T = 0."""
        if spec == "preset":
            return None
        parts = [] if spec == "off" else spec.split("+")
        if not parts and spec != "off" or any(p not in ("win", "cmp") for p in parts) or len(set(parts)) < len(parts):
            raise ValueError(f"flash_branches={spec!r}: choose preset, off, win, cmp or win+cmp")
        return cls(**{p: "auto" for p in parts})

    def __post_init__(self) -> None:
        if self.win_split_min_t is not None and self.win_split_min_t < 0:
            raise ValueError(f"FlashBranchTuning.win_split_min_t must be >= 0 or None, got {self.win_split_min_t}")
        for f in ("win", "cmp"):
            if getattr(self, f) not in FLASH_BRANCH_MODES:
                raise ValueError(f"FlashBranchTuning.{f} must be one of {FLASH_BRANCH_MODES}, "
                                 f"got {getattr(self, f)!r}")


@dataclass(frozen=True)
class DecodeKnobs:
    """One regime of the decode launches (nsa/ops/triton/decode.py).

    cmp_tile: compressed tokens loaded per sub-tile (own + halo); cmp_per_sm / sw_per_sm: programs
    per multiprocessor the split-K and the selection+window launches aim at; score_slice: blocks per
    scoring program (raised to NB/16); tile: key tokens per selection/window load (<= 64); pdl:
    programmatic dependent launch of launches 2-4."""

    cmp_tile: int = 64
    cmp_per_sm: float = 2
    cmp_warps: int = 4
    cmp_stages: int = 3
    score_slice: int = 128
    score_warps: Warps = 4
    sw_per_sm: float = 2
    slc_warps: int = 8
    slc_stages: int = 3
    tile: int = 64
    comb_warps: Warps = 4
    pdl: bool = True      # helps few rows (latency-bound)


# from large_rows (query row, kv head) pairs on the launches are bandwidth-bound: PDL off, auto warps
_LARGE = DecodeKnobs(score_warps="auto", comb_warps="auto", slc_warps=4, sw_per_sm=3, pdl=False)


@dataclass(frozen=True)
class DecodeTuning:
    """Decode knobs per regime: `small` below large_rows (query row, kv head) pairs, `large` from it."""

    small: DecodeKnobs = DecodeKnobs()
    large: DecodeKnobs = _LARGE
    large_rows: int = 32

    def knobs(self, rows_h: int) -> DecodeKnobs:
        """The knobs for rows_h = B * Tq * H (query row, kv head) pairs."""
        return self.large if rows_h >= self.large_rows else self.small

    def with_knobs(self, **fields) -> "DecodeTuning":
        """The same fields set in both regimes (what a sweep or a test pins)."""
        return dataclasses.replace(self, small=dataclasses.replace(self.small, **fields),
                                   large=dataclasses.replace(self.large, **fields))


@dataclass(frozen=True)
class TorchTuning:
    """The vectorised torch path (nsa/ops/batched.py)."""

    # selected blocks attended block-masked dense while keys <= factor * n_sel * l_sel, gathered beyond;
    # on CPU dense is faster up to 8 * 1024 keys (2 cores, fp32, T = 8k)
    dense_factor: float = 4.0
    cpu_tile: int = 128                 # query tile off-GPU: best or tied on 2 cores (T = 2k..8k)
    # on CUDA fewer, larger tiles (launch-bound): largest multiple of 64 in [tile_min, tile_max] whose
    # fp32 logits B * HQ * tile * keys stay under tile_budget elements
    tile_budget: int = 2 ** 27
    tile_min: int = 64
    tile_max: int = 1024


@dataclass(frozen=True)
class KernelTuning:
    """Everything the kernels are launched with on one device family."""

    name: str
    attn: AttnTuning = AttnTuning()
    select: SelectTuning = SelectTuning()
    tile: TileTuning = TileTuning()        # m=1: selection on the per-token kernels
    scores: ScoreTuning = ScoreTuning()
    cmp_dense: CmpDenseTuning = CmpDenseTuning()
    flash: FlashBranchTuning = FlashBranchTuning()   # all off: the own kernels / SDPA
    decode: DecodeTuning = DecodeTuning()
    torch: TorchTuning = TorchTuning()

    def replace(self, **fields) -> "KernelTuning":
        """dataclasses.replace, as a method (e.g. tuning.replace(cmp_dense=CmpDenseTuning("off")))."""
        return dataclasses.replace(self, **fields)


# sm_90 (H100 / H200): the measured defaults. Window and compressed branches on FlashAttention-4 from
# 8k where installed: the 125M model's CUDA-graph training step gained 2.8% / 2.7% / 3.3% tokens/s at
# 8k / 32k / 64k (H100, bench/RESULTS.md table 0b); eager op calls at 8k-16k are slower on FA4's host
# path (table 1c), which the graphed step does not pay. Selection on query tiles of 8 tokens when a
# strided sample of the call's tiles had a union fraction <= 0.42 (table 0c: against the per-token
# kernels the local layers' op ran 9-14% faster). Against the block-order kernels the tiles no longer pay
# at the production shape: graph-timed on an H100, on random inputs and on a model trained at 64k, the
# per-call choice (threshold 0.2) was 0.3-2.4% slower than no tiles at 8k-64k and training tokens/s was
# the same (table 8), so the preset runs them only at G >= 16 (below); at G <= 8 TileTuning(m=8,
# auto_union=..., min_g=1) opts in (e.g. bench_train --nsa-tuning tile.m=8 tile.min_g=1 tile.auto_union=0.2).
# Forward and dq block by block for G <= 8: at the production shape (HQ=12, H=2, d=64) the op's fwd+bwd
# device time fell 13.5% at 16k (H100, table 7); for G=16 (paper shape) see below. The forward's o partials
# are fp16 scaled by 1/max|v| and the dq partials bf16: all-bf16 partials failed the per-token op's 0.5% on a
# trained model's inputs (dk_slc 0.9%), fp32 o partials cost 7% at 16k, and the scaled fp16 ones match fp32's
# errors against the fp32 op at bf16's speed (table 9).
# For G <= 8: score tiles of 128 rows (16 tokens at G=6, on the same fp16-split map as 256 rows' 32
# tokens), the block-order forward on pieces of 128 list entries, and the dK/dV walk 64 rows (10 packed
# tokens) per step with token ids prefetched: since the walk holds its rows on the MMA's M side it spills
# 56 B instead of heavily, and that beat 128 rows (the best while it spilled, table 8): H100, HQ=12/H=2/d=64, walk
# device time 0.65 -> 0.59 ms at 16k and 2.61 -> 2.38 ms at 64k (bench/RESULTS.md table 9). Their score
# tile capped at 80 registers (122 uncapped, no spills either way) runs 3 blocks per SM instead of 2:
# 0.207 -> 0.188 ms at 16k, 2.750 -> 2.525 ms at 64k (table 10; 72 spills, 96 fits no third block).
# The dK/dV walk's lists in chunks of 512 instead of 1024 where a call has fewer than 512 x 1024 pairs (the
# production shape below 16k): 256 long items left a ragged last wave on 132 SMs; op fwd+bwd at 8k 1.495 ->
# 1.445 and 1.484 -> 1.433 ms, 16k the same with either chunk (table 11; 64k is past the threshold).
# The same capped score tile serves G=16 (8 tokens per tile on the fp16-split map; 224 registers and one
# program per SM on the uncapped 256-row exact-map tile): paper-shape op forward 7.26 -> 7.05 ms at 16k,
# 40.5 -> 39.5 at 64k (table 11; the 128-row tile on the exact map was 7-26% slower, capped or not).
# The block-order forward capped at 128 registers (133 uncapped) runs 4 programs per SM instead of 3: op
# forward 1.024 -> 0.991 ms at 16k, 6.18 -> 6.08 at 64k (96 was slower). G=16 runs the forward per token
# but dq from the dK/dV walk's pair partials (64-row walk): paper-shape fwd+bwd 21.39 -> 20.65 ms at 16k,
# 111.3 -> 109.2 at 64k, where the block-order forward was 4-9% slower (both table 11).
# G=16 only: the selection on query tiles of 4 tokens (64 rows). On a paper-shape TinyLM trained 150 steps at
# 64k (H100, table 12) op fwd+bwd at 64k 108.0 -> 98.3 ms (union 0.42 at m=4) and 109.2 -> 105.5 (0.54), at
# 16k 20.4 -> 17.3 and 20.7 -> 19.1, at 8k 9.9 -> 8.2 and 10.0 -> 8.7; m=2 and m=8 were slower. Since the
# Gluon tile kernels (tables 16-21) the tiles also win or tie on random selections, so every call takes them
# (auto_union 0: no per-call choice, hence no dq partials for a per-token choice and no guarded launches).
# H100, table 24, random f+b: 12k 14.36 -> 11.99 ms, 16k 19.13 -> 16.42, 32k 41.66 -> 39.11, 64k 99.09 ->
# 99.23; captured 64k 80.48 -> 79.82 (layer 3), peak memory 27.41 -> 11.35 GiB (the partials, table 23).
# Scores + top-n: block scores relaid out before ranking, on 256-row tiles capped at 128 registers (H100,
# --branch select, table 13): G=16, d=128 at 8k / 16k / 64k 0.32 / 0.79 / 9.02 -> 0.31 / 0.66 / 7.75 ms;
# G=6, d=64 0.17 / 0.28 / 2.60 -> 0.10 / 0.25 / 1.79 ms.
# The window's backward on grouped views from 16k (nsa/ops/window_split.py; H100, paper shape, random inputs, op
# device ms f+b: 8k 7.67 -> 7.71, 16k 19.78 -> 19.40, 32k 43.57 -> 42.52, 64k 103.85 -> 101.89; table 19).
# The block scores' pass from 32k in Gluon, warp-specialized, each chunk's scores stored and ranked by a Triton kernel
# (nsa/ops/triton/scores_gluon.py; the same blocks bit for bit; H100, paper shape, random: select_blocks 7.89 -> 6.48 ms
# at 64k, 0.68 either way at 16k; op forward 15.39 -> 15.20 ms at 32k, 38.47 -> 37.19 at 64k; table 21).
HOPPER = KernelTuning("hopper", flash=FlashBranchTuning(win="auto", cmp="auto", min_t=8192, win_split_min_t=16384),
                      select=SelectTuning(loop="auto", dq_block_max_g=16, pair_dtype="fp16", dq_pair_dtype="input",
                                          block_dkdv_rows=64, pair_chunk=128, pack_heads=True, prefetch=True,
                                          ids_in_regs=True, pair_max_regs=128, chunk_min_items=512,
                                          walk_loop_stages=3, dq_walk_loop_stages=2, dq_walk_loop_min_g=16,
                                          gluon_walk_stages=2, gluon_dq_walk_stages=2),
                      scores=ScoreTuning(tile=ScoreTile(256, 64, 8, 2, 2, 2, max_regs=128), relayout=True,
                                         gluon_min_t=32768),
                      tile=TileTuning(m=4, auto_union=0.0, min_g=16, gluon_fwd_stages=2,
                                      gluon_dq_stages=2, gluon_dq_short_t=16384, gluon_combine=True, group=32))
# compute capability 8.x: not swept; the Hopper values. They fit sm_80's 163 KB of shared memory per
# block by arithmetic (bf16, head dim 128): the largest, the forward tile, holds its Q rows (128 x 128
# x 2 B = 32 KB) plus 3 stages of K and V key tiles (3 x 2 x 64 x 128 x 2 B = 96 KB), about 128 KB;
# tests/test_kernel_probe.py checks every prefill tile up to head dim 256 against 163 KB this way, and
# the kernel probe (nsa/ops/probe.py) falls back to torch where a launch still fails on the device.
# sm_86 / sm_89 allow 99 KB per block: that tile may not fit there (unmeasured; no preset for them).
AMPERE = KernelTuning("ampere")
# CPU (Triton interpreter, torch path): the score map is the exact fp32 one (also the fastest in the
# interpreter), the torch path attends dense up to 8x n_sel * l_sel keys.
CPU = KernelTuning("cpu", scores=ScoreTuning(tile=ScoreTile(256, 64, 8, 3, 0, 0),
                                             big=ScoreTile(128, 64, 8, 2, 0, 0)),
                   torch=TorchTuning(dense_factor=8.0))
PRESETS = MappingProxyType({t.name: t for t in (HOPPER, AMPERE, CPU)})   # read-only


def tuning_for(device: torch.device | str) -> KernelTuning:
    """The preset for this device: CPU off CUDA, AMPERE for compute capability 8.x, else HOPPER."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return CPU
    try:
        major, _ = torch.cuda.get_device_capability(dev)
    except Exception:  # noqa: BLE001 - no driver (offline compile): the measured defaults
        return HOPPER
    return AMPERE if major == 8 else HOPPER
