"""Mixed precision: autocast dtype, fp32 master weights, GradScaler for fp16, TF32.

The model's parameters always stay fp32 ("master weights"); bf16/fp16 only change the dtype that
autocast computes matmuls/attention in. fp16 additionally needs loss scaling (``GradScaler``) because
its 5-bit exponent underflows small gradients; bf16 has fp32's exponent range and needs none.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ContextManager, Optional

import torch

from nsa.config import RuntimeConfig

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Precision:
    """What the step needs to know about precision on one device."""

    name: str                       # fp32 | bf16 | fp16
    device_type: str                # "cpu" | "cuda" (autocast's device_type)
    dtype: Optional[torch.dtype]    # autocast dtype; None = plain fp32
    scaler: torch.amp.GradScaler    # enabled only for fp16; a disabled scaler is a no-op everywhere
    # autocast's per-region cache of fp32->low-precision weight casts; must be off while a CUDA graph
    # is captured (cached casts would outlive the capture), see nsa/train/graphed.py
    autocast_cache: bool = True

    def autocast(self) -> ContextManager[Any]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype, cache_enabled=self.autocast_cache)

    @property
    def uses_scaler(self) -> bool:
        return self.scaler.is_enabled()

    def describe(self) -> str:
        s = f"precision={self.name} (autocast {self.dtype or 'off'} on {self.device_type}, fp32 master weights"
        if self.uses_scaler:
            st = self.scaler.state_dict()
            s += f", GradScaler init_scale={st['scale']} growth_interval={st['growth_interval']}"
        return s + ")"


def enable_tf32(device: torch.device, enabled: bool = True) -> None:
    """TF32 matmuls/convs on Ampere+ (10-bit mantissa inputs, fp32 accumulate). No-op without CUDA."""
    if device.type != "cuda":
        return
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled


def setup_precision(name: str, device: torch.device, *, tf32: bool = True, init_scale: float = 2.0 ** 16,
                    growth_factor: float = 2.0, backoff_factor: float = 0.5,
                    growth_interval: int = 2000) -> Precision:
    """Resolve precision for ``device``. Raises ValueError for fp16 on CPU or bf16 where unsupported."""
    if name not in _DTYPES:
        raise ValueError(f"precision={name!r} is not one of {list(_DTYPES)}")
    dtype = _DTYPES[name]
    if name == "fp16" and device.type != "cuda":
        raise ValueError("precision=fp16 needs a CUDA device (GradScaler loss scaling); use bf16 or fp32 on CPU")
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError("precision=bf16 is not supported by this GPU (pre-Ampere); use fp16 or fp32")
    enable_tf32(device, tf32)
    scaler = torch.amp.GradScaler(device.type, init_scale=init_scale, growth_factor=growth_factor,
                                  backoff_factor=backoff_factor, growth_interval=growth_interval,
                                  enabled=(name == "fp16"))
    return Precision(name=name, device_type=device.type, dtype=dtype, scaler=scaler)


def precision_from_config(runtime_cfg: RuntimeConfig, device: torch.device) -> Precision:
    """``runtime_cfg`` is nsa.config.RuntimeConfig (precision, tf32, scaler_* knobs)."""
    r = runtime_cfg
    return setup_precision(r.precision, device, tf32=r.tf32, init_scale=r.scaler_init_scale,
                           growth_factor=r.scaler_growth_factor, backoff_factor=r.scaler_backoff_factor,
                           growth_interval=r.scaler_growth_interval)
