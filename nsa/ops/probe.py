"""One-off probe of the Triton NSA kernels on the real device with the model's shapes.

A compile error, an out-of-shared-memory launch or a CUDA error on an unfamiliar GPU (e.g. sm_80
with tiles tuned on sm_90) must not kill a run: before the policy chooses "triton" for a shape, the
fused op runs forward and backward once on a small T (a few ms) and any exception turns the choice
into "torch" with the reason logged and counted (nsa/ops/fallbacks.py, "probe:triton->torch").
Results are cached per (device, dtype, shape key); nothing is probed inside a CUDA-graph capture or
while torch.compile traces (the caller then keeps the unprobed choice and probes on a later call).
"""
from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass

import torch

from .fallbacks import count_fallback

__all__ = ["ProbeShape", "ProbeResult", "probe_triton", "can_probe", "clear_probe_cache",
           "probe_results", "PROBE_COUNTER"]

log = logging.getLogger(__name__)
PROBE_COUNTER = "probe:triton->torch"


@dataclass(frozen=True)
class ProbeShape:
    """What selects the kernels' code paths and tiles: heads, head dims and the NSA block sizes."""

    HQ: int
    H: int
    dk: int
    dv: int
    l: int
    d: int
    l_sel: int
    n_sel: int
    w: int

    @classmethod
    def of(cls, q: torch.Tensor, v: torch.Tensor, *, l: int, d: int, l_sel: int, n_sel: int,
           w: int) -> "ProbeShape":
        """From the op's q [B,T,HQ,dk] and a raw v [B,T,H,dv] (Python ints only: no host sync)."""
        return cls(q.shape[2], v.shape[2], q.shape[3], v.shape[3], l, d, l_sel, n_sel, w)

    def probe_len(self) -> int:
        """A small T that still has compressed tokens and more than one selection block and window:
        2 * max(l_sel, l, 64), rounded up to a multiple of 64 (the kernels' key tiles)."""
        t = 2 * max(self.l_sel, self.l, 64)
        return -(-t // 64) * 64


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    reason: str


_lock = threading.Lock()
_results: dict[tuple, ProbeResult] = {}


def clear_probe_cache() -> None:
    with _lock:
        _results.clear()


def probe_results() -> dict[tuple, ProbeResult]:
    """Copy of the cache: (device, dtype, shape) -> ProbeResult."""
    with _lock:
        return dict(_results)


def _indexed(device: torch.device | str) -> torch.device:
    """cuda -> cuda:<current>: the op sees q.device with its index, so build-time and call-time keys match."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        try:
            return torch.device("cuda", torch.cuda.current_device())
        except Exception:  # noqa: BLE001 - no driver: keep the name as given
            return dev
    return dev


def can_probe(device: torch.device) -> bool:
    """False inside a CUDA-graph capture (a probe would allocate and sync) or a torch.compile trace."""
    # only ask dynamo when it is loaded: importing it here would import triton before a CPU test run
    # has chosen TRITON_INTERPRET (tests/conftest.py)
    if "torch._dynamo" in sys.modules and torch.compiler.is_compiling():
        return False
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    return True


def _inputs(shape: ProbeShape, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random op inputs at T = shape.probe_len(), B = 1, all requiring grad (backward is probed too)."""
    from .common import num_cmp_tokens
    T = shape.probe_len()
    n = num_cmp_tokens(T, shape.l, shape.d)
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g).to(device=device, dtype=dtype).requires_grad_(True)

    H, dk, dv = shape.H, shape.dk, shape.dv
    gates = torch.rand(1, T, shape.HQ, 3, generator=g).to(device=device, dtype=dtype).requires_grad_(True)
    return dict(q=rnd(1, T, shape.HQ, dk), k_cmp=rnd(1, n, H, dk), v_cmp=rnd(1, n, H, dv),
                k_slc=rnd(1, T, H, dk), v_slc=rnd(1, T, H, dv), k_win=rnd(1, T, H, dk),
                v_win=rnd(1, T, H, dv), gates=gates)


def _run(mod, shape: ProbeShape, device: torch.device, dtype: torch.dtype, tuning) -> None:
    x = _inputs(shape, device, dtype)
    o, _ = mod.nsa_attention_triton(**x, l=shape.l, d=shape.d, l_sel=shape.l_sel, n_sel=shape.n_sel,
                                    w=shape.w, tuning=tuning)
    o.float().square().mean().backward()
    bad = [k for k, t in x.items() if t.grad is None]
    if not torch.isfinite(o.float()).all():  # a launch that "ran" but wrote garbage (host sync: probe only)
        raise RuntimeError("forward output is not finite")
    if bad:
        raise RuntimeError(f"backward gave no gradient for {', '.join(bad)}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # asynchronous launch errors surface here, inside the probe


def _triton_ops():
    """nsa.ops.triton, or None where it does not import (the same test as dispatch.triton_module; kept
    here so that this module does not import dispatch, which imports it)."""
    import importlib
    try:
        mod = importlib.import_module("nsa.ops.triton")
    except Exception:  # noqa: BLE001 - any import problem means "no triton path"
        return None
    return mod if hasattr(mod, "nsa_attention_triton") else None


def probe_triton(device: torch.device | str, dtype: torch.dtype, shape: ProbeShape,
                 tuning=None) -> ProbeResult | None:
    """Run the Triton op forward + backward once for (device, dtype, shape); cached. None when
    probing is not possible now (capture / compile trace): the caller decides without a probe."""
    dev = _indexed(device)
    key = (str(dev), dtype, shape)
    with _lock:
        hit = _results.get(key)
    if hit is not None:
        return hit
    if not can_probe(dev):
        return None
    mod = _triton_ops()
    if mod is None:
        res = ProbeResult(False, "nsa.ops.triton does not import")
    else:
        try:
            # the first op call may come from eval / generate: backward is probed regardless. It may
            # also come from inside a checkpointed block's forward: identity saved-tensor hooks shadow
            # the checkpoint's, so the probe's own saved tensors are not counted as the block's (the
            # recomputation, which finds the cached result, would save fewer and fail)
            with torch.inference_mode(False), torch.enable_grad(), \
                    torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                _run(mod, shape, dev, dtype, tuning)
            res = ProbeResult(True, "probed fwd+bwd at T=%d" % shape.probe_len())
        except NotImplementedError as exc:
            # the kernels do not cover this shape/dtype: not a device fault; the op already falls back
            # per call on this (counted "triton_unsupported->torch"), so the choice stays as it was
            res = ProbeResult(True, f"probe: not covered by the kernels ({exc}); the op falls back per call")
        except Exception as exc:  # noqa: BLE001 - compile, OutOfResources, CUDA errors: all mean "not here"
            # triton's CompilationError puts the source excerpt first and the message last
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()] or [""]
            msg = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
            res = ProbeResult(False, f"{type(exc).__name__}: {msg}"[:300])
    if not res.ok:
        count_fallback(PROBE_COUNTER)
        log.warning("triton probe failed on %s %s for %s (%s); this shape runs on the torch backend",
                    dev, str(dtype).replace("torch.", ""), shape, res.reason)
    with _lock:
        _results[key] = res
    return res
