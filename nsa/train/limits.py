"""Bounds an entry point checks before it allocates: what a decode of N tokens from a trained model needs.

``decode_budget`` estimates the bytes of a cached decode of ``total`` positions (prompt + new tokens)
and refuses one that cannot fit in the device's free memory, in one line naming the flag and the
largest value that would fit. Per position and layer the NSA cache keeps the raw keys/values (the
selection branch reads any block: n_kv_groups x (d_k + d_v) values), and at most as much again for the
compression branch and the window (both bounded by the raw stream), hence the factor 2; the output
ids cost 8 bytes per position. The estimate errs high on purpose: it exists to stop a request that is
off by orders of magnitude (``--max-new-tokens 1000000000000``: ~8 TB of ids alone), not to pack memory.
"""
from __future__ import annotations

from typing import Optional

import torch

from nsa.config import ModelConfig

SAFETY = 0.5          # a decode may use at most this fraction of the free memory


def bytes_per_position(model_cfg: ModelConfig, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * model_cfg.n_kv_groups * (model_cfg.d_k + model_cfg.d_v) * elem
    return model_cfg.n_layers * per_layer + 8


def free_memory(device: torch.device) -> Optional[int]:
    """Free bytes on ``device`` (CUDA: the driver's count; CPU: available RAM), None if unknown."""
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except Exception:
        try:
            return os_available()
        except Exception:
            return None


def os_available() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def decode_budget(model_cfg: ModelConfig, prompt_len: int, max_new: int, device: torch.device, dtype: torch.dtype,
                  *, flag: str = "--max-new-tokens", free: Optional[int] = None) -> int:
    """Bytes the decode needs; raises ValueError (one line, naming ``flag`` and the largest value that
    fits) when it exceeds SAFETY x the free memory of ``device``."""
    per = bytes_per_position(model_cfg, dtype)
    need = per * (prompt_len + max_new)
    free = free_memory(device) if free is None else free
    if free is not None and need > SAFETY * free:
        fits = max(0, int(SAFETY * free) // per - prompt_len)
        raise ValueError(f"{flag}={max_new} needs about {need / 2**30:.1f} GiB of decode caches on {device} "
                         f"({per} bytes per position), more than half of its {free / 2**30:.1f} GiB free: "
                         f"use {flag} <= {fits}")
    return need
