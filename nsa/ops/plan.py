"""The route of one NSA op call, decided in one place: `select_plan(PlanInputs, KernelTuning) -> OpPlan`.

select_plan is pure and cached: it reads the call's shapes, dtype, architecture family (one capability
row per family, ARCHS), grad / deterministic / capture state, what is installed, the probes' outcomes
and the paths refused on this device (nsa/ops/fallbacks.py), and names every choice with a reason. It
never reads tensor contents, synchronises or allocates. `plan_call` gathers those inputs from the
call's tensors (strides and alignment are layout facts, not values), runs a needed one-off probe outside
a CUDA-graph capture, and plans again. What one tuning value means for G heads per KV head: nsa/ops/route.py;
the choices and the measurements behind them: docs/kernels.md.

    python -m nsa.ops.plan --device h200 --shape prod --T 16384      # prints the route
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
from dataclasses import dataclass, field
from types import MappingProxyType

from . import fallbacks
from .tuning import FAMILY_PRESET, PRESETS, KernelTuning, tuning_for  # noqa: F401 - re-exported
from .route import (PairPlan, WalkPlan, by_block, chunk_for, dq_by_block, dq_stages_for, m_for, offset_route,
                    pair_plan, t_ok, walk_plan)
from .tuning_checks import family_of

UNKNOWN = "?"   # a probe outcome not known yet: the plan asks for it (OpPlan.needs)


@dataclass(frozen=True)
class Arch:
    """What one architecture family can run (replaces compute-capability checks at the call sites)."""

    family: str
    preset: str         # the KernelTuning preset (nsa/ops/tuning.py PRESETS)
    cuda: bool
    gluon: bool         # Hopper TMA / wgmma Gluon kernels (tile, walk, scores)
    fa4: bool           # flash-attn 4 (SM90+)
    fa2: bool           # flash-attn 2 (SM80+)


ARCHS = MappingProxyType({a.family: a for a in (
    Arch("sm100", FAMILY_PRESET["sm100"], True, False, True, True),   # Blackwell: FA4 yes, Gluon kernels are Hopper's
    Arch("sm90", FAMILY_PRESET["sm90"], True, True, True, True),
    Arch("sm80", FAMILY_PRESET["sm80"], True, False, False, True),
    Arch("sm75", FAMILY_PRESET["sm75"], True, False, False, False),  # older CUDA: the own Triton kernels only
    Arch("cpu", FAMILY_PRESET["cpu"], False, False, False, False),
)})
DEVICES = MappingProxyType({"h200": "sm90", "h100": "sm90", "a100": "sm80", "cpu": "cpu"})


@dataclass(frozen=True)
class PlanInputs:
    """Everything a plan depends on; hashable. layout: which operands the TMA kernels can address
    ("q_heads": q one row per (token, head), 16-byte aligned; "kv_rows": k/v of the selection as 2-D
    rows; "kcmp_rows": k_cmp likewise; "q_contig"). refused: paths fallbacks.refused() names for this
    device / dtype / head sizes. dense / sdpa: the flash-attn choice and the dense-SDPA probe here
    (UNKNOWN until asked for)."""

    arch: str
    dtype: str
    B: int
    T: int
    HQ: int
    H: int
    d_k: int
    d_v: int
    N: int                      # compressed tokens
    l: int = 32
    d: int = 16
    l_sel: int = 64
    n_sel: int = 16
    w: int = 512
    grad: bool = True           # torch.is_grad_enabled()
    q_grad: bool = True         # grad and q.requires_grad
    deterministic: bool = False
    capturing: bool = False
    installed: frozenset = frozenset()          # {"fa4", "fa2", "gluon"}
    layout: frozenset = frozenset(("q_heads", "kv_rows", "kcmp_rows", "q_contig"))
    refused: frozenset = frozenset()
    dense: str = UNKNOWN        # flash.choose_dense_backend's pick (fa4 / fa2 / sdpa_*)
    sdpa: str | None = UNKNOWN  # cmp_dense.probe's backend (cudnn / flash / None)
    chunk: int | None = None    # dK/dV chunk forced by the caller
    q_off: bool = False         # queries at an offset (pos0 > 0: context parallelism): route.offset_route


@dataclass(frozen=True)
class OpPlan:
    """Every choice of one call, each with a reason (why[name])."""

    arch: str
    cmp: str                    # triton | cudnn | flash | math | fa4 | fa2 | reference
    win: str                    # triton | fa4 | fa2 | reference
    win_entry: str              # plain (dense_attention) | entry (FA4's backward entry) | split (grouped views)
    win_gate_lse: bool
    scores: str                 # triton | gluon
    m: int                      # tokens per query tile, 1: no tiles
    fwd: str                    # token | block | tile | tile_gluon
    fwd_gluon: int              # Gluon forward ring slots (fwd == tile_gluon)
    combine: bool               # the tile forward writes the op's output (no separate combine pass)
    bwd: str                    # token | pairs | tile
    dq_gluon: int               # Gluon tile dq ring slots, 0: Triton
    walk: WalkPlan
    chunk: int                  # tokens of a block's list per dK/dV program
    dq_fold: bool               # selection dq kernels run in q's gradient node with the flash branches' dq
    row_sums: bool              # flash branches take D from the gate gradients
    fa4_accum: bool             # flash branches' dq left in FA4's fp32 accumulator
    pairs: PairPlan = None      # block-order partials (pair_plan)
    relayout: bool = False      # scores: rank each chunk from a scratch copy
    tile_group: int = 0         # query tiles regrouped within windows of this many tokens (0: consecutive)
    tuning: KernelTuning = field(repr=False, compare=False, default=None)
    why: tuple = ()             # ((choice, reason), ...)
    needs: str | None = None    # a probe outcome to fill in before this plan holds ("dense" / "sdpa")
    q_off: bool = False         # the query-offset route (route.offset_route): the steps get the call's offset

    def reason(self, name: str) -> str:
        return dict(self.why).get(name, "")

    def line(self) -> str:
        """One line naming the route (logs, env.json)."""
        w = self.walk
        walk = f"walk{'+dq' if w.dq_pairs else ''}={'gluon' if w.gluon else 'triton'}/{w.rows}r"
        return (f"plan[{self.arch}] cmp={self.cmp} win={self.win}/{self.win_entry} scores={self.scores} "
                f"slc fwd={self.fwd}{'/m' + str(self.m) if self.m > 1 else ''} bwd={self.bwd}"
                f"{'/dq-gluon' if self.dq_gluon else ''} {walk} chunk={self.chunk} dq_fold={int(self.dq_fold)} "
                f"row_sums={int(self.row_sums)} fa4_accum={int(self.fa4_accum)}{' q_off=1' if self.q_off else ''}")


def _half(inp: PlanInputs) -> bool:
    return inp.dtype in ("bfloat16", "float16")


# why a preset's flash part stands where it was never measured (only Hopper's was: docs/kernels.md)
FLASH_UNMEASURED = MappingProxyType({"ampere": "ampere preset: not measured on an A100; FA2 untried"})


def _flash_note(tn: KernelTuning) -> str | None:
    """None where tn.flash is the measured (hopper) preset's, else why its values are not measurements."""
    return None if tn.flash == PRESETS["hopper"].flash else \
        FLASH_UNMEASURED.get(tn.name, f"{tn.name} preset: not the measured hopper values")


