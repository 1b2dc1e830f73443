"""Triton backend of nsa_attention (forward + backward).

Importing this package never imports triton: ``triton_available()`` says whether the kernels can run
here (triton importable and a CUDA device present), and the kernel modules are loaded on the first
call of ``nsa_attention_triton``. Under ``TRITON_INTERPRET=1`` (set before triton is first imported)
the kernels also run on CPU tensors through Triton's interpreter; that is what the CPU tests use,
calling ``nsa_attention_triton`` directly (``triton_available()`` stays False without CUDA so that
``backend="auto"`` never picks the slow interpreter).
"""
from __future__ import annotations

import functools
import importlib.util

import torch

__all__ = ["triton_available", "triton_importable", "nsa_attention_triton", "planned_call", "check_supported",
           "SUPPORTED_DTYPES", "MAX_HEAD_DIM"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256   # padded head dims up to 256 have tile configs (tuning.AttnTuning.big_*)


def triton_importable() -> bool:
    """True when the triton package can be imported (it is not imported here)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError, AttributeError):  # e.g. sys.modules["triton"] = None
        return False


def triton_available() -> bool:
    """True when the Triton kernels can run natively: CUDA present and triton imports."""
    if not (torch.cuda.is_available() and triton_importable()):
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install means "not available"
        return False
    return True


def check_supported(q: torch.Tensor, v: torch.Tensor, gates: torch.Tensor) -> None:
    """NotImplementedError (the dispatcher falls back to torch) for what the Triton kernels (prefill and
    decode) do not cover: dtypes other than fp16/bf16/fp32, head dims above MAX_HEAD_DIM."""
    for name, x in (("q", q), ("gates", gates)):
        if x.dtype not in SUPPORTED_DTYPES:
            raise NotImplementedError(f"{name} has dtype {x.dtype}; the triton kernels support fp16/bf16/fp32 "
                                      "(use backend='torch' or 'reference' for fp64)")
    if q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM:
        raise NotImplementedError(f"d_k={q.shape[-1]} / d_v={v.shape[-1]} exceed {MAX_HEAD_DIM}, the largest "
                                  "head dim of the triton kernels; use backend='torch'")


def nsa_attention_triton(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_slc: torch.Tensor,
                         v_slc: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor,
                         *, l: int = 32, d: int = 16, l_sel: int = 64, n_sel: int = 16, w: int = 512,
                         scale: float | None = None, tuning=None) -> tuple[torch.Tensor, torch.Tensor]:
    """NSA prefill on Triton kernels; same contract as ``nsa.ops.nsa_attention`` (nsa/ops/__init__.py).

    q [B,T,HQ,dk]; k_cmp/v_cmp [B,N,H,dk|dv]; k_slc/v_slc/k_win/v_win [B,T,H,dk|dv]; gates [B,T,HQ,3].
    Returns (o [B,T,HQ,dv] in q's dtype, block_idx [B,T,H,n_sel] int64 ascending, -1 padded).
    Differentiable w.r.t. q, every k/v and gates (fp32 accumulation, no atomics in our kernels).
    tuning: a nsa.ops.tuning.KernelTuning (None: the preset of q's device). From
    tuning.cmp_dense.min_t tokens on the compressed branch runs on cuDNN/flash, whose backward need
    not be bitwise repeatable; with torch.use_deterministic_algorithms(True) every branch stays on
    the deterministic kernels.
    """
    from ..common import NSAParams, safe_scale, validate_inputs

    p = NSAParams(l, d, l_sel, n_sel, w)
    tensors = dict(q=q, k_cmp=k_cmp, v_cmp=v_cmp, k_slc=k_slc, v_slc=v_slc, k_win=k_win, v_win=v_win,
                   gates=gates)
    validate_inputs(tensors, p)
    check_supported(q, v_slc, gates)
    from .function import nsa_triton_apply

    return nsa_triton_apply(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, l=l, d=d, l_sel=l_sel,
                            n_sel=n_sel, w=w, scale=safe_scale(scale, q.shape[-1]), tuning=tuning)


def planned_call(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_slc: torch.Tensor,
                 v_slc: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor, *, l: int,
                 d: int, l_sel: int, n_sel: int, w: int, scale: float, tuning) -> tuple:
    """nsa_attention_triton's support check and plan for these (validated) inputs, made once: (a function of
    the eight tensors running that plan, whether it is final, i.e. may serve later calls of the same shapes,
    strides, alignment and grad state: eager.py keeps it per call signature). NotImplementedError as there."""
    check_supported(q, v_slc, gates)
    from .function import call_plan, nsa_triton_apply
    plan = call_plan(q, k_cmp, v_cmp, k_slc, v_slc, l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w, tuning=tuning)
    return functools.partial(nsa_triton_apply, l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w, scale=scale, tuning=tuning,
                             plan=plan), plan.needs is None
