"""Backend choice for the NSA op: resolved once (KernelPolicy), logged in one line, fallbacks counted.

Backends: "reference" (nsa/ops/reference.py, fp64 loops), "torch" (nsa/ops/batched.py, tiled and
vectorised), "triton" (nsa/ops/triton, imported lazily, GPU only). "auto" = triton on CUDA when
the triton package exposes working kernels, else torch. Given the op's shapes (nsa.ops.probe.ProbeShape),
a triton choice is first probed once on the device (nsa/ops/probe.py) and falls back to torch if the
kernels fail to compile or launch there.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass, field
from types import ModuleType

import torch

from nsa.config import triton_interpreter

from .fallbacks import count_fallback, fallback_counts, reset_fallback_counts
from .plan import tuning_for
from .tuning import CmpDenseTuning, KernelTuning

__all__ = ["BACKENDS", "BRANCHES", "KernelPolicy", "cached_policy", "resolve_backend", "triton_module",
           "count_fallback", "fallback_counts", "reset_fallback_counts"]

BACKENDS = ("reference", "torch", "triton", "auto")
BRANCHES = ("cmp", "slc", "win", "scores")
log = logging.getLogger(__name__)


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


def _cmp_dense_note(cfg: CmpDenseTuning) -> str:
    """How the Triton backend runs the compressed branch under cfg (tuning.cmp_dense)."""
    if cfg.mode == "off":
        return "compressed branch on the Triton kernel (cmp_dense.mode=off)"
    if cfg.mode != "auto":
        return f"compressed branch on dense SDPA {cfg.mode} (forced)"
    return (f"compressed branch on dense SDPA (cudnn, else flash; probed once) at T >= "
            f"{cfg.min_t} without deterministic algorithms, else the Triton kernel")


def _win_note(tuning: KernelTuning) -> str:
    """Where the window branch runs under tuning.flash (flash-attn where measured faster)."""
    own = "own Triton kernel (faster than compiled FlexAttention: docs/kernels.md, window)"
    f = tuning.flash
    if f.win == "off":
        return f"window branch on the {own}, not flash-attn (tuning.flash.win=off)"
    return (f"window branch on flash-attn from T >= {f.min_t} where installed and allowed "
            f"(tuning.flash.win={f.win}; measured faster: docs/kernels.md, window), else the {own}")


@dataclass(frozen=True)
class KernelPolicy:
    """Per-branch backend choice with reasons, and the launch parameters (`tuning`, a preset of
    nsa/ops/tuning.py for this device). Build once (model construction), reuse per call."""

    requested: str
    device: str
    dtype: str
    backends: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    fallback: str | None = None  # name of the fallback counter when requested != used
    tuning: KernelTuning | None = None  # None: the device preset

    def __post_init__(self) -> None:
        if self.tuning is None:
            object.__setattr__(self, "tuning", tuning_for(self.device))   # the one preset lookup of the policy

    @classmethod
    def resolve(cls, device: torch.device | str, dtype: torch.dtype,
                requested: str = "auto", allow_flash: bool = True,
                head_dim: int | None = None, shape=None, tuning: KernelTuning | None = None) -> "KernelPolicy":
        """shape (nsa.ops.probe.ProbeShape): when triton is chosen, probe its kernels once with these
        shapes on this device (nsa/ops/probe.py) and fall back to torch if they fail there.
        tuning: the launch parameters (None: the preset of this device, tuning_for)."""
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
        tuning = tuning or cls(requested, str(dev), "").tuning
        if used == "triton" and shape is not None:
            from .probe import probe_triton
            res = probe_triton(dev, dtype, shape, tuning)
            if res is not None and not res.ok:
                used, reason = "torch", f"{requested}: triton probe failed ({res.reason}) -> torch"
                fallback = f"{requested}->torch"
            elif res is not None:
                reason = f"{reason}; {res.reason}"
        backends = {b: used for b in BRANCHES}
        reasons = {b: reason for b in BRANCHES}
        if used == "triton":
            reasons["cmp"] = reason + "; " + _cmp_dense_note(tuning.cmp_dense)
            reasons["win"] = reason + "; " + _win_note(tuning)
        if head_dim is not None:  # dense attention and flash-attn (nsa/ops/flash.py), probed once
            from .flash import policy_entries
            extra_b, extra_r = policy_entries(dev, dtype, head_dim, allow_flash, tuning.flash)
            backends.update(extra_b)
            reasons.update({b: (reasons[b] + "; " + r if b in reasons else r) for b, r in extra_r.items()})
        return cls(requested, str(dev), str(dtype).replace("torch.", ""), backends, reasons, fallback, tuning)

    @classmethod
    def for_device_positions(cls, device: torch.device | str, dtype: torch.dtype) -> "KernelPolicy":
        """The policy of decode with positions in device tensors (the CUDA-graph form): only the
        triton decode kernel reads them, natively on CUDA, or on CPU through Triton's interpreter when
        the process opted in with TRITON_INTERPRET=1 (the tests). Elsewhere the triton->torch policy,
        which nsa_decode refuses for device positions with an error naming the fix. Memoised per
        (device, dtype, TRITON_INTERPRET)."""
        dev = torch.device(device)
        key = ("device_positions", str(dev), dtype, triton_interpreter())
        pol = _cache.get(key)
        if pol is None:
            pol = _cache[key] = cls._for_device_positions(dev, dtype)
        return pol

    @classmethod
    def _for_device_positions(cls, dev: torch.device, dtype: torch.dtype) -> "KernelPolicy":
        if dev.type == "cuda" or not triton_interpreter() or triton_module() is None \
                or importlib.util.find_spec("triton") is None:
            return cls.resolve(dev, dtype, "triton")
        why = "triton decode kernel through the interpreter (TRITON_INTERPRET=1)"
        return cls("triton", str(dev), str(dtype).replace("torch.", ""), {b: "triton" for b in BRANCHES},
                   {b: why for b in BRANCHES}, None, None)

    @property
    def backend(self) -> str:
        """The fused op's backend (all branches share one at present)."""
        return self.backends["cmp"]

    def __str__(self) -> str:
        parts = " ".join(f"{b}={v}" for b, v in self.backends.items())
        reasons = sorted(set(self.reasons.values()))
        return (f"KernelPolicy(requested={self.requested} device={self.device} dtype={self.dtype} "
                f"tuning={self.tuning.name}): {parts} [{'; '.join(reasons)}]")


