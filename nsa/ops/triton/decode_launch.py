"""Host side of the Triton decode step (nsa/ops/triton/decode.py): launch geometry from buffer
capacities, the split-K semaphores, launching with or without programmatic dependent launch, and
launching kept compiled kernels directly (no per-call argument binding: most of a launch's host cost)."""
from __future__ import annotations

import functools
import logging
from types import MappingProxyType

import torch

from ..tuning import DecodeKnobs, Warps
from ._utils import next_pow2

# learnt once per process: whether this Triton accepts launch_pdl (None: not tried yet); a capability
# of the installed Triton/driver, not a tuning knob, written only by _launch_with_pdl_fallback
_PDL = {"ok": None}
CPU_SMS = 4              # "multiprocessors" the plan assumes off-GPU (interpreter, offline compiles)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_COUNTERS: dict = {}   # (device, stream) -> int32 semaphores, zero between kernels


def _counters(dev: torch.device, n: int) -> torch.Tensor:
    """n zeroed int32 split-K semaphores for a launch on the current stream. The kernels leave them
    at zero, so one buffer per (device, stream) serves every later call; inside a CUDA-graph capture
    without a large enough buffer a fresh zeroed one is captured (its memset replays with the graph)."""
    key = (str(dev), torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0)
    buf = _COUNTERS.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    buf = torch.zeros(max(n, 64), device=dev, dtype=torch.int32)
    if not (dev.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _COUNTERS[key] = buf
    return buf


def _warps(knob: Warps, elems: int) -> int:
    """num_warps: the knob, or for "auto" about 32 elements of the largest tile per thread (1..8)."""
    if knob != "auto":
        return int(knob)
    return max(1, min(8, next_pow2(_cdiv(elems, 32 * 32))))


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b) for b > 0: triton.cdiv's value without its constexpr-function wrapper (host Python)."""
    return -(-a // b)


def plan_caps(n_cap: int, s_cap: int, *, l: int, d: int, l_sel: int, w: int) -> tuple[int, int, int]:
    """What of the capacities the launch geometry depends on: (selection blocks the compressed tokens
    reach, the next power of two of the raw blocks, the window's token count). They change every
    l_sel compressed tokens at most, so a cache that grows by one token per step re-plans rarely."""
    u = l_sel // d
    nb_vis_cap = (n_cap + l // d - 1 + u - 1) // u if n_cap > 0 else 0
    return nb_vis_cap, max(2, next_pow2((max(s_cap, 1) - 1) // l_sel + 1)), min(w, max(s_cap, 1))


def decode_plan(*, rows_h: int, n_cap: int, s_cap: int, l: int, d: int, l_sel: int, n_sel: int,
                w: int, sms: int, knobs: DecodeKnobs) -> dict:
    """Launch geometry from capacities only (so a captured graph fits every later step).

    rows_h = B*Tq*H (row, kv head) pairs; n_cap compressed-token slots; s_cap raw-token slots;
    sms = multiprocessors; knobs = DecodeTuning.knobs(rows_h).
    """
    caps = plan_caps(n_cap, s_cap, l=l, d=d, l_sel=l_sel, w=w)
    return dict(plan_of_caps(rows_h, caps, l, d, l_sel, n_sel, sms, knobs))


@functools.lru_cache(maxsize=1024)
def plan_of_caps(rows_h: int, caps: tuple[int, int, int], l: int, d: int, l_sel: int, n_sel: int, sms: int,
                 knobs: DecodeKnobs) -> MappingProxyType:
    """decode_plan from plan_caps' reduction of the capacities (cached: read-only)."""
    nb_vis_cap, nb_p2, s_win = caps
    r, u = l // d, l_sel // d
    bn = max(16, next_pow2(max(knobs.cmp_tile, r + u)))
    nbj = (bn - (r - 1)) // u                       # selection blocks a sub-tile owns
    nsub = max(1, _cdiv(nb_vis_cap, nbj))
    # split-K: about cmp_per_sm programs per multiprocessor in all (one resident wave)
    want = max(1, int(knobs.cmp_per_sm * sms) // rows_h)
    subs = _cdiv(nsub, min(want, nsub))
    nch = _cdiv(nsub, subs)
    kr = max(2, next_pow2(n_sel))
    sl = min(nb_p2, max(2, next_pow2(knobs.score_slice), nb_p2 // 16))
    ck = min(sl, kr)                                # candidates per scoring slice
    ncand = (nb_p2 // sl) * ck
    # selection + window: key tiles (a selected block = nbs tiles of bs, the window nwt tiles of bw)
    # dealt evenly, tpp per program, about sw_per_sm programs per multiprocessor in all
    tw = min(max(16, next_pow2(l_sel)), knobs.tile)      # key tile (tokens) of both kinds
    nbs = _cdiv(l_sel, tw)
    nwt = _cdiv(s_win, tw)
    p2 = max(2, int(knobs.sw_per_sm * sms) // rows_h)
    tpp = max(1, _cdiv(n_sel * nbs + nwt, p2))
    spb = _cdiv(n_sel, _cdiv(n_sel * nbs, tpp))   # blocks per selection program, balanced
    nss = _cdiv(n_sel, spb)
    wsub = _cdiv(nwt, _cdiv(nwt, tpp))            # window tiles per window program
    nwc = _cdiv(nwt, wsub)
    return MappingProxyType(dict(BN=bn, NBJ=nbj, NBJ_PAD=max(16, next_pow2(nbj)), NSUB=nsub, NBCAP=nsub * nbj,
                                 SUBS=subs, NCH=nch, NB_P2=nb_p2, NSEL_P2=kr, SL=sl, NSL=nb_p2 // sl, CK=ck,
                                 NCAND=ncand, NCP=max(ncand, kr), TW=tw, WSUB=wsub, NWC=nwc, SPB=spb, NSS=nss,
                                 NP2=nss + nwc))


def _launch_all(specs: list, pdl: bool, info: dict | None) -> None:
    """Launch [(name, kernel, grid, args, constexprs)] in order; with pdl the kernels get PDL=True
    (griddepcontrol in the code) and every launch but the first the launch_pdl attribute. info, when
    given, receives name -> the compiled kernel (register / spill diagnostics)."""
    for i, (name, kernel, grid, args, kw) in enumerate(specs):
        extra = dict(launch_pdl=True) if pdl and i > 0 else {}
        compiled = kernel[grid](*args, **kw, PDL=pdl, **extra)
        if info is not None:
            info[name] = compiled


def _launch_with_pdl_fallback(specs: list, want_pdl: bool, info: dict | None = None) -> bool:
    """Programmatic dependent launch when wanted and this Triton/driver takes it; learnt once, on the
    first try outside a CUDA-graph capture (a failed launch must not happen inside one). Returns
    whether the launches were programmatic (the PDL constexpr they were compiled with)."""
    pdl = want_pdl and _PDL["ok"] is not False
    if pdl and _PDL["ok"] is None and torch.cuda.is_current_stream_capturing():
        pdl = False
    if not pdl:
        _launch_all(specs, False, info)
        return False
    try:
        _launch_all(specs, True, info)
        _PDL["ok"] = True
    except Exception:  # noqa: BLE001 - e.g. no launch_pdl in this Triton: plain launches from now on
        if _PDL["ok"]:
            raise
        _PDL["ok"] = False
        _launch_all(specs, False, info)
        return False
    return True


# ----------------------------------------------------------------------------- kept compiled-kernel handles
# learnt once per process: whether a kept compiled kernel may be launched directly (None: not checked yet;
# "worked": a direct launch went through, so a later failure is a real error, not this Triton's refusal)
_DIRECT: dict = {"ok": None, "worked": False}


def direct_launch_ok() -> bool:
    """Whether this Triton's JITFunction.run hands a compiled kernel every parameter in declaration order
    (`*bound_args.values()`), so that compiled[grid](*args, *constexprs) is the same launch without the per-call
    argument binding and specialisation (Triton's host cost of a launch): read once from its source."""
    if _DIRECT["ok"] is None:
        try:
            import inspect

            from triton.compiler.compiler import CompiledKernel
            from triton.runtime.jit import JITFunction
            _DIRECT["ok"] = ("*bound_args.values()" in inspect.getsource(JITFunction.run)
                             and callable(getattr(CompiledKernel, "__getitem__", None)))
        except Exception:  # noqa: BLE001 - another Triton layout: launch through JITFunction only
            _DIRECT["ok"] = False
    return _DIRECT["ok"]


def kept_handles(specs: list, compiled: dict, pdl: bool) -> tuple | None:
    """Per spec (name, kernel, grid, args, constexprs) the compiled kernel its launch returned and the values of
    the parameters after its runtime arguments, in declaration order (PDL included); None where a launch returned
    no compiled kernel (the interpreter, a stand-in) or a parameter has no value here."""
    out = []
    for name, kernel, _, args, kw in specs:
        h = compiled.get(name)
        names = getattr(kernel, "arg_names", None)
        if h is None or names is None or not callable(getattr(h, "__getitem__", None)):
            return None
        kw = dict(kw, PDL=pdl)
        try:
            out.append((h, tuple(kw[n] for n in names[len(args):])))
        except KeyError:
            return None
    return tuple(out)


def launch_kept(handles: tuple, grids: tuple, argsets: tuple, stream) -> bool:
    """Launch kept handles (kept_handles) with these runtime arguments on stream (None: the current one).
    False where this Triton refused the first such launch (learnt: every later call binds through
    JITFunction); the launches are then to be made the ordinary way (any enqueued ones rerun harmlessly:
    every kernel rewrites what it writes and leaves its semaphores at zero)."""
    try:
        for (h, tail), grid, args in zip(handles, grids, argsets):
            h[grid](*args, *tail, stream=stream)   # grid: 3 dims, as the compiled launcher reads them
    except Exception as exc:  # noqa: BLE001 - e.g. another launcher arity in this Triton
        if _DIRECT["worked"]:
            raise
        _DIRECT["ok"] = False
        _DIRECT["why"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        logging.getLogger(__name__).info("decode: direct launches of kept kernels off (%s)", _DIRECT["why"])
        return False
    _DIRECT["worked"] = True
    return True
