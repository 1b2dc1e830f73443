"""Decode / chunked-prefill entry: queries at absolute offset pos0 against cached keys.

Uses the same tiled core as prefill (batched.nsa_torch with a query offset), so decode and
prefill run the same arithmetic and choose the same blocks. On CUDA with triton, the triton
decode kernel (nsa/ops/triton/decode.py nsa_decode_triton) is used. Positions in device tensors
(the CUDA-graph form, NSAAttention.decode_static) need that kernel: pass
KernelPolicy.for_device_positions(device, dtype) as the backend.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from .batched import nsa_torch
from .common import NSAParams, safe_scale, validate_inputs
from .dispatch import KernelPolicy, _check_requested, cached_policy, triton_module
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
    p = NSAParams(l, d, l_sel, n_sel, w)
    tensors = dict(q=q, k_cmp=k_cmp, v_cmp=v_cmp, k_slc=k_slc, v_slc=v_slc, k_win=k_win,
                   v_win=v_win, gates=gates)
    if not isinstance(backend, KernelPolicy):
        _check_requested(backend)
    on_device = isinstance(pos0, torch.Tensor) or isinstance(win_pos0, torch.Tensor)
    if isinstance(win_ring, bool) or not isinstance(win_ring, int) or win_ring < 0:
        raise ValueError(f"win_ring must be a non-negative int (0 = linear window buffer), got {win_ring!r}")
    if win_ring and not on_device:
        raise ValueError("win_ring (a ring window buffer) needs device-tensor positions and the triton "
                         "decode kernel; pass win_ring=0 with a linear window buffer otherwise")
    if win_ring and win_ring < w + q.shape[1] - 1:
        raise ValueError(f"win_ring={win_ring} must be >= w + Tq - 1 = {w + q.shape[1] - 1} so every "
                         "query's window is still in the ring")
    validate_inputs(tensors, p, pos0=0 if on_device else pos0,
                    win_pos0=0 if on_device else win_pos0, decode=True, check_lengths=not on_device)
    sc = safe_scale(scale, q.shape[-1])
    policy = backend if isinstance(backend, KernelPolicy) else cached_policy(backend, q.device, q.dtype)
    tuning = tuning or policy.tuning
    fn = _triton_decode() if policy.backend == "triton" else None
    kw = dict(pos0=pos0, win_pos0=win_pos0, l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w, scale=sc)
    tkw = dict(tuning=tuning.decode, launch_info=launch_info)
    if on_device:
        if fn is None:
            raise ValueError("pos0/win_pos0 as device tensors need the triton decode kernel (CUDA, "
                             f"triton installed; resolved backend here: {policy.backend}); pass "
                             "Python ints for the torch/reference backends")
        _check_device_positions(q, pos0, win_pos0, win_ring)
        return fn(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, win_ring=win_ring, **kw, **tkw)
    if policy.fallback is not None:
        count_fallback(f"decode:{policy.fallback}")
    if policy.backend == "reference":
        return nsa_reference(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, **kw)
    if policy.backend == "triton":
        if fn is None:
            count_fallback("decode:triton->torch")
        else:
            try:
                return fn(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, **kw, **tkw)
            except NotImplementedError:  # kernel does not cover this shape/dtype
                count_fallback("decode:triton_unsupported->torch")
    return nsa_torch(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, p=p, scale=sc,
                     pos0=pos0, win_pos0=win_pos0, tuning=tuning.torch)
