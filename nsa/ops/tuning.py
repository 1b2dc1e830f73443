"""Kernel launch parameters as data: one frozen dataclass per kernel family, one preset per device family.

The planner (nsa/ops/plan.py) reads these and names a call's route; the launchers take their part as an
argument. A variant is built with `dataclasses.replace` and passed (nothing is patched at run time); the
checks are in tuning_checks.py, the measurements behind the values in docs/kernels.md. No triton import
(the CPU-only install reads these). rows = (query token, query head) pairs of a program; keys = key tokens
per loop step; warps / stages = Triton's num_warps / num_stages."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, Union

import torch

from . import tuning_checks as checks

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
    """Compressed / window attention (nsa/ops/triton/attn.py); big_*: padded head dims in (128, 256]."""

    fwd: Tile = Tile(128, 64, 8, 3)       # 3 stages beat 2 at 32k (bf16, d=128)
    dq: Tile = Tile(128, 32, 8, 3)        # best dq tile at 32k and 64k
    dkdv: Tile = Tile(32, 64, 4, 3)       # rows = query rows per step, keys = keys per program; best with gates
    big_fwd: Tile = Tile(64, 32, 8, 2)    # the doubled head dim leaves shared memory for fewer rows and stages
    big_dq: Tile = Tile(32, 32, 8, 1)     # likewise
    big_dkdv: Tile = Tile(16, 32, 8, 1)   # likewise

    def tiles(self, big: bool) -> tuple[Tile, Tile, Tile]:
        """(fwd, dq, dkdv) for padded head dims <= 128 (big=False) or in (128, 256] (big=True)."""
        return (self.big_fwd, self.big_dq, self.big_dkdv) if big else (self.fwd, self.dq, self.dkdv)


@dataclass(frozen=True)
class SelectTuning:
    """Selected-block attention (nsa/ops/triton/select.py): forward, dq and dK/dV kernels."""

    fwd_warps: int = 2          # 2 warps edge out 4 at 64k with gates (1 is slower)
    dq_warps: int = 2           # the per-token dq kernel's
    dkdv_warps: int = 4         # 2 warps spill badly
    fwd_stages: int = 2         # 2 stages beat 1 and 3 over the whole selection backward
    dq_stages: int = 2          # as fwd_stages (measured over the selection backward)
    dkdv_stages: int = 2        # likewise
    fwd_keys: int = 64          # key rows per pipeline stage (capped by l_sel); smaller tiles were slower
    dq_keys: int = 64           # as fwd_keys, for the dq kernel
    dkdv_rows: int = 32         # (query, head) rows per step of dK/dV; best with gates at 64k
    block_dkdv_rows: int = 32   # dkdv_rows where dq comes from the walk's pair partials (route.dkdv_rows_for)
    chunk: int = 1024           # tokens of one block's list per dK/dV program
    chunk_min_items: int = 0    # halve chunk while a call fills fewer full chunks (0: off; route.chunk_for)
    pair_chunk: int = 0         # the same per block-order forward program (0: chunk)
    pack_heads: bool = False    # the walks' rows per token: G packed, else next_pow2(G)
    loop: Literal["token", "block", "auto"] = "token"   # selection forward per token / by block / by G (auto)
    block_max_g: int = 8        # auto: the block-order forward up to this G
    dq_block_max_g: int = 8     # auto: dq from the walk's pair partials up to this G
    pair_rows: int = 64         # (token, head) rows per step of the block-order forward
    pair_warps: int = 4         # the block-order forward's
    pair_stages: int = 2        # likewise
    pair_dtype: Literal["fp32", "input", "fp16"] = "fp32"   # the forward's pair partials (fp16: o / max|v|)
    dq_pair_dtype: Literal["fp32", "input", None] = None   # the walk's dq partials (None: pair_dtype)
    prefetch: bool = False      # the Triton walk loads token ids two steps ahead
    ids_in_regs: bool = False   # the block-order forward's token ids from registers
    merge_warps: int = 2        # the per-token merge of the pair partials
    pair_max_regs: int | None = None   # register cap of the block-order forward (GPU only)
    walk_loop_stages: int = 0   # tl.range stages of the walk's step loop (0: a plain loop)
    dq_walk_loop_stages: int = 0   # the same with dq partials, from G >= dq_walk_loop_min_g
    dq_walk_loop_min_g: int = 1   # see dq_walk_loop_stages
    gluon_walk_stages: int = 0  # the Gluon walk's q / dO ring slots where eligible (0: Triton)
    gluon_dq_walk_stages: int = 0   # the same for the walk with dq partials

    def __post_init__(self) -> None:
        checks.check_select(self)


TILE_MAX_M = 32   # token bits of a tile-union entry live in one int32


@dataclass(frozen=True)
class TileLaunch:
    """One query-tile fwd or dq launch: key rows per pipeline stage (capped by l_sel), warps, stages."""

    keys: int
    warps: int
    stages: int


@dataclass(frozen=True)
class TileTuning:
    """Selection on query tiles (nsa/ops/triton/select_tile.py): m tokens x the G heads of a KV head per program
    (rows = m*G padded to a power of two >= 16), loading each block of the tile's union of selections once."""

    m: int = 1                      # tokens per tile from G >= min_g (1: SelectTuning's per-token / block kernels)
    # (rows <= 64, rows > 64): Hopper's wgmma wants >= 64 rows; 3 stages of bf16 d=128 K/V fit sm_80's shared memory
    fwd: tuple[TileLaunch, TileLaunch] = (TileLaunch(64, 4, 3), TileLaunch(32, 8, 3))
    dq: tuple[TileLaunch, TileLaunch] = (TileLaunch(64, 4, 2), TileLaunch(32, 8, 2))   # the tile dq's
    big_keys: int = 32              # cap on keys per stage for padded head dims > 128
    min_g: int = 1                  # tiles only from this many query heads per KV head (G)
    gluon_fwd_stages: int = 0       # Gluon tile forward's K/V ring slots where eligible (0: Triton)
    gluon_dq_stages: int = 0        # the same for the tile dq kernel
    gluon_dq_short_t: int = 0       # below this T the Gluon dq takes gluon_dq_short_stages slots (0: never)
    gluon_dq_short_stages: int = 3  # see gluon_dq_short_t
    gluon_combine: bool = False     # the tile forward also writes the op's gated sum (no combine pass)
    group: int = 0                  # regroup each window of `group` tokens into alike tiles (0: consecutive)

    def __post_init__(self) -> None:
        checks.check_tile(self, TILE_MAX_M)

    def launch(self, pair: tuple[TileLaunch, TileLaunch], rows: int) -> TileLaunch:
        return pair[0] if rows <= 64 else pair[1]


