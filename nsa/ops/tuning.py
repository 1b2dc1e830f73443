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


@dataclass(frozen=True)
class ScoreTuning:
    tile: ScoreTile = ScoreTile(256, 64, 8, 3, 0, 2)   # 16 tokens per tile on the exact fp32 map: best at 64k
    big: ScoreTile = ScoreTile(128, 64, 8, 2, 2, 2)    # head dims in (128, 256]
    skip_merge: bool = False   # skip a chunk's merge when no token of the tile gains (no gain on random data)

    def tile_for(self, big: bool) -> ScoreTile:
        return self.big if big else self.tile


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
    scores: ScoreTuning = ScoreTuning()
    cmp_dense: CmpDenseTuning = CmpDenseTuning()
    decode: DecodeTuning = DecodeTuning()
    torch: TorchTuning = TorchTuning()

    def replace(self, **fields) -> "KernelTuning":
        """dataclasses.replace, as a method (e.g. tuning.replace(cmp_dense=CmpDenseTuning("off")))."""
        return dataclasses.replace(self, **fields)


# sm_90 (H100 / H200): the measured defaults.
HOPPER = KernelTuning("hopper")
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
