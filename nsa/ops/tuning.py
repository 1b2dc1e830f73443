"""Kernel launch parameters as data: one frozen dataclass per kernel family, one preset per device family.

The planner (nsa/ops/plan.py) reads these and names the route of a call; the launchers take their part
as an argument. To try another value, build a variant with `dataclasses.replace` and pass it: nothing
here is patched at run time. No triton import here (the CPU-only install reads these too). Why each
value and what it was measured against: docs/kernels.md. Terms: rows = (query token, query head) pairs
of a program; keys = key tokens per loop step; warps / stages = Triton's num_warps / num_stages.
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


def _need(ok: bool, name: str, want: str, value) -> None:
    """The validators' one error: `name must be <want>, got <value>`."""
    if not ok:
        raise ValueError(f"{name} must be {want}, got {value!r}")


def _int(v, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def check_max_regs(name: str, value) -> None:
    """A register cap (ptxas .maxnreg) is None or an int in [24, 255]."""
    _need(value is None or _int(value, 24) and value <= 255, name, "None or an int in [24, 255]", value)


def check_gluon_slots(name: str, value: int, what: str) -> None:
    """A Gluon kernel's ring slots: 0 (the Triton kernel instead) or >= 2 (one slot cannot prefetch)."""
    _need(value == 0 or value >= 2, name, f"0 (the Triton kernel) or >= 2 ({what} ring slots of the Gluon kernel)",
          value)


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
    block_dkdv_rows: int = 32
    chunk: int = 1024           # tokens of one block's list per dK/dV program
    chunk_min_items: int = 0
    pair_chunk: int = 0         # the same per block-order forward program (0: chunk)
    pack_heads: bool = False
    loop: Literal["token", "block", "auto"] = "token"
    block_max_g: int = 8
    dq_block_max_g: int = 8
    pair_rows: int = 64         # (token, head) rows per step of the block-order forward
    pair_warps: int = 4
    pair_stages: int = 2
    pair_dtype: Literal["fp32", "input", "fp16"] = "fp32"
    dq_pair_dtype: Literal["fp32", "input", None] = None
    prefetch: bool = False
    ids_in_regs: bool = False
    merge_warps: int = 2
    pair_max_regs: int | None = None
    walk_loop_stages: int = 0
    dq_walk_loop_stages: int = 0
    dq_walk_loop_min_g: int = 1
    gluon_walk_stages: int = 0
    gluon_dq_walk_stages: int = 0

    def __post_init__(self) -> None:
        for name in ("gluon_walk_stages", "gluon_dq_walk_stages"):
            check_gluon_slots(f"select.{name}", getattr(self, name), "q / dO")
        for name in ("walk_loop_stages", "dq_walk_loop_stages"):
            v = getattr(self, name)
            _need(v in (0, 2, 3, 4) and not isinstance(v, bool), f"select.{name}", "0 (off), 2, 3 or 4", v)
        check_max_regs("select.pair_max_regs", self.pair_max_regs)
        for name, ok, want in (
                ("dq_walk_loop_min_g", _int(self.dq_walk_loop_min_g, 1), "an int >= 1 (query heads per KV head)"),
                ("loop", self.loop in ("token", "block", "auto"), "token, block or auto"),
                ("pair_dtype", self.pair_dtype in ("fp32", "input", "fp16"), "fp32, input or fp16"),
                ("dq_pair_dtype", self.dq_pair_dtype in ("fp32", "input", None), "fp32, input or null (pair_dtype)"),
                ("chunk", self.chunk >= 1, ">= 1 (tokens per dK/dV program)"),
                ("chunk_min_items", _int(self.chunk_min_items), "an int >= 0 (0: off)"),
                ("pair_chunk", self.pair_chunk >= 0, ">= 0 (0: select.chunk)"),
                ("block_max_g", _int(self.block_max_g), "an int >= 0 (query heads per KV head)"),
                ("dq_block_max_g", _int(self.dq_block_max_g), "an int >= 0 (query heads per KV head)"),
                *((n, isinstance(getattr(self, n), bool), "true or false") for n in ("pack_heads", "prefetch",
                                                                                        "ids_in_regs"))):
            _need(ok, f"select.{name}", want, getattr(self, name))


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

    m: tokens per tile (1: the per-token / block-order kernels of SelectTuning), for G >= min_g. Rows = m*G
    padded to a power of two (>= 16); `fwd` and `dq` hold (launch for rows <= 64, launch for rows > 64):
    Hopper's wgmma wants >= 64 rows, and 3 stages of bf16 d=128 K/V tiles fit sm_80's shared memory."""

    m: int = 1
    fwd: tuple[TileLaunch, TileLaunch] = (TileLaunch(64, 4, 3), TileLaunch(32, 8, 3))
    dq: tuple[TileLaunch, TileLaunch] = (TileLaunch(64, 4, 2), TileLaunch(32, 8, 2))
    big_keys: int = 32              # cap on keys per stage for padded head dims > 128
    min_g: int = 1                  # tiles only from this many query heads per KV head (G)
    gluon_fwd_stages: int = 0       # Gluon tile forward's K/V ring slots where eligible (0: Triton)
    gluon_dq_stages: int = 0        # the same for the tile dq kernel
    gluon_dq_short_t: int = 0       # below this T the Gluon dq takes gluon_dq_short_stages slots (0: never)
    gluon_dq_short_stages: int = 3
    gluon_combine: bool = False     # the tile forward also writes the op's gated sum (no combine pass)
    group: int = 0                  # regroup each window of `group` tokens into alike tiles (0: consecutive)

    def __post_init__(self) -> None:
        _need(1 <= self.m <= TILE_MAX_M, "TileTuning.m", f"in 1..{TILE_MAX_M} (1: per-token kernels)", self.m)
        _need(self.min_g >= 1, "TileTuning.min_g", ">= 1 (1: tiles at every G)", self.min_g)
        _need(self.group in (0, 8, 16, 32, 64) and not self.group % self.m, "TileTuning.group",
              f"0 (consecutive tokens) or 8 / 16 / 32 / 64, a multiple of m={self.m}", self.group)
        for f in ("gluon_fwd_stages", "gluon_dq_stages", "gluon_dq_short_stages"):
            check_gluon_slots(f"TileTuning.{f}", getattr(self, f), "K/V")
        _need(self.gluon_dq_short_t >= 0, "TileTuning.gluon_dq_short_t", ">= 0 (0: never)", self.gluon_dq_short_t)

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
    max_regs: int | None = None

    def __post_init__(self) -> None:
        check_max_regs("ScoreTile.max_regs", self.max_regs)


@dataclass(frozen=True)
class ScoreTuning:
    tile: ScoreTile = ScoreTile(256, 64, 8, 3, 0, 2)   # 16 tokens per tile on the exact fp32 map: best at 64k
    big: ScoreTile = ScoreTile(128, 64, 8, 2, 2, 2)    # head dims in (128, 256]
    relayout: bool = False     # rank each chunk's scores from a scratch copy, not the replicated head-sum layout
    gluon_min_t: int | None = None   # from this T the paper geometry's score pass in Gluon (None: never)

    def __post_init__(self) -> None:
        _need(self.gluon_min_t is None or self.gluon_min_t >= 0, "ScoreTuning.gluon_min_t", ">= 0 or None",
              self.gluon_min_t)

    def tile_for(self, big: bool) -> ScoreTile:
        """The tile for padded head dims > 128 (big) or not."""
        return self.big if big else self.tile


EXACT_SCORES = ScoreTuning(tile=ScoreTile(256, 64, 8, 3, 0, 0), big=ScoreTile(128, 64, 8, 2, 0, 0))   # fp32 maps


@dataclass(frozen=True)
class CmpDenseTuning:
    """Compressed branch on a dense SDPA kernel (nsa/ops/triton/cmp_dense.py) instead of the Triton one.

    mode "auto": the first dense backend whose one-off probe passes, for T >= min_t with
    deterministic algorithms off (cuDNN's backward is not bitwise repeatable); "off": always the
    Triton kernel; "cudnn" / "flash" / "math": that backend (tests, benchmarks)."""

    mode: str = "auto"
    min_t: int = 16384    # below this the gated Triton kernel is as fast

    def __post_init__(self) -> None:
        _need(self.mode in ("auto", "off", "cudnn", "flash", "math"), "CmpDenseTuning.mode", "auto/off/cudnn/flash/math",
              self.mode)


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
    win_split_min_t: int | None = None
    row_sums: bool = True
    dq_fold: bool = True
    fa4_accum: bool = True
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
        _need(self.win_split_min_t is None or self.win_split_min_t >= 0, "FlashBranchTuning.win_split_min_t",
              ">= 0 or None", self.win_split_min_t)
        for f in ("win", "cmp"):
            _need(getattr(self, f) in FLASH_BRANCH_MODES, f"FlashBranchTuning.{f}", f"one of {FLASH_BRANCH_MODES}",
                  getattr(self, f))


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

    dense_factor: float = 8.0
    cpu_tile: int = 128                 # query tile off-GPU: best or tied on 2 cores (T = 2k..8k)
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


def family_of(capability: tuple[int, int] | None) -> str:
    """The architecture family of a CUDA compute capability (None: no CUDA device)."""
    if capability is None:
        return "cpu"
    major = capability[0]
    return "sm100" if major >= 10 else "sm90" if major == 9 else "sm80" if major == 8 else "sm75"


def tuning_for(device: torch.device | str) -> KernelTuning:
    """The preset of this device's family (CPU off CUDA; the sm90 values where no driver answers)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return CPU
    try:
        cap = torch.cuda.get_device_capability(dev)
    except Exception:  # noqa: BLE001 - no driver (offline compile): the measured defaults
        cap = (9, 0)
    return PRESETS[FAMILY_PRESET[family_of(cap)]]
