"""The host work of one eager NSA op call, without a GPU: every Triton launch and flash-attn call is a
counted no-op, so what remains is the Python and torch dispatch an eager call costs before the GPU runs.

At short lengths an eager call can cost several times its CUDA-graph replay: it is host-bound (the GPU
figures are in bench/RESULTS.md). `measure` runs the op's host path (nsa_attention -> eager.py ->
triton/function.py, plan from plan.py) on meta tensors (shapes and strides, no data: like the asynchronous
launches of a GPU, a torch op costs its dispatch only) and reports per forward+backward call: Python time,
kernel launches by name, flash-attn calls, torch ops by name, and the planning work done (select_plan cache
misses, policy resolutions, probes). family="sm90" plans as a Hopper GPU with flash-attn-4 installed (its calls
are stand-ins returning outputs of the right shapes), "cpu" as this machine. tests/test_host_cost.py holds
the second call of a shape to no planning work and to the launches its plan names.

    python -m nsa.ops.host_cost --T 8192 --family sm90        # the table of one call
    python -m nsa.ops.host_cost --decode op --S 65536 --B 1 16  # one eager decode call (measure_decode;
    python -m nsa.ops.host_cost --decode layer                  #  "layer": with the cache's append and views)
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PROD = MappingProxyType(dict(HQ=12, H=2, dk=64, dv=64))   # the 125M TinyLM's heads (bench/gpu.sh host)
# views and allocations: host work only (scalar_tensor wraps a Python number on the CPU)
FREE_OPS = frozenset(("view", "_unsafe_view", "reshape", "detach", "alias", "slice", "select", "transpose", "permute",
                      "expand", "unsqueeze", "squeeze", "as_strided", "t", "empty", "empty_like", "new_empty",
                      "empty_strided", "scalar_tensor", "lift_fresh"))


@dataclass
class Tally:
    """What one measured stretch of calls did (counts summed over its calls)."""

    launches: Counter = field(default_factory=Counter)    # Triton kernel name -> launches
    flash: Counter = field(default_factory=Counter)       # flash-attn stand-in ("fwd" / "bwd") -> calls
    ops: Counter = field(default_factory=Counter)         # aten op -> dispatches
    planning: Counter = field(default_factory=Counter)    # select_plan misses, policies resolved, probes run
    direct: Counter = field(default_factory=Counter)      # kernel name -> launches of a kept compiled handle
    plan: object = None                                   # the OpPlan of the last call planned

    def compute_ops(self) -> Counter:
        """The torch ops that run a kernel on a GPU: neither views nor allocations."""
        return Counter({k: v for k, v in self.ops.items() if k.replace("aten.", "") not in FREE_OPS})


class _OpCounter(TorchDispatchMode):
    def __init__(self, tally: Tally) -> None:
        super().__init__()
        self.tally = tally

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.tally.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _flash_fwd(tally: Tally):
    def fwd(backend, q, k, v, *, scale, window):
        """flash-attn's (o [B,T,HQ,dv], lse [B,HQ,T] fp32), shapes only."""
        tally.flash["fwd"] += 1
        B, T, HQ, _ = q.shape
        return q.new_empty(B, T, HQ, v.shape[-1]), q.new_empty(B, HQ, T, dtype=torch.float32)
    return fwd