def _flash(branch: str, inp: PlanInputs, tn: KernelTuning, arch: Arch) -> tuple[str | None, str]:
    """(fa4 / fa2 / reference or None, why) for a branch under tuning.flash (flash.branch_flash_backend's rule)."""
    f = tn.flash
    mode = getattr(f, branch)
    if mode == "off":
        return None, (f"tuning.flash off ({FLASH_UNMEASURED[tn.name]})" if tn.name in FLASH_UNMEASURED
                      else f"tuning.flash.{branch}=off")
    if mode == "reference":
        return "reference", f"tuning.flash.{branch}=reference (fp32 math)"
    if inp.T < f.min_t:
        return None, f"T={inp.T} < tuning.flash.min_t={f.min_t}"
    if inp.d_k != inp.d_v:
        return None, f"d_k={inp.d_k} != d_v={inp.d_v}"
    if inp.deterministic:
        return None, "deterministic algorithms on (flash-attn's backward is not bitwise repeatable)"
    if mode == "auto":
        if inp.dense == UNKNOWN:
            return UNKNOWN, "dense"
        if inp.dense in ("fa4", "fa2"):
            note = _flash_note(tn)
            return inp.dense, (f"{inp.dense} (tuning.flash.{branch}=auto; measured faster from T={f.min_t})"
                               if note is None else f"{inp.dense} (tuning.flash.{branch}=auto from T={f.min_t}; {note})")
        return None, f"no flash-attn backend chosen here ({inp.dense})"
    ok = (arch.cuda and _half(inp) and 8 <= inp.d_k <= 256 and inp.d_k % 8 == 0
          and getattr(arch, mode) and mode in inp.installed)
    return (mode, f"{mode} (forced by tuning.flash.{branch})") if ok else (None, f"{mode}: not eligible here")