@dataclass(frozen=True)
class ScoreTile:
    """Fused block scores + top-n (nsa/ops/triton/scores.py select_blocks). Maps: 0 = head sum then band sum on
    CUDA cores (exact fp32); 1 = p @ cnt on tensor cores at tf32x3 (spills; tests only) then head sum; 2 = p @ cnt
    as two fp16 products (hi + lo * 2**-12, ~22-bit p) then head sum."""

    rows: int
    min_keys: int       # min compressed tokens per chunk (BN is at least this)
    warps: int
    stages: int
    map_small: int      # tiles of <= 16 tokens with BT * BN * NBJ_PAD <= 16384
    map_big: int        # the other tiles
    max_regs: int | None = None   # ptxas register cap, GPU launches only (None: no cap)

    def __post_init__(self) -> None:
        checks.check_max_regs("ScoreTile.max_regs", self.max_regs)


@dataclass(frozen=True)
class ScoreTuning:
    tile: ScoreTile = ScoreTile(256, 64, 8, 3, 0, 2)   # 16 tokens per tile on the exact fp32 map: best at 64k
    big: ScoreTile = ScoreTile(128, 64, 8, 2, 2, 2)    # head dims in (128, 256]
    relayout: bool = False     # rank each chunk's scores from a scratch copy, not the replicated head-sum layout
    gluon_min_t: int | None = None   # from this T the paper geometry's score pass in Gluon (None: never)

    def __post_init__(self) -> None:
        checks.check_scores(self)

    def tile_for(self, big: bool) -> ScoreTile:
        """The tile for padded head dims > 128 (big) or not."""
        return self.big if big else self.tile


EXACT_SCORES = ScoreTuning(tile=ScoreTile(256, 64, 8, 3, 0, 0), big=ScoreTile(128, 64, 8, 2, 0, 0))   # fp32 maps


@dataclass(frozen=True)
class CmpDenseTuning:
    """Compressed branch on a dense SDPA kernel (nsa/ops/triton/cmp_dense.py) instead of the Triton one."""

    # auto: the first backend whose one-off probe passes, from min_t, deterministic algorithms off (cuDNN's
    # backward is not bitwise repeatable); off: the Triton kernel; cudnn / flash / math: forced (tests, benchmarks)
    mode: str = "auto"
    min_t: int = 16384    # below this the gated Triton kernel is as fast

    def __post_init__(self) -> None:
        checks.check_cmp_dense(self)


@dataclass(frozen=True)
class FlashBranchTuning:
    """NSA branches that are dense problems on flash-attn (nsa/ops/flash.py) instead of the own kernels, from
    T >= min_t with d_k == d_v, fp16/bf16, deterministic algorithms off and nsa.allow_flash_attn on. Modes:
    off; auto = the policy's dense backend where that is fa4 / fa2; fa4 / fa2 forced; reference = fp32 math."""

    win: str = "off"                    # the sliding window
    cmp: str = "off"                    # the compressed branch's regrouped causal problem (before cuDNN / SDPA)
    min_t: int = 0              # flash branches from this T
    win_split_min_t: int | None = None  # from this T (B = 1) the window's backward per KV head: FA4's GQA one is slow
    row_sums: bool = True               # the branches' D from the gate gradients: their backward skips reading o
    dq_fold: bool = True                # the selection's dq kernels add the flash branches' dq in their epilogue
    fa4_accum: bool = True              # the flash branches' dq stays in FA4's fp32 accumulator until that sum
    win_gate_lse: bool = True           # the window's gate goes into its lse: its backward reads dO unscaled

    @classmethod
    def parse(cls, spec: str) -> "FlashBranchTuning | None":
        """nsa.flash_branches (tuning_checks.flash_branches): None for "preset", else the branches named."""
        modes = checks.flash_branches(spec)
        return None if modes is None else cls(**modes)

    def __post_init__(self) -> None:
        checks.check_flash(self)