def _flash_bwd(tally: Tally):
    def bwd(backend, q, k, v, o, do, lse, d_rows, *, scale, window, keep_dq=False, lse_shift=None):
        """(dq or FA4's fp32 accumulator, dk, dv), shapes only (fa4_accum.Accum's layout for d <= 64 / > 64)."""
        from .fa4_accum import Accum, reference_a
        tally.flash["bwd"] += 1
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        if not keep_dq:
            return torch.empty_like(q), dk, dv
        B, S, NH, d = q.shape
        a = reference_a(d)
        s_r = -(-S // (64 * a)) * (64 * a)
        return Accum(q.new_empty(B, NH, s_r * d, dtype=torch.float32), s_r, a, scale), dk, dv
    return bwd


_ACTIVE: list = []   # the tallies of the no_kernels blocks entered, innermost last


class _NoOpCompiled:
    """A compiled kernel's stand-in: [grid](*params, stream=) counts a launch (the direct launch of a kept
    handle, nsa/ops/triton/decode_launch.py launch_kept) in the innermost no_kernels block's tally."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getitem__(self, grid):
        def run(*params, stream=None):
            if _ACTIVE:
                _ACTIVE[-1].launches[self.name] += 1
                _ACTIVE[-1].direct[self.name] += 1
        return run


@contextlib.contextmanager
def no_kernels(tally: Tally, family: str = "sm90"):
    """Triton launches and flash-attn calls as counted no-ops; the op planned as on `family` ("sm90": a Hopper
    GPU with flash-attn-4, "cpu"); the one-off probes pass without running; planning work counted in tally."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from . import branch_sums, decode, dispatch, eager, flash, plan, probe, window_split
    from .triton import decode as tdec
    from .triton import function
    saved: list = []

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def launch(self, *args, grid, warmup, **kwargs):
        tally.launches[self.fn.__name__] += 1
        if self.fn.__module__ == tdec.__name__:   # the decode launcher keeps compiled kernels: a counted stand-in
            return _NoOpCompiled(self.fn.__name__)

    def counted(key, fn):
        def wrapped(*a, **k):
            tally.planning[key] += 1
            return fn(*a, **k)
        return wrapped

    tdec.direct_launch_ok()   # read from Triton's own JITFunction.run, before it is stood in for
    for cls in (JITFunction, InterpretedFunction):
        patch(cls, "run", launch)
    for mod in (branch_sums, window_split):
        patch(mod, "flash_fwd", _flash_fwd(tally))
        patch(mod, "flash_bwd", _flash_bwd(tally))
    patch(dispatch, "_triton_status", lambda dev: (True, "host-cost stand-in"))
    patch(probe, "_run", lambda *a, **k: None)
    patch(probe, "probe_triton", counted("probe_triton", probe.probe_triton))
    planner = function.plan_call

    def plan_call(*a, **k):
        tally.planning["plan_call"] += 1
        tally.plan = planner(*a, **k)
        return tally.plan
    patch(function, "plan_call", plan_call)
    patch(eager, "_decide", counted("decide", eager._decide))   # a signature's first call
    patch(decode, "_decide", counted("decode_decide", decode._decide))   # likewise, of nsa_decode
    patch(tdec._Launcher, "__init__", counted("decode_launcher", tdec._Launcher.__init__))   # a launcher built
    patch(tdec._Launcher, "_build", counted("decode_geometry", tdec._Launcher._build))   # its geometry planned
    patch(dispatch.KernelPolicy, "resolve", classmethod(counted("policy_resolve", dispatch.KernelPolicy.resolve.__func__)))
    if family == "sm90":
        patch(flash, "device_capability", lambda device: (9, 0))
        patch(plan, "_installed", lambda cuda: frozenset({"fa4"}))
        patch(flash, "choose_dense_backend", counted("dense_choice", lambda *a, **k: ("fa4", "host-cost stand-in")))
    misses = plan.select_plan.cache_info().misses
    _ACTIVE.append(tally)
    try:
        yield tally
    finally:
        _ACTIVE.remove(tally)
        tally.planning["select_plan_miss"] += plan.select_plan.cache_info().misses - misses
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


@contextlib.contextmanager
def kept_apart():
    """Policies, probe results and call decisions made in the block are forgotten after it (made under the
    stand-ins of no_kernels, they would serve later real calls of the same signature)."""
    from . import dispatch, eager, probe
    from . import decode
    from .triton import decode as tdec
    caches = (dispatch._cache, probe._results, eager._CALLS, decode._CALLS, tdec._LAUNCHERS)
    before = [set(c) for c in caches]
    try:
        yield
    finally:
        for cache, keys in zip(caches, before):
            for k in set(cache) - keys:
                del cache[k]


def op_inputs(T: int, HQ: int, H: int, dk: int, dv: int, *, B: int = 1, device="meta", dtype=torch.bfloat16,
              hp: dict | None = None) -> dict[str, torch.Tensor]:
    """The op's inputs as a layer makes them (contiguous, requiring grad), on `device` (meta: shapes only)."""
    from .common import num_cmp_tokens
    hp = hp or dict(l=32, d=16)
    N = num_cmp_tokens(T, hp["l"], hp["d"])
    shapes = dict(q=(B, T, HQ, dk), k_cmp=(B, N, H, dk), v_cmp=(B, N, H, dv), k_slc=(B, T, H, dk),
                  v_slc=(B, T, H, dv), k_win=(B, T, H, dk), v_win=(B, T, H, dv), gates=(B, T, HQ, 3))
    gen = torch.Generator().manual_seed(0)

    def make(s):
        x = torch.empty(s, device=device, dtype=dtype) if device == "meta" else \
            torch.rand(s, generator=gen).to(device=device, dtype=dtype)
        return x.requires_grad_(True)
    return {k: make(s) for k, s in shapes.items()}


def measure(T: int = 8192, *, HQ: int = PROD["HQ"], H: int = PROD["H"], dk: int = PROD["dk"], dv: int = PROD["dv"],
            family: str = "sm90", calls: int = 20, device="meta", dtype=torch.bfloat16, tuning=None,
            backend: str = "auto") -> dict:
    """Per forward+backward call after a first (planning) call: Python ms (forward, backward), launches, flash
    calls and torch ops of one call, planning work of the repeated calls, and the first call's planning work.
    tuning: the KernelTuning (None: the family's preset)."""
    from . import nsa_attention
    from .tuning import FAMILY_PRESET, PRESETS
    tuning = tuning or PRESETS[FAMILY_PRESET[family]]
    x = op_inputs(T, HQ, H, dk, dv, device=device, dtype=dtype)

    def call():
        o, _ = nsa_attention(**x, backend=backend, tuning=tuning)
        return o

    with kept_apart():
        return _measure(T, family, calls, x, call)


def _measure(T: int, family: str, calls: int, x: dict, call) -> dict:
    leaves = list(x.values())
    first, tally = Tally(), Tally()
    with no_kernels(first, family), _OpCounter(first):
        o = call()
        torch.autograd.grad(o, leaves, torch.empty_like(o))
    with no_kernels(tally, family):
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            o = call()
            t1 = time.perf_counter()
            torch.autograd.grad(o, leaves, do := torch.empty_like(o))
            times.append((t1 - t0, time.perf_counter() - t1))
        launches = sum(tally.launches.values()) // calls
        own = _own_python(lambda: torch.autograd.grad(call(), leaves, do), calls)
        tally.launches.clear()
        tally.flash.clear()
        with _OpCounter(tally):   # its Python hook would weigh on the timing above
            o = call()
            torch.autograd.grad(o, leaves, do)
    fwd, bwd = (1e3 * statistics.median(t[i] for t in times) for i in (0, 1))
    planning = {k: v for k, v in tally.planning.items() if v}
    return dict(T=T, family=family, fwd_ms=fwd, bwd_ms=bwd, ms=fwd + bwd, own_ms=own,
                launches=sum(tally.launches.values()), launches_timed=launches, kernels=dict(tally.launches),
                flash=dict(tally.flash), torch_ops=sum(tally.ops.values()), ops=dict(tally.ops),
                compute_ops=dict(tally.compute_ops()), planning=planning, first_planning=dict(first.planning),
                plan=first.plan)



# ------------------------------------------------------------------------------------------------ decode
DECODE_HP = MappingProxyType(dict(l=32, d=16, l_sel=64, n_sel=16, w=512))   # pipelines/configs/prod_50k.yaml nsa
SM90_SMS = 132   # an sm90 part's multiprocessor count (hardware, not a measurement): the stand-in's decode geometry
LAYER_BACK = 1025   # the layer form's first step sits this many tokens before S


def decode_inputs(S: int, B: int, HQ: int, H: int, dk: int, dv: int, *, device="meta", dtype=torch.bfloat16,
                  hp=DECODE_HP) -> dict:
    """One decode step at context S as bench/bench_decode.py makes it: the query at S - 1, S raw tokens,
    the window buffer of the last min(w, S) and num_cmp_tokens(S) compressed ones; pos0 / win_pos0 too."""
    from .common import num_cmp_tokens
    N, Sw = num_cmp_tokens(S, hp["l"], hp["d"]), min(hp["w"], S)
    shapes = dict(q=(B, 1, HQ, dk), k_cmp=(B, N, H, dk), v_cmp=(B, N, H, dv), k_slc=(B, S, H, dk),
                  v_slc=(B, S, H, dv), k_win=(B, Sw, H, dk), v_win=(B, Sw, H, dv), gates=(B, 1, HQ, 3))
    gen = torch.Generator().manual_seed(0)

    def make(s):
        return torch.empty(s, device=device, dtype=dtype) if device == "meta" else \
            torch.rand(s, generator=gen).to(device=device, dtype=dtype)
    return dict({k: make(s) for k, s in shapes.items()}, pos0=S - 1, win_pos0=S - Sw)


def _layer_step(x: dict, S: int, hp) -> Callable:
    """The eager layer's decode step after the projections (NSAAttention.decode): NSAKVCache.append of one
    token, views, nsa_decode; the cache prefilled with S - LAYER_BACK tokens, one more per call (positions
    below S: a power-of-two S is where the geometry's raw-block count doubles). phi stands in for the
    compression MLP as a mean over the block (one op: the layer's MLP is not this file's concern)."""
    from ..layers.cache import NSAKVCache
    from . import nsa_decode
    from .common import num_cmp_tokens
    q, gates = x["q"], x["gates"]
    B, _, _, dk = q.shape
    H, dv = x["k_slc"].shape[2], x["v_slc"].shape[3]
    cache = NSAKVCache(hp["l"], hp["d"], hp["w"], capacity=2 * S)
    T = max(1, S - LAYER_BACK)
    raw = [torch.empty(B, T, H, dd, device=q.device, dtype=q.dtype) for dd in (dk, dv)] * 3
    n = num_cmp_tokens(T, hp["l"], hp["d"])
    cache.prefill(*raw, *(torch.empty(B, n, H, dd, device=q.device, dtype=q.dtype) for dd in (dk, dv)))
    new = [torch.empty(B, 1, H, dd, device=q.device, dtype=q.dtype) for dd in (dk, dv)] * 3

    def phi(blocks):
        return blocks.mean(3)

    def step(**kw):
        pos0 = cache.length
        cache.append(*new, phi, phi)
        kv = cache.views()
        return nsa_decode(q, kv["k_cmp"], kv["v_cmp"], kv["k_slc"], kv["v_slc"], kv["k_win"], kv["v_win"], gates,
                          pos0=pos0, win_pos0=cache.win_pos0, **kw)
    return step


def measure_decode(S: int = 65536, B: int = 1, *, HQ: int = PROD["HQ"], H: int = PROD["H"], dk: int = PROD["dk"],
                   dv: int = PROD["dv"], family: str = "sm90", calls: int = 32, form: str = "op", device="meta",
                   dtype=torch.bfloat16, tuning=None, backend: str = "auto", hp=DECODE_HP) -> dict:
    """One eager decode call after a first one: form "op" = nsa_decode on a fixed cache (bench_decode.py's
    eager step), "layer" = the layer's cache append + views + nsa_decode, one position further per call.
    Python ms per call (median, min and mean: the layer compresses a block every d calls), launches, torch
    ops (the layer's averaged over d calls), the planning work of the repeated calls and of the first."""
    from . import nsa_decode
    from .triton import decode as tdec
    from .tuning import FAMILY_PRESET, PRESETS
    tuning = tuning or PRESETS[FAMILY_PRESET[family]]
    x = decode_inputs(S, B, HQ, H, dk, dv, device=device, dtype=dtype, hp=hp)
    kw = dict(hp, backend=backend, tuning=tuning)
    if form == "op":
        t = [x[k] for k in ("q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates")]

        def call():
            return nsa_decode(*t, pos0=x["pos0"], win_pos0=x["win_pos0"], **kw)
    elif form == "layer":
        step = _layer_step(x, S, hp)

        def call():
            return step(**kw)
    else:
        raise ValueError(f"form must be 'op' or 'layer', got {form!r}")
    first, tally = Tally(), Tally()
    sms = SM90_SMS if family == "sm90" else tdec.CPU_SMS
    with kept_apart(), _patched(tdec, "CPU_SMS", sms):
        with no_kernels(first, family), _OpCounter(first):
            call()
        with no_kernels(tally, family):
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            launches = sum(tally.launches.values()) // calls
            own = _own_python(call, calls)
            tally.launches.clear()
            tally.direct.clear()
            with _OpCounter(tally):
                for _ in range(hp["d"] if form == "layer" else 1):   # a whole compression period
                    call()
    per = hp["d"] if form == "layer" else 1
    ops = Counter({k: v / per for k, v in tally.ops.items()})
    tally.ops = ops
    planning = {k: v for k, v in tally.planning.items() if v}
    return dict(S=S, B=B, family=family, form=form, ms=1e3 * statistics.median(times),
                mean_ms=1e3 * statistics.fmean(times), min_ms=1e3 * min(times), own_ms=own,
                launches=sum(tally.launches.values()) / per,
                launches_timed=launches, kernels={k: v / per for k, v in tally.launches.items()},
                direct={k: v / per for k, v in tally.direct.items()}, torch_ops=sum(ops.values()), ops=dict(ops),
                compute_ops=dict(tally.compute_ops()),
                planning=planning, first_planning=dict(first.planning))


@contextlib.contextmanager
def _patched(obj, name: str, value):
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


def _own_python(fn, calls: int) -> float:
    """ms per call spent in this package's own Python (cProfile's own time of nsa/ functions; torch's and
    Triton's excluded: on meta tensors torch runs Python reference implementations a GPU does not)."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    own = sum(v[2] for f, v in pstats.Stats(prof).stats.items()
              if f"{os.sep}nsa{os.sep}" in f[0] and not f[0].endswith("host_cost.py"))
    return 1e3 * own / calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, nargs="+", default=[8192])
    ap.add_argument("--family", default="sm90", choices=("sm90", "cpu"))
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--ops", action="store_true", help="also list the torch ops and kernels by name")
    ap.add_argument("--decode", choices=("op", "layer"), help="one eager decode call instead (--S, --B)")
    ap.add_argument("--S", type=int, nargs="+", default=[65536])
    ap.add_argument("--B", type=int, nargs="+", default=[1, 16])
    a = ap.parse_args(argv)
    if a.decode:
        for S in a.S:
            for B in a.B:
                r = measure_decode(S, B, family=a.family, calls=a.calls, form=a.decode)
                print(f"decode {a.decode} S={S} B={B} {a.family}: {1e3 * r['ms']:.1f} us host per call (min "
                      f"{1e3 * r['min_ms']:.1f}, mean {1e3 * r['mean_ms']:.1f}, own Python {1e3 * r['own_ms']:.1f}); "
                      f"{r['launches']:g} launches ({sum(r['direct'].values()):g} of kept compiled kernels), "
                      f"{r['torch_ops']:g} torch ops ({sum(r['compute_ops'].values()):g} running a kernel); "
                      f"planning on repeat {r['planning'] or 'none'}")
                if a.ops:
                    print("  kernels:", r["kernels"], "\n  ops:", dict(Counter(r["ops"]).most_common()))
        return 0
    for T in a.T:
        r = measure(T, family=a.family, calls=a.calls)
        print(f"T={T} {a.family}: {r['ms']:.3f} ms host per fwd+bwd (fwd {r['fwd_ms']:.3f}, bwd {r['bwd_ms']:.3f}; "
              f"own Python {r['own_ms']:.3f}); "
              f"{r['launches']} launches, {sum(r['flash'].values())} flash calls, {r['torch_ops']} torch ops "
              f"({sum(r['compute_ops'].values())} running a kernel); "
              f"planning on repeat {r['planning'] or 'none'}")
        if a.ops:
            print("  kernels:", r["kernels"], "\n  flash:", r["flash"], "\n  compute ops:", r["compute_ops"],
                  "\n  ops:", dict(Counter(r["ops"]).most_common()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
