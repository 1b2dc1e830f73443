"""The NSA op run eagerly (no trace routing): backend policy, validation, and the chosen backend.
nsa.ops.nsa_attention (the public entry, documented there) calls it outside torch.compile, and the
custom op nsa::attention's kernels call it under torch.compile (nsa/ops/custom_op.py).

Everything decided before the kernels (validation, the policy, the effective tuning, the scale, the Triton
plan) depends on the call's signature only: shapes, strides, 16-byte alignment, dtypes, device, grad and
determinism state, the refusals so far, the hyper-parameters and the tuning / policy objects. It is decided on a
signature's first call and kept (_Call), so a repeated call of a training loop computes the signature and goes
to the kernels; tests/test_host_cost.py holds it there. With NSA_EAGER_GRAPHS=auto nsa_attention's repeated calls
on CUDA replay per-signature CUDA graphs of the op's forward and backward instead (nsa/ops/eager_graph.py)."""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from . import dispatch, eager_graph, fallbacks
from .batched import nsa_torch
from .common import _NAMES, NSAParams, safe_scale, validate_inputs
from .dispatch import KernelPolicy, _check_requested, cached_policy
from .fallbacks import count_fallback
from .probe import ProbeShape
from .reference import nsa_reference
from .tuning import FlashBranchTuning, KernelTuning


@functools.lru_cache(maxsize=64)
def _flash_override(tuning: KernelTuning, flash_branches: str, allow_flash: bool) -> KernelTuning:
    """tuning with its flash part replaced by nsa.flash_branches / off under allow_flash=False; cached,
    since every eager layer call asks again with the same few frozen tunings."""
    if flash_branches != "preset":
        tuning = tuning.replace(flash=FlashBranchTuning.parse(flash_branches))
    if not allow_flash and (tuning.flash.win != "off" or tuning.flash.cmp != "off"):
        tuning = tuning.replace(flash=FlashBranchTuning())
    return tuning


class _Call(NamedTuple):
    """One call signature's decisions: run(*tensors) computes the op; counts: the fallback counters every such
    call adds (as it did when it chose); policy_key: cached_policy's key of the policy it chose (the call is kept
    while that policy stays cached: tests clear it to re-probe); keep: the objects the signature names by id,
    held so that their ids stay theirs."""

    run: Callable
    counts: tuple
    policy_key: tuple | None
    policy: KernelPolicy
    keep: tuple


class SignatureCache(dict):
    """Call signature -> _Call, for the prefill op here and the decode op (decode.py): at most `cap` kept (a model
    has a few per layer shape and grad mode); when full, all dropped (shapes that keep changing: deciding is cheap)."""

    def __init__(self, cap: int = 256) -> None:
        super().__init__()
        self.cap = cap

    def keep(self, key: tuple, call: _Call) -> None:
        if len(self) >= self.cap:
            self.clear()
        self[key] = call


_CALLS = SignatureCache()


def _signature(tensors: tuple, backend, tuning, rest: tuple) -> tuple | None:
    """What the decisions of a call depend on, or None where nothing may be kept (an input that is no tensor
    with storage: validation names it; inside a CUDA-graph capture the probes have not run)."""
    try:
        sig = tuple((type(x), x.shape, x.stride(), x.dtype, x.device, x.requires_grad, x.data_ptr() % 16)
                    for x in tensors)
    except (AttributeError, TypeError, RuntimeError):
        return None
    if tensors[0].is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    return (sig, backend if isinstance(backend, str) else id(backend), id(tuning), rest, tuple(map(type, rest)),
            torch.is_grad_enabled(), torch.are_deterministic_algorithms_enabled(), fallbacks.generation(),
            dispatch.triton_module())


