"""The NSA op run eagerly (no trace routing): backend policy, validation, and the chosen backend.
nsa.ops.nsa_attention (the public entry, documented there) calls it outside torch.compile, and the
custom op nsa::attention's kernels call it under torch.compile (nsa/ops/custom_op.py)."""
from __future__ import annotations

import functools

import torch

from . import dispatch
from .batched import nsa_torch
from .common import NSAParams, safe_scale, validate_inputs
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


def eager_attention(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_slc: torch.Tensor,
                    v_slc: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor, *,
                    l: int = 32, d: int = 16, l_sel: int = 64, n_sel: int = 16, w: int = 512,
                    scale: float | None = None, backend: str | KernelPolicy = "auto",
                    tile: int | None = None, recompute: bool | None = None,
                    tuning: KernelTuning | None = None, allow_flash: bool = True,
                    flash_branches: str = "preset") -> tuple[torch.Tensor, torch.Tensor]:
    """nsa.ops.nsa_attention's contract (see there), run as is."""
    p = NSAParams(l, d, l_sel, n_sel, w)
    tensors = dict(q=q, k_cmp=k_cmp, v_cmp=v_cmp, k_slc=k_slc, v_slc=v_slc, k_win=k_win,
                   v_win=v_win, gates=gates)
    if not isinstance(backend, KernelPolicy):
        _check_requested(backend)
    validate_inputs(tensors, p)
    if isinstance(backend, KernelPolicy):
        policy = backend
    else:  # the shape key: a triton choice is probed once per (device, dtype, shape), nsa/ops/probe.py
        policy = cached_policy(backend, q.device, q.dtype,
                               ProbeShape.of(q, v_win, l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w))
    sc = safe_scale(scale, q.shape[-1])
    if policy.fallback is not None:
        count_fallback(policy.fallback)
    used = policy.backend
    tuning = _flash_override(tuning or policy.tuning, flash_branches, allow_flash)
    kw = dict(l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w, scale=sc)
    if used == "triton":
        mod = dispatch.triton_module()   # looked up per call: tests replace it
        try:
            return mod.nsa_attention_triton(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, **kw,
                                            tuning=tuning)
        except NotImplementedError:  # kernel does not cover this shape/dtype
            count_fallback("triton_unsupported->torch")
            used = "torch"
    if used == "reference":
        return nsa_reference(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, **kw)
    return nsa_torch(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, p=p, scale=sc, tile=tile,
                     checkpoint=recompute, tuning=tuning.torch)

