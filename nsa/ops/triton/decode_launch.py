"""Host side of the Triton decode step (nsa/ops/triton/decode.py): launch geometry from buffer
capacities, the split-K semaphores, and launching with or without programmatic dependent launch."""
from __future__ import annotations

import functools

import torch
import triton

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
    return max(1, min(8, next_pow2(triton.cdiv(elems, 32 * 32))))


def decode_plan(*, rows_h: int, n_cap: int, s_cap: int, l: int, d: int, l_sel: int, n_sel: int,
                w: int, sms: int, knobs: DecodeKnobs) -> dict:
    """Launch geometry from capacities only (so a captured graph fits every later step).

    rows_h = B*Tq*H (row, kv head) pairs; n_cap compressed-token slots; s_cap raw-token slots;
    sms = multiprocessors; knobs = DecodeTuning.knobs(rows_h).
    """
    r, u = l // d, l_sel // d
    bn = max(16, next_pow2(max(knobs.cmp_tile, r + u)))
    nbj = (bn - (r - 1)) // u                       # selection blocks a sub-tile owns
    nb_vis_cap = (n_cap + r - 1 + u - 1) // u if n_cap > 0 else 0
    nsub = max(1, triton.cdiv(nb_vis_cap, nbj))
    # split-K: about cmp_per_sm programs per multiprocessor in all (one resident wave)
    want = max(1, int(knobs.cmp_per_sm * sms) // rows_h)
    subs = triton.cdiv(nsub, min(want, nsub))
    nch = triton.cdiv(nsub, subs)
    nb_p2 = max(2, next_pow2((max(s_cap, 1) - 1) // l_sel + 1))
    kr = max(2, next_pow2(n_sel))
    sl = min(nb_p2, max(2, next_pow2(knobs.score_slice), nb_p2 // 16))
    ck = min(sl, kr)                                # candidates per scoring slice
    ncand = (nb_p2 // sl) * ck
    # selection + window: key tiles (a selected block = nbs tiles of bs, the window nwt tiles of bw)
    # dealt evenly, tpp per program, about sw_per_sm programs per multiprocessor in all
    tw = min(max(16, next_pow2(l_sel)), knobs.tile)      # key tile (tokens) of both kinds
    nbs = triton.cdiv(l_sel, tw)
    nwt = triton.cdiv(min(w, max(s_cap, 1)), tw)
    p2 = max(2, int(knobs.sw_per_sm * sms) // rows_h)
    tpp = max(1, triton.cdiv(n_sel * nbs + nwt, p2))
    spb = triton.cdiv(n_sel, triton.cdiv(n_sel * nbs, tpp))   # blocks per selection program, balanced
    nss = triton.cdiv(n_sel, spb)
    wsub = triton.cdiv(nwt, triton.cdiv(nwt, tpp))            # window tiles per window program
    nwc = triton.cdiv(nwt, wsub)
    return dict(BN=bn, NBJ=nbj, NBJ_PAD=max(16, next_pow2(nbj)), NSUB=nsub, NBCAP=nsub * nbj, SUBS=subs,
                NCH=nch, NB_P2=nb_p2, NSEL_P2=kr, SL=sl, NSL=nb_p2 // sl, CK=ck,
                NCAND=ncand, NCP=max(ncand, kr), TW=tw, WSUB=wsub, NWC=nwc, SPB=spb, NSS=nss, NP2=nss + nwc)


def _launch_all(specs: list, pdl: bool, info: dict | None) -> None:
    """Launch [(name, kernel, grid, args, constexprs)] in order; with pdl the kernels get PDL=True
    (griddepcontrol in the code) and every launch but the first the launch_pdl attribute. info, when
    given, receives name -> the compiled kernel (register / spill diagnostics)."""
    for i, (name, kernel, grid, args, kw) in enumerate(specs):
        extra = dict(launch_pdl=True) if pdl and i > 0 else {}
        compiled = kernel[grid](*args, **kw, PDL=pdl, **extra)
        if info is not None:
            info[name] = compiled


def _launch_with_pdl_fallback(specs: list, want_pdl: bool, info: dict | None = None) -> None:
    """Programmatic dependent launch when wanted and this Triton/driver takes it; learnt once, on the
    first try outside a CUDA-graph capture (a failed launch must not happen inside one)."""
    pdl = want_pdl and _PDL["ok"] is not False
    if pdl and _PDL["ok"] is None and torch.cuda.is_current_stream_capturing():
        pdl = False
    if not pdl:
        _launch_all(specs, False, info)
        return
    try:
        _launch_all(specs, True, info)
        _PDL["ok"] = True
    except Exception:  # noqa: BLE001 - e.g. no launch_pdl in this Triton: plain launches from now on
        if _PDL["ok"]:
            raise
        _PDL["ok"] = False
        _launch_all(specs, False, info)
