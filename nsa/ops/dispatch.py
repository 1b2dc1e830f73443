"""Backend choice for the NSA op: resolved once (KernelPolicy), logged in one line, fallbacks counted.

Backends: "reference" (nsa/ops/reference.py, fp64 loops), "torch" (nsa/ops/batched.py, tiled and
vectorised), "triton" (nsa/ops/triton, imported lazily, GPU only). "auto" = triton on CUDA when
the triton package exposes working kernels, else torch.
"""
from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass, field
from types import ModuleType

import torch

BACKENDS = ("reference", "torch", "triton", "auto")
BRANCHES = ("cmp", "slc", "win", "scores")

_lock = threading.Lock()
_fallbacks: dict[str, int] = {}


def count_fallback(name: str) -> None:
    """Increment the global runtime-fallback counter `name` (e.g. "triton->torch")."""
    with _lock:
        _fallbacks[name] = _fallbacks.get(name, 0) + 1


def fallback_counts() -> dict[str, int]:
    """Copy of the global fallback counters."""
    with _lock:
        return dict(_fallbacks)


def reset_fallback_counts() -> None:
    with _lock:
        _fallbacks.clear()


def triton_module() -> ModuleType | None:
    """nsa.ops.triton if it imports and exposes the agreed hook, else None."""
    try:
        mod = importlib.import_module("nsa.ops.triton")
    except Exception:  # noqa: BLE001 - any import problem means "no triton path"
        return None
    if not (hasattr(mod, "triton_available") and hasattr(mod, "nsa_attention_triton")):
        return None
    return mod


def _triton_status(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, f"triton kernels need CUDA, device is {device.type}"
    mod = triton_module()
    if mod is None:
        return False, "nsa.ops.triton does not expose triton_available/nsa_attention_triton"
    try:
        ok = bool(mod.triton_available())
    except Exception as exc:  # noqa: BLE001
        return False, f"triton_available() raised {type(exc).__name__}: {exc}"
    return (True, "triton kernels available") if ok else (False, "triton_available() is False")


def _check_requested(requested: str) -> None:
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}")


def resolve_backend(requested: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """The backend actually used for `requested` on this device/dtype ("reference"|"torch"|"triton")."""
    return KernelPolicy.resolve(device, dtype, requested).backend


def _cmp_dense_note() -> str:
    """How the Triton backend runs the compressed branch (nsa.ops.triton.function.CMP_DENSE)."""
    try:
        from .triton import function as tfn
    except Exception as exc:  # noqa: BLE001 - describing must not fail
        return f"compressed-branch policy unknown ({type(exc).__name__})"
    if tfn.CMP_DENSE == "off":
        return "compressed branch on the Triton kernel (CMP_DENSE=off)"
    if tfn.CMP_DENSE != "auto":
        return f"compressed branch on dense SDPA {tfn.CMP_DENSE} (forced)"
    return (f"compressed branch on dense SDPA (cudnn, else flash; probed once) at T >= "
            f"{tfn.CMP_DENSE_MIN_T} without deterministic algorithms, else the Triton kernel")


def _win_note() -> str:
    """Why the window branch runs on the own Triton kernel (the issue's candidates, measured)."""
    try:
        import flash_attn  # noqa: F401
        fa = "flash-attn installed (off for this branch unless nsa.ops.flash.select_flash_branches)"
    except Exception:  # noqa: BLE001 - any import problem means "not available"
        fa = "flash-attn not installed"
    return ("window branch on the own Triton kernel (H200, 64k, w=512: fwd 4.15 ms vs compiled FlexAttention "
            f"4.54, fwd+bwd 13.5 vs 16.0; bench/bench_window.py); {fa}")


@dataclass(frozen=True)
class KernelPolicy:
    """Per-branch backend choice with reasons. Build once (model construction), reuse per call."""

    requested: str
    device: str
    dtype: str
    backends: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    fallback: str | None = None  # name of the fallback counter when requested != used

    @classmethod
    def resolve(cls, device: torch.device | str, dtype: torch.dtype,
                requested: str = "auto", allow_flash: bool = True,
                head_dim: int | None = None) -> "KernelPolicy":
        _check_requested(requested)
        dev = torch.device(device)
        ok, why = _triton_status(dev) if requested in ("auto", "triton") else (False, "")
        fallback = None
        if requested == "reference":
            used, reason = "reference", "requested (fp64 oracle, slow)"
        elif requested == "torch":
            used, reason = "torch", "requested"
        elif ok:
            used, reason = "triton", why
        else:
            used = "torch"
            reason = f"{requested}: {why} -> torch"
            if requested == "triton" or dev.type == "cuda":
                fallback = f"{requested}->torch"
        backends = {b: used for b in BRANCHES}
        reasons = {b: reason for b in BRANCHES}
        if used == "triton":
            reasons["cmp"] = reason + "; " + _cmp_dense_note()
            reasons["win"] = reason + "; " + _win_note()
        if head_dim is not None:  # dense attention and flash-attn (nsa/ops/flash.py), probed once
            from .flash import policy_entries
            extra_b, extra_r = policy_entries(dev, dtype, head_dim, allow_flash)
            backends.update(extra_b)
            reasons.update({b: (reasons[b] + "; " + r if b in reasons else r) for b, r in extra_r.items()})
        return cls(requested, str(dev), str(dtype).replace("torch.", ""), backends, reasons, fallback)

    @property
    def backend(self) -> str:
        """The fused op's backend (all branches share one at present)."""
        return self.backends["cmp"]

    def __str__(self) -> str:
        parts = " ".join(f"{b}={v}" for b, v in self.backends.items())
        reasons = sorted(set(self.reasons.values()))
        return (f"KernelPolicy(requested={self.requested} device={self.device} dtype={self.dtype}): "
                f"{parts} [{'; '.join(reasons)}]")


_cache: dict[tuple[str, str, torch.dtype], KernelPolicy] = {}


def cached_policy(requested: str, device: torch.device, dtype: torch.dtype) -> KernelPolicy:
    """KernelPolicy.resolve memoised per (requested, device, dtype): no re-probing per call."""
    key = (requested, str(device), dtype)
    pol = _cache.get(key)
    if pol is None:
        pol = KernelPolicy.resolve(device, dtype, requested)
        _cache[key] = pol
    return pol