_cache: dict[tuple, KernelPolicy] = {}


def cached_policy(requested: str, device: torch.device, dtype: torch.dtype, shape=None) -> KernelPolicy:
    """KernelPolicy.resolve memoised per (requested, device, dtype, shape): no re-probing per call.
    With a shape (nsa.ops.probe.ProbeShape) a triton choice is probed first; where probing is not
    possible now (CUDA-graph capture, torch.compile trace) the unprobed policy is returned uncached."""
    key = (requested, str(device), dtype, shape)
    pol = _cache.get(key)
    if pol is None:
        if shape is not None:
            from .probe import can_probe
            if not can_probe(torch.device(device)):
                return cached_policy(requested, device, dtype)
        pol = KernelPolicy.resolve(device, dtype, requested, shape=shape)
        _cache[key] = pol
        log.info("%s", pol)
    return pol


def probe_model(model: torch.nn.Module, device: torch.device | str, dtype: torch.dtype) -> list:
    """Resolve (and probe) the kernel policy of every NSA attention layer of `model` once, at model
    build, with the compute dtype (bf16 under autocast). Returns the distinct policies. Later op
    calls with the same (backend, device, dtype, shape) hit the cache: no probe in the training step."""
    from .probe import ProbeShape, _indexed
    dev = _indexed(device)
    seen: dict[tuple, object] = {}
    for m in model.modules():
        if not all(hasattr(m, a) for a in ("backend", "n_heads", "n_kv_groups", "d_k", "d_v", "l_sel", "n_sel")):
            continue
        shape = ProbeShape(m.n_heads, m.n_kv_groups, m.d_k, m.d_v, m.l, m.d, m.l_sel, m.n_sel, m.w)
        key = (m.backend, shape)
        if key not in seen:
            seen[key] = cached_policy(m.backend, dev, dtype, shape)
    return list(seen.values())