def _cmp(inp: PlanInputs, tn: KernelTuning, arch: Arch) -> tuple[str, str]:
    cfg = tn.cmp_dense
    if cfg.mode == "off" or inp.N == 0:
        return "triton", "cmp_dense.mode=off" if cfg.mode == "off" else "no compressed token"
    fb, why = _flash("cmp", inp, tn, arch)
    if fb == UNKNOWN:
        return UNKNOWN, why
    if fb is not None and f"cmp_flash:{fb}" not in inp.refused:
        return fb, why
    if cfg.mode != "auto":
        return cfg.mode, f"cmp_dense.mode={cfg.mode} (forced)"
    if not arch.cuda or inp.T < cfg.min_t or inp.deterministic:
        return "triton", (f"T < cmp_dense.min_t={cfg.min_t}: the gated Triton kernel is as fast" if arch.cuda
                          and not inp.deterministic else "dense SDPA needs CUDA without deterministic algorithms")
    if "cmp_sdpa" in inp.refused:
        return "triton", "dense SDPA refused here at run time"
    if inp.sdpa == UNKNOWN:
        return ("triton", "dense SDPA not probed yet (never inside a capture)") if inp.capturing else (UNKNOWN, "sdpa")
    return (inp.sdpa, f"dense SDPA {inp.sdpa} (probed; faster from T={cfg.min_t})") if inp.sdpa else \
        ("triton", "no dense SDPA backend passed the probe")