def eager_attention(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_slc: torch.Tensor,
                    v_slc: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor, *,
                    l: int = 32, d: int = 16, l_sel: int = 64, n_sel: int = 16, w: int = 512,
                    scale: float | None = None, backend: str | KernelPolicy = "auto",
                    tile: int | None = None, recompute: bool | None = None,
                    tuning: KernelTuning | None = None, allow_flash: bool = True,
                    flash_branches: str = "preset", graphs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """nsa.ops.nsa_attention's contract (see there), run as is. graphs: a signature's repeated call may replay its
    CUDA graphs (eager_graph.py, NSA_EAGER_GRAPHS); nsa_attention's eager calls only, not the custom op's kernels."""
    tensors = (q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates)
    rest = (l, d, l_sel, n_sel, w, scale, tile, recompute, allow_flash, flash_branches)
    key = _signature(tensors, backend, tuning, rest)
    call = _CALLS.get(key) if key is not None else None
    fresh = call is None or call.policy_key is not None and dispatch._cache.get(call.policy_key) is not call.policy
    if fresh:
        call = _decide(tensors, backend, tuning, rest, key)
    for name in call.counts:
        count_fallback(name)
    if graphs and eager_graph.ON and key is not None and _CALLS.get(key) is call:
        return eager_graph.graphed_call(call, key, tensors, not fresh)
    return call.run(*tensors)


def _decide(tensors: tuple, backend, tuning, rest: tuple, key: tuple | None) -> _Call:
    """A signature's first call: validation, policy (probed once per shape), tuning, scale and the backend's
    plan, kept under key (when given and final)."""
    l, d, l_sel, n_sel, w, scale, tile, recompute, allow_flash, flash_branches = rest
    q, v_win = tensors[0], tensors[6]
    p = NSAParams(l, d, l_sel, n_sel, w)
    if not isinstance(backend, KernelPolicy):
        _check_requested(backend)
    validate_inputs(dict(zip(_NAMES, tensors)), p)
    policy_key = None
    if isinstance(backend, KernelPolicy):
        policy = backend
    else:  # the shape key: a triton choice is probed once per (device, dtype, shape), nsa/ops/probe.py
        shape = ProbeShape.of(q, v_win, l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w)
        policy = cached_policy(backend, q.device, q.dtype, shape)
        policy_key = (backend, str(q.device), q.dtype, shape)   # cached_policy's
    sc = safe_scale(scale, q.shape[-1])
    counts = (policy.fallback,) if policy.fallback is not None else ()
    tn = _flash_override(tuning or policy.tuning, flash_branches, allow_flash)
    kw = dict(l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w, scale=sc)
    run = functools.partial(nsa_torch, p=p, scale=sc, tile=tile, checkpoint=recompute, tuning=tn.torch)
    final = True
    if policy.backend == "reference":
        run = functools.partial(nsa_reference, **kw)
    elif policy.backend == "triton":
        run, final, counts = _triton_run(dispatch.triton_module(), tensors, kw, tn, run, counts)
    call = _Call(run, counts, policy_key, policy, (backend, tuning))
    if key is not None and final:
        _CALLS.keep(key, call)
    return call


def _triton_run(mod, tensors: tuple, kw: dict, tuning: KernelTuning, torch_run: Callable, counts: tuple):
    """(run, final, counts) of the Triton backend: the package's planned call (planned_call; a module without it,
    e.g. a test's stand-in, is called as is), falling back to torch_run where the kernels do not cover the
    shape / dtype (NotImplementedError: counted per call)."""
    unsupported = counts + ("triton_unsupported->torch",)
    fn, final = functools.partial(mod.nsa_attention_triton, **kw, tuning=tuning), True
    if hasattr(mod, "planned_call"):
        try:
            fn, final = mod.planned_call(*tensors, **kw, tuning=tuning)
        except NotImplementedError:
            return torch_run, True, unsupported

    def run(*x):
        try:
            return fn(*x)
        except NotImplementedError:  # kernel does not cover this shape/dtype
            count_fallback(unsupported[-1])
            return torch_run(*x)
    return run, final, counts
