"""Decode / chunked-prefill entry: queries at absolute offset pos0 against cached keys.

Uses the same tiled core as prefill (batched.nsa_torch with a query offset), so decode and
prefill run the same arithmetic and choose the same blocks. On CUDA with triton, the triton
decode kernel (nsa/ops/triton/decode.py nsa_decode_triton) is used. Positions in device tensors
(the CUDA-graph form, NSAAttention.decode_static) need that kernel: pass
KernelPolicy.for_device_positions(device, dtype) as the backend.

Everything decided before the kernels (validation but the lengths, the policy, the tuning, the scale, the
backend and the Triton launcher) depends on the call's signature only (decode_signature: shapes but the caches'
lengths, strides, dtypes, devices; the hyper-parameters, backend and tuning): decided on a signature's first call
and kept (_Call), so a repeated call -- the layer's, whose cache grows by a token per step, too -- checks the
positions against the lengths and goes to the kernels (tests/test_decode_host.py).
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import torch

from . import dispatch
from .batched import nsa_torch
from .common import _NAMES, NSAParams, decode_signature, safe_scale, validate_inputs
from .dispatch import KernelPolicy, _check_requested, cached_policy, triton_module
from .eager import SignatureCache, _Call
from .fallbacks import count_fallback
from .reference import nsa_reference
from .tuning import KernelTuning


def _triton_decode() -> Callable | None:
    """nsa_decode_triton from the triton package (or its decode module), if it exists."""
    mod = triton_module()
    fn = getattr(mod, "nsa_decode_triton", None) if mod is not None else None
    if fn is None and mod is not None:
        try:
            fn = importlib.import_module("nsa.ops.triton.decode").nsa_decode_triton
        except (ImportError, AttributeError):
            fn = None
    return fn


def _check_device_positions(q: torch.Tensor, pos0: object, win_pos0: object, win_ring: int) -> None:
    """Device-side positions: int32/int64 tensors of shape [1] or [B] on q's device (win_pos0 may be
    None with a ring window buffer, which needs no base position)."""
    pairs = (("pos0", pos0),) if (win_ring and win_pos0 is None) else (("pos0", pos0), ("win_pos0", win_pos0))
    for name, x in pairs:
        if (not isinstance(x, torch.Tensor) or x.dim() != 1
                or x.dtype not in (torch.int32, torch.int64)):
            raise ValueError(f"{name} must be an int32/int64 tensor of shape [1] or [B] when either "
                             "position is a tensor")
        if x.device != q.device or x.shape[0] not in (1, q.shape[0]):
            raise ValueError(f"{name}: expected shape [1] or [{q.shape[0]}] on {q.device}, got "
                             f"{tuple(x.shape)} on {x.device}")


# a signature's decisions, as eager.py keeps the prefill op's: run(tensors, pos0, win_pos0, launch_info) here
_CALLS = SignatureCache()


def _lengths_ok(t: tuple, pos0, win_pos0, l: int, d: int, w: int) -> bool:
    """The int positions fit the lengths (common._validate_lengths' rules, decode form); False sends the call
    through validate_inputs, which names what is wrong."""
    if type(pos0) is not int or type(win_pos0) is not int or pos0 < 0 or win_pos0 < 0:
        return False
    S = pos0 + t[0].shape[1]
    n_cmp = t[1].shape[1]
    return (t[3].shape[1] == S == t[4].shape[1] and win_pos0 + t[5].shape[1] == S == win_pos0 + t[6].shape[1]
            and win_pos0 <= max(0, pos0 - w + 1) and n_cmp == t[2].shape[1]
            and n_cmp >= (0 if S < l else (S - l) // d + 1))


def nsa_decode(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_slc: torch.Tensor,
               v_slc: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor, *,
               pos0: int | torch.Tensor, win_pos0: int | torch.Tensor | None, l: int, d: int,
               l_sel: int, n_sel: int, w: int, scale: float | None = None,
               backend: str | KernelPolicy = "auto", win_ring: int = 0, tuning: KernelTuning | None = None,
               launch_info: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NSA for queries at absolute positions pos0 .. pos0 + Tq - 1 (Tq usually 1).

    q [B,Tq,HQ,dk], gates [B,Tq,HQ,3]; k_slc/v_slc [B,S,H,*] raw tokens 0..S-1 (S = pos0 + Tq);
    k_cmp/v_cmp [B,N,H,*] compressed tokens 0..N-1 (N >= those visible; per-query visibility is
    applied, later rows are never read); k_win/v_win [B,Sw,H,*] raw keys for positions
    win_pos0 .. S-1, win_pos0 <= max(0, pos0 - w + 1). Returns (o [B,Tq,HQ,dv] in q.dtype,
    block_idx [B,Tq,H,n_sel]), equal to nsa_attention over the full sequence at those positions.
    pos0/win_pos0 are Python ints; device tensors ([1] or [B], capacity-sized buffers, for CUDA
    graphs) are passed through to the triton decode kernel only. win_ring > 0 (device positions
    only): k_win/v_win are a ring of win_ring >= w + Tq - 1 rows, position p at row p % win_ring,
    and win_pos0 may be None. backend: a name or a resolved KernelPolicy (device positions:
    KernelPolicy.for_device_positions). tuning: launch parameters (None: the policy's).
    launch_info: a dict the triton kernel fills with kernel name -> compiled kernel (diagnostics).
    """
    t = (q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates)
    on_device = isinstance(pos0, torch.Tensor) or isinstance(win_pos0, torch.Tensor)
    rest = (l, d, l_sel, n_sel, w, scale, win_ring, on_device)
    sig = decode_signature(t)
    # triton_module by identity: the hook _triton_decode asks (a test's stand-in is another function)
    key = None if sig is None else (sig, backend if isinstance(backend, str) else id(backend), id(tuning), rest,
                                    tuple(map(type, rest)), triton_module)
    call = _CALLS.get(key) if key is not None else None
    if call is None or call.policy_key is not None and dispatch._cache.get(call.policy_key) is not call.policy:
        call = _decide(t, backend, tuning, rest, key, pos0, win_pos0)
    elif on_device:
        _check_device_positions(q, pos0, win_pos0, win_ring)
    elif not _lengths_ok(t, pos0, win_pos0, l, d, w):
        validate_inputs(dict(zip(_NAMES, t)), NSAParams(l, d, l_sel, n_sel, w), pos0=pos0, win_pos0=win_pos0,
                        decode=True)   # raises, naming the field
    for name in call.counts:
        count_fallback(name)
    return call.run(t, pos0, win_pos0, launch_info)


def _decide(t: tuple, backend, tuning, rest: tuple, key: tuple | None, pos0, win_pos0) -> _Call:
    """A signature's first call: validation, policy, tuning, scale and backend (the Triton launcher), kept
    under key when given."""
    l, d, l_sel, n_sel, w, scale, win_ring, on_device = rest
    q = t[0]
    p = NSAParams(l, d, l_sel, n_sel, w)
    if not isinstance(backend, KernelPolicy):
        _check_requested(backend)
    if isinstance(win_ring, bool) or not isinstance(win_ring, int) or win_ring < 0:
        raise ValueError(f"win_ring must be a non-negative int (0 = linear window buffer), got {win_ring!r}")
    if win_ring and not on_device:
        raise ValueError("win_ring (a ring window buffer) needs device-tensor positions and the triton "
                         "decode kernel; pass win_ring=0 with a linear window buffer otherwise")
    if win_ring and win_ring < w + q.shape[1] - 1:
        raise ValueError(f"win_ring={win_ring} must be >= w + Tq - 1 = {w + q.shape[1] - 1} so every "
                         "query's window is still in the ring")
    validate_inputs(dict(zip(_NAMES, t)), p, pos0=0 if on_device else pos0,
                    win_pos0=0 if on_device else win_pos0, decode=True, check_lengths=not on_device)
    sc = safe_scale(scale, q.shape[-1])
    policy_key = None
    if isinstance(backend, KernelPolicy):
        policy = backend
    else:
        policy = cached_policy(backend, q.device, q.dtype)
        policy_key = (backend, str(q.device), q.dtype, None)   # cached_policy's
    tuning_ = tuning or policy.tuning
    fn = _triton_decode() if policy.backend == "triton" else None
    hp = dict(l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w)
    if on_device:
        if fn is None:
            raise ValueError("pos0/win_pos0 as device tensors need the triton decode kernel (CUDA, "
                             f"triton installed; resolved backend here: {policy.backend}); pass "
                             "Python ints for the torch/reference backends")
        _check_device_positions(q, pos0, win_pos0, win_ring)
        run, counts = _triton_run(fn, t, hp, sc, win_ring, tuning_, True), ()
    else:
        counts = (f"decode:{policy.fallback}",) if policy.fallback is not None else ()
        run = functools.partial(_torch_run, p=p, scale=sc, tuning=tuning_.torch)
        if policy.backend == "reference":
            run = functools.partial(_reference_run, kw=dict(hp, scale=sc))
        elif policy.backend == "triton" and fn is None:
            counts += ("decode:triton->torch",)
        elif policy.backend == "triton":
            try:
                run = _triton_run(fn, t, hp, sc, 0, tuning_, False, run)
            except NotImplementedError:  # kernel does not cover this shape/dtype
                counts += ("decode:triton_unsupported->torch",)
    call = _Call(run, counts, policy_key, policy, (backend, tuning))
    if key is not None:
        _CALLS.keep(key, call)
    return call


def _triton_run(fn: Callable, t: tuple, hp: dict, scale: float, win_ring: int, tuning: KernelTuning,
                pos_ptr: bool, torch_run: Callable | None = None) -> Callable:
    """run of the Triton backend: the kernel module's launcher for this signature (its checks raise here, on
    the first call: NotImplementedError where the kernels do not cover the shape / dtype), or fn as is where it
    is no such module's (a test's stand-in; NotImplementedError from it runs torch_run, counted, when given)."""
    from .triton import decode as tdec
    if fn is not tdec.nsa_decode_triton:
        def run(x, pos0, win_pos0, launch_info):
            try:
                return fn(*x, pos0=pos0, win_pos0=win_pos0, **hp, scale=scale, win_ring=win_ring,
                          tuning=tuning.decode, launch_info=launch_info)
            except NotImplementedError:
                if torch_run is None:
                    raise
                count_fallback("decode:triton_unsupported->torch")
                return torch_run(x, pos0, win_pos0, launch_info)
        return run
    launcher = tdec.decode_launcher(*t, **hp, win_ring=win_ring, tuning=tuning.decode, pos_ptr=pos_ptr)

    def run(x, pos0, win_pos0, launch_info):
        return launcher(*x, pos0, win_pos0, scale, launch_info)
    return run


def _torch_run(t: tuple, pos0, win_pos0, launch_info, *, p: NSAParams, scale: float, tuning) -> tuple:
    return nsa_torch(*t, p=p, scale=scale, pos0=pos0, win_pos0=win_pos0, tuning=tuning)


def _reference_run(t: tuple, pos0, win_pos0, launch_info, *, kw: dict) -> tuple:
    return nsa_reference(*t, pos0=pos0, win_pos0=win_pos0, **kw)