@dataclass(frozen=True)
class DecodeKnobs:
    """One regime of the decode launches (nsa/ops/triton/decode.py)."""

    cmp_tile: int = 64          # compressed tokens loaded per sub-tile (own + halo)
    cmp_per_sm: float = 2       # programs per multiprocessor the split-K launch aims at
    cmp_warps: int = 4          # the split-K launch's
    cmp_stages: int = 3         # likewise
    score_slice: int = 128      # blocks per scoring program (raised to NB/16)
    score_warps: Warps = 4      # the scoring launch's
    sw_per_sm: float = 2        # programs per multiprocessor the selection + window launch aims at
    slc_warps: int = 8          # the selection + window launch's
    slc_stages: int = 3         # likewise
    tile: int = 64              # key tokens per selection / window load (<= 64)
    comb_warps: Warps = 4       # the combine launch's
    pdl: bool = True            # programmatic dependent launch of launches 2-4: helps few rows (latency-bound)


@dataclass(frozen=True)
class DecodeTuning:
    """Decode knobs per regime: `small` below large_rows (query row, kv head) pairs, `large` from it."""

    small: DecodeKnobs = DecodeKnobs()
    large: DecodeKnobs = DecodeKnobs(score_warps="auto", comb_warps="auto", slc_warps=4, sw_per_sm=3, pdl=False)
    large_rows: int = 32        # (query row, kv head) pairs from which `large` applies

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

    dense_factor: float = 8.0           # masked dense selection up to factor * n_sel * l_sel keys, gathers beyond
    cpu_tile: int = 128                 # query tile off-GPU: best or tied on 2 cores (T = 2k..8k)
    tile_budget: int = 2 ** 27          # fp32 logits per query tile (B * HQ * tile * keys)
    tile_min: int = 64                  # query tile bounds
    tile_max: int = 1024                # likewise


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


# sm_90: the swept values; flash-attn 4 branches from 8k, block order for G <= 8, query tiles
# (Gluon) for G >= 16, capped-register score tiles; docs/kernels.md gives the reason and measurement of each.
HOPPER = KernelTuning("hopper", flash=FlashBranchTuning(win="auto", cmp="auto", min_t=8192, win_split_min_t=16384),
                      select=SelectTuning(loop="auto", dq_block_max_g=16, pair_dtype="fp16", dq_pair_dtype="input",
                                          block_dkdv_rows=64, pair_chunk=128, pack_heads=True, prefetch=True,
                                          ids_in_regs=True, pair_max_regs=128, chunk_min_items=512,
                                          walk_loop_stages=3, dq_walk_loop_stages=2, dq_walk_loop_min_g=16,
                                          gluon_walk_stages=2, gluon_dq_walk_stages=2),
                      scores=ScoreTuning(tile=ScoreTile(256, 64, 8, 2, 2, 2, max_regs=128), relayout=True,
                                         gluon_min_t=32768),
                      tile=TileTuning(m=4, min_g=16, gluon_fwd_stages=2, gluon_dq_stages=2, gluon_dq_short_t=16384,
                                      gluon_combine=True, group=32),
                      torch=TorchTuning(dense_factor=4.0))
# compute capability 8.x: not swept; the defaults, which fit sm_80's 163 KB of shared memory per block by
# arithmetic (tests/test_kernel_probe.py checks every prefill tile against it; probe.py falls back to torch)
AMPERE = KernelTuning("ampere", torch=TorchTuning(dense_factor=4.0))
# CPU (Triton interpreter, torch path): the exact fp32 score map (also the fastest in the interpreter)
CPU = KernelTuning("cpu", scores=EXACT_SCORES)
PRESETS = MappingProxyType({t.name: t for t in (HOPPER, AMPERE, CPU)})   # read-only


# the preset of each architecture family (nsa/ops/plan.py ARCHS: what else each family can run)
FAMILY_PRESET = MappingProxyType({"sm100": "hopper", "sm90": "hopper", "sm80": "ampere", "sm75": "hopper",
                                  "cpu": "cpu"})


def tuning_for(device: torch.device | str) -> KernelTuning:
    """The preset of this device's family (CPU off CUDA; the sm90 values where no driver answers)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return CPU
    try:
        cap = torch.cuda.get_device_capability(dev)
    except Exception:  # noqa: BLE001 - no driver (offline compile): the measured defaults
        cap = (9, 0)
    return PRESETS[FAMILY_PRESET[checks.family_of(cap)]]