def _tile_gluon_ok(inp: PlanInputs, arch: Arch, m: int) -> bool:
    """The Gluon tile kernels' shape (tile_gluon.py: 64 / 128 rows, l_sel 64, d_k = d_v = 128, TMA rows)."""
    if not (arch.gluon and "gluon" in inp.installed and "gluon_tile" not in inp.refused and _half(inp)):
        return False
    from .triton import tile_gluon as tg
    return (m * (inp.HQ // inp.H) in tg.TILE_ROWS and inp.l_sel == tg.LSEL and inp.d_k == inp.d_v == tg.HEAD_DIM
            and "kv_rows" in inp.layout)


def _scores_gluon_ok(inp: PlanInputs, arch: Arch) -> bool:
    """The Gluon score pass's geometry (scores_gluon.py) and a scratch that fits."""
    if not (arch.gluon and "gluon" in inp.installed and "gluon_scores" not in inp.refused and _half(inp)
            and inp.N > 0 and "kcmp_rows" in inp.layout):
        return False
    from .triton import scores_gluon as sg
    g = sg.GEOMETRY
    return (inp.HQ == g["G"] * inp.H and inp.d_k == g["dk"] and (inp.l, inp.d, inp.l_sel) == (g["l"], g["d"], g["l_sel"])
            and 1 <= inp.n_sel <= sg.NBJ_PAD and sg.scratch_bytes(inp.B, inp.T, inp.H, inp.l_sel) <= sg.MAX_SCRATCH_BYTES)


def _walk(inp: PlanInputs, tn: KernelTuning, arch: Arch, dq_pairs: bool) -> WalkPlan:
    G = inp.HQ // inp.H

    def gluon_ok(rows: int) -> bool:   # walk_gluon.py: 64-row steps of whole tokens' heads, q / dO rows by TMA
        from .triton import walk_gluon as wg
        return (rows == wg.ROWS and rows % G == 0 and "q_heads" in inp.layout and inp.B * inp.T * inp.HQ < 2 ** 31
                and _tile_gluon_ok(inp, arch, rows // G))
    return walk_plan(tn.select, G, max(inp.d_k, inp.d_v) > 128, dq_pairs, gluon_ok)


def _chunk(inp: PlanInputs, tn: KernelTuning) -> int:
    """Halve the chunk while the call's (token, kv head, block) pairs fill few full ones (ragged last wave)."""
    return inp.chunk if inp.chunk is not None else chunk_for(tn.select, inp.B * inp.T * inp.H * inp.n_sel)


@functools.lru_cache(maxsize=512)
def select_plan(inp: PlanInputs, tn: KernelTuning) -> OpPlan:
    """The call's route (module doc). Pure: the same inputs give the same plan."""
    if inp.q_off:   # queries at an offset: the one route whose kernels all take one, whatever else holds
        return OpPlan(inp.arch, **offset_route(tn, inp.HQ // inp.H, max(inp.d_k, inp.d_v), _chunk(inp, tn)))
    arch = ARCHS[inp.arch]
    cmp, r_cmp = _cmp(inp, tn, arch)
    win, r_win = ("triton", "flash-attn refused this shape here") if "win_flash" in inp.refused else \
        _flash("win", inp, tn, arch)
    if win is None:
        win, r_win = "triton", r_win + "; the own Triton kernel"
    unknown = [r for b, r in ((win, r_win), (cmp, r_cmp)) if b == UNKNOWN]
    needs = "dense" if "dense" in unknown else unknown[0] if unknown else None
    why = [("cmp", r_cmp), ("win", r_win)]
    s, t, f = tn.select, tn.tile, tn.flash
    G = inp.HQ // inp.H
    forked = inp.q_grad and (cmp not in ("triton", UNKNOWN) or win not in ("triton", UNKNOWN))
    row_sums = f.row_sums and inp.grad
    fa4_accum = row_sums and f.fa4_accum and forked
    split = t_ok(f.win_split_min_t, inp.T) and inp.B == 1 and G > 1 and "q_contig" in inp.layout \
        and "win_entry" not in inp.refused
    entry = "plain"
    if win in ("fa4", "reference") and (split or fa4_accum):
        entry = "split" if split else "entry"
    why.append(("win_entry", {"split": f"T >= win_split_min_t={f.win_split_min_t}: GQA backward per KV head",
                              "entry": "FA4's backward entry for row sums / the kept dq accumulator",
                              "plain": "flash-attn's public API" if win != "triton" else "own kernel"}[entry]))
    scores = "gluon" if t_ok(s_min := tn.scores.gluon_min_t, inp.T) and _scores_gluon_ok(inp, arch) else "triton"
    why.append(("scores", f"Gluon score pass from T={s_min}" if scores == "gluon" else "Triton fused scores + top-n"))
    m = m_for(t, G)
    blocks, dq_block = by_block(s, G), dq_by_block(s, G)
    tile_gluon = m > 1 and _tile_gluon_ok(inp, arch, m)
    if m > 1:
        fwd = "tile_gluon" if t.gluon_fwd_stages and tile_gluon else "tile"
        bwd = "tile"
        why.append(("fwd", f"query tiles of {m} tokens at G={G} >= tile.min_g={t.min_g}"))
    else:
        fwd = "block" if blocks else "token"
        bwd = "pairs" if dq_block else "token"
        why.append(("fwd", f"block order at G={G} <= {s.block_max_g}" if blocks else "one program per token"))
    dq_gluon = dq_stages_for(t, inp.T) if m > 1 and t.gluon_dq_stages and tile_gluon else 0
    why.append(("bwd", {"tile": "tile dq + token walk", "pairs": "dq from the walk's pair partials",
                        "token": "per-token dq + token walk"}[bwd]))
    walk = _walk(inp, tn, arch, bwd == "pairs")
    dq_fold = f.dq_fold and inp.grad and forked and cmp not in ("triton", UNKNOWN) and win != "triton"
    return OpPlan(inp.arch, cmp, win, entry, f.win_gate_lse, scores, m, fwd,
                  t.gluon_fwd_stages if fwd == "tile_gluon" else 0, m > 1 and t.gluon_combine, bwd, dq_gluon, walk,
                  _chunk(inp, tn), dq_fold, row_sums, fa4_accum, pair_plan(s, G), tn.scores.relayout,
                  t.group if m > 1 else 0, tuning=tn, why=tuple(why), needs=needs)


# ---------------------------------------------------------------------------------------- at the call
def _rows_2d(x) -> bool:
    """x [B, T, H, d] addressable as 2-D [B*T, H*d] rows with 16-byte aligned strides and base (TMA)."""
    B, T, H, d = x.shape
    return (x.stride(3) == 1 and x.stride(2) == d and (B == 1 or x.stride(0) == T * x.stride(1))
            and (x.stride(1) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0)


def _rows_of_heads(x) -> bool:
    """x [B, T, HQ, d] with one row per (token, head), 16-byte aligned (the walk's TMA rows)."""
    B, T, HQ, d = x.shape
    return (x.stride(3) == 1 and x.stride(2) == d and (T == 1 or x.stride(1) == HQ * d)
            and (B == 1 or x.stride(0) == T * HQ * d) and (d * x.element_size()) % 16 == 0
            and x.data_ptr() % 16 == 0)


def _refused(dev: str, dtype, dk: int, dv: int) -> frozenset:
    """The refused paths (fallbacks.py) that concern a call on this device / dtype / head sizes."""
    keys = {"win_flash": (dev, dtype, dk), "cmp_sdpa": (dev, dtype, dk, dv), "gluon_tile": (dev,),
            "gluon_scores": (dev,), "win_entry": (dev,), "cmp_entry": (dev,),
            **{f"cmp_flash:{b}": (dev, dtype, dk, dv) for b in ("fa4", "fa2", "reference")}}
    return frozenset(p for p, k in keys.items() if fallbacks.refused(p, k) is not None)


@functools.lru_cache(maxsize=None)
def _installed(cuda: bool) -> frozenset:
    if not cuda:
        return frozenset()
    from .flash import fa2_func, fa4_func
    from .triton.tile_gluon import _target_arch, gluon_available
    have = {"fa4": fa4_func() is not None, "fa2": fa2_func() is not None,
            "gluon": _target_arch() // 10 == 9 and gluon_available()}
    return frozenset(k for k, v in have.items() if v)


def plan_call(q, k_cmp, v_cmp, k_slc, v_slc, *, l: int, d: int, l_sel: int, n_sel: int, w: int,
              tuning: KernelTuning | None = None, chunk: int | None = None, q_off: bool = False) -> OpPlan:
    """The plan of one op call from its unit-stride tensors (q_off: queries at an offset): shapes and layout facts,
    no sync. A probe the plan asks for (the dense backend, the dense-SDPA check) runs once here, then it plans again."""
    import torch
    from .flash import device_capability
    B, T, HQ, dk = q.shape
    dev, dv = str(q.device), v_cmp.shape[-1]
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    layout = {"q_heads": _rows_of_heads(q), "kv_rows": _rows_2d(k_slc) and _rows_2d(v_slc),
              "kcmp_rows": _rows_2d(k_cmp), "q_contig": q.is_contiguous()}
    grad = torch.is_grad_enabled()
    from .triton import cmp_dense   # an outcome probed before (e.g. in eager warm-up) also holds inside a capture
    sdpa = cmp_dense.probe(dev, q.dtype, dk, dv)[0] if cmp_dense.probed(dev, q.dtype, dk, dv) else UNKNOWN
    inp = PlanInputs(family_of(device_capability(q.device)), str(q.dtype).replace("torch.", ""), B, T, HQ,
                     k_slc.shape[2], dk, dv, k_cmp.shape[1], l, d, l_sel, n_sel, w, grad, grad and q.requires_grad,
                     torch.are_deterministic_algorithms_enabled(), capturing, _installed(q.is_cuda),
                     frozenset(k for k, v in layout.items() if v), _refused(dev, q.dtype, dk, dv), sdpa=sdpa,
                     chunk=chunk, q_off=q_off)
    return _probed_plan(inp, tuning, q.device, q.dtype)


def refuse_branch(branch: str, q: torch.Tensor, v: torch.Tensor, plan: OpPlan, exc: Exception) -> OpPlan:
    """The planned flash / dense backend of `branch` ("cmp" / "win") failed on this call: refused for this device /
    dtype / head sizes (planned away from now on), counted and warned once; inside a CUDA-graph capture the error
    stands. Returns the call's plan with that branch on the Triton kernel (no dq fold: it needs both outside)."""
    import warnings

    import torch
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise exc
    be = getattr(plan, branch)
    why = f"{be} failed at T={q.shape[1]}: {type(exc).__name__}: {str(exc)[:120]}"
    dev, dk, dv = str(q.device), q.shape[-1], v.shape[-1]
    if branch == "win":
        path, key, name, then = "win_flash", (dev, q.dtype, dk), f"win_flash:{be}->triton", "the Triton kernel"
    elif be in ("fa4", "fa2"):   # flash-attn refused: the SDPA choice (cmp_dense.mode) from now on
        path, key, name, then = f"cmp_flash:{be}", (dev, q.dtype, dk, dv), f"cmp_dense:{be}->sdpa", "SDPA / Triton"
    else:
        path, key, name, then = "cmp_sdpa", (dev, q.dtype, dk, dv), f"cmp_dense:{be}->triton", "the Triton kernel"
    fallbacks.count_fallback(name)
    fallbacks.refuse(path, key, why)
    label = "window branch" if branch == "win" else "compressed branch"
    warnings.warn(f"{label}: {why}; using {then} from now on", RuntimeWarning, stacklevel=3)
    return dataclasses.replace(plan, **{branch: "triton"}, win_entry="plain" if branch == "win" else plan.win_entry,
                               dq_fold=False, why=plan.why + ((branch, f"refused at run time: {why}"),))


def _probed_plan(inp: PlanInputs, tuning: KernelTuning | None, device, dtype) -> OpPlan:
    """select_plan under tuning (None: the device's preset), after the (at most two) one-off probes it asks for."""
    from .triton import cmp_dense
    tuning = tuning or tuning_for(device)
    plan, dev = select_plan(inp, tuning), str(device)
    for _ in range(2):
        if plan.needs == "dense":
            from .flash import choose_dense_backend
            inp = dataclasses.replace(inp, dense=choose_dense_backend(device, dtype, inp.d_k, True)[0])
        elif plan.needs == "sdpa":
            inp = dataclasses.replace(inp, sdpa=cmp_dense.probe(dev, dtype, inp.d_k, inp.d_v)[0])
        else:
            break
        plan = select_plan(dataclasses.replace(inp, refused=_refused(dev, dtype, inp.d_k, inp.d_v)), tuning)
    return plan


def plan_for(device, dtype, *, B: int, T: int, HQ: int, H: int, d_k: int, d_v: int, l: int, d: int, l_sel: int,
             n_sel: int, w: int, tuning: KernelTuning | None = None) -> OpPlan:
    """The plan of a training call of this shape on `device` without its tensors (layouts as the model makes
    them): what env.json and the model's log name. Runs the probes the plan asks for (not inside a capture)."""
    import torch
    from .flash import device_capability
    device = torch.device(device)
    inp = PlanInputs(family_of(device_capability(device)), str(dtype).replace("torch.", ""), B, T, HQ, H, d_k, d_v,
                     max(0, (T - l) // d + 1), l, d, l_sel, n_sel, w, installed=_installed(device.type == "cuda"),
                     refused=_refused(str(device), dtype, d_k, d_v))
    return _probed_plan(inp, tuning, device, dtype)


# ---------------------------------------------------------------------------------------- the route, printed

SHAPES = MappingProxyType({"paper": dict(HQ=64, H=4, d_k=128, d_v=128), "prod": dict(HQ=12, H=2, d_k=64, d_v=64)})


def sample_inputs(family: str, shape: str, T: int, B: int = 1, grad: bool = True) -> PlanInputs:
    """PlanInputs of a typical training call on a family: bf16, all optional packages installed, flash-attn 4
    chosen where the family runs it, dense SDPA on cuDNN, nothing refused (the golden table's inputs)."""
    a = ARCHS[family]
    sh = SHAPES[shape]
    installed = frozenset(k for k in ("fa4", "fa2", "gluon") if getattr(a, k))
    dense = "fa4" if a.fa4 else "fa2" if a.fa2 else "sdpa"
    return PlanInputs(family, "bfloat16" if a.cuda else "float32", B, T, sh["HQ"], sh["H"], sh["d_k"], sh["d_v"],
                      (T - 32) // 16 + 1, grad=grad, q_grad=grad, installed=installed, dense=dense,
                      sdpa="cudnn" if a.cuda else None)


def describe(plan: OpPlan) -> str:
    """The route, one choice a line with its reason."""
    w = plan.walk
    rows = [("compressed", plan.cmp, plan.reason("cmp")), ("window", f"{plan.win} ({plan.win_entry})",
            plan.reason("win") + "; " + plan.reason("win_entry")), ("scores", plan.scores, plan.reason("scores")),
            ("selection fwd", plan.fwd + (f" m={plan.m}" if plan.m > 1 else "")
             + (f" slots={plan.fwd_gluon}" if plan.fwd_gluon else "") + (" +combine" if plan.combine else ""),
             plan.reason("fwd")),
            ("selection bwd", plan.bwd + (f" dq gluon slots={plan.dq_gluon}" if plan.dq_gluon else ""),
             plan.reason("bwd")),
            ("dK/dV walk", f"{'gluon slots=' + str(w.gluon) if w.gluon else 'triton'} rows={w.rows} group={w.group}"
             f" prefetch={int(w.prefetch)} loop_stages={w.loop_stages}", "dq partials" if w.dq_pairs else ""),
            ("chunk", str(plan.chunk), ""), ("dq_fold / row_sums / fa4_accum",
                                            f"{int(plan.dq_fold)} / {int(plan.row_sums)} / {int(plan.fa4_accum)}", "")]
    return "\n".join(f"{k:<32} {v:<28} {r}".rstrip() for k, v, r in rows)


# one line per choice the golden table shows: (choice, value, why, the bench/RESULTS.md section that decided it)
NOTES = (
    ("compressed", "fa4", "flash-attn 4 on the regrouped causal problem from T = 8k (tuning.flash.cmp=auto, sm90)",
     "Tried / The op: kernels, branches and glue (branches on FA4 from 8k; the 8k alternatives)"),
    ("compressed", "cudnn", "dense SDPA (the probed backend, cuDNN first) from T = 16k where FA4 is absent",
     "Tried / The op: kernels, branches and glue (compressed branch on cuDNN); Training and CPU"),
    ("compressed", "triton", "the gated Triton kernel: short T, no CUDA, or deterministic algorithms",
     "Tried / The op: kernels, branches and glue"),
    ("window", "fa4/entry", "FA4 through its backward entry: row sums from the gate kernel, dq kept in FA4's fp32 "
     "accumulator", "Tried / The op: kernels, branches and glue (row_sums, fa4_accum, win_gate_lse)"),
    ("window", "fa4/split", "from 16k at B = 1: FA4's backward on grouped views without GQA",
     "Tried / The op: kernels, branches and glue (window's FA4 backward without GQA)"),
    ("window", "triton/plain", "the own Triton kernel (faster than compiled FlexAttention) below 8k and off sm90",
     "Tried / The op: kernels, branches and glue (FlexAttention; own kernels instead of FA4)"),
    ("scores", "gluon", "paper geometry from 32k: the warp-specialized Gluon score pass (same blocks, bit for bit)",
     "Tried / The op: block scores"),
    ("scores", "triton", "fused scores + running top-n, no score tensor", "Tried / The op: block scores"),
    ("selection fwd", "tile_gluon", "G >= 16 on sm90: query tiles of m = 4 tokens (regrouped within 32) on a Gluon "
     "TMA ring, the op's output from its epilogue", "Tried / The op: selection at the paper shape (G = 16)"),
    ("selection fwd", "tile", "query tiles in Triton where the Gluon kernels do not apply",
     "Tried / The op: selection at the paper shape (G = 16)"),
    ("selection fwd", "block", "G <= 8 on sm90: block order, fp16 pair partials",
     "Tried / The op: selection at the production shape (G = 6)"),
    ("selection fwd", "token", "one program per token: the unswept defaults (sm80, CPU)", "The op vs FA4 tables"),
    ("selection bwd", "tile", "tile dq (Gluon on sm90) + the dK/dV walk without dq",
     "Tried / The op: selection at the paper shape (G = 16)"),
    ("selection bwd", "pairs", "dq from the walk's (token, block) partials",
     "Tried / The op: selection at the production shape (G = 6)"),
    ("selection bwd", "token", "per-token dq kernel + the token walk", "The op vs FA4 tables"),
    ("dK/dV walk", "gluon", "Gluon walk with TMA rows (paper shape, sm90)",
     "Tried / The op: selection at the paper shape (G = 16)"),
    ("dK/dV walk", "triton", "the Triton walk (packed heads, token ids prefetched on sm90)",
     "Tried / The op: selection at the production shape (G = 6)"),
)
MD_BEGIN, MD_END = "<!-- python -m nsa.ops.plan --markdown: begin -->", "<!-- python -m nsa.ops.plan --markdown: end -->"
GOLDEN_TS = (4096, 8192, 16384, 32768, 65536)


def markdown() -> str:
    """The golden route table ({sm90, sm80, cpu} x {paper, prod} x T) and one line per choice (docs/kernels.md)."""
    head = "| family | shape | T | compressed | window | scores | selection fwd | selection bwd | dK/dV walk |"
    rows = [head, "|" + "---|" * 9]
    for fam in ("sm90", "sm80", "cpu"):
        for shape in ("paper", "prod"):
            for T in GOLDEN_TS:
                p = select_plan(sample_inputs(fam, shape, T), PRESETS[ARCHS[fam].preset])
                rows.append(f"| {fam} | {shape} | {T // 1024}k | {p.cmp} | {p.win}/{p.win_entry} | {p.scores} | "
                            f"{p.fwd} | {p.bwd} | {'gluon' if p.walk.gluon else 'triton'} |")
    why = ["| choice | value | why | bench/RESULTS.md |", "|---|---|---|---|"]
    why += [f"| {c} | {v} | {w} | {r} |" for c, v, w, r in NOTES]
    return "\n".join([MD_BEGIN, "", *rows, "", *why, "", MD_END])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nsa.ops.plan", description="print the NSA op's route for a call")
    ap.add_argument("--device", choices=sorted(DEVICES), default="h200")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="prod")
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--no-grad", action="store_true", help="an inference call")
    ap.add_argument("--markdown", action="store_true", help="print docs/kernels.md's generated route table")
    a = ap.parse_args(argv)
    if a.markdown:
        print(markdown())
        return 0
    fam = DEVICES[a.device]
    plan = select_plan(sample_inputs(fam, a.shape, a.T, a.B, not a.no_grad), PRESETS[ARCHS[fam].preset])
    print(f"{a.device} ({fam}, preset {ARCHS[fam].preset}), shape {a.shape} {SHAPES[a.shape]}, B={a.B} T={a.T}")
    print(plan.line())
    print(describe(plan))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
