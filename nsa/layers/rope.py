"""Rotary position embedding (RoPE), rotate-half convention.

The angles are computed in fp32 (bf16 positions lose integer precision past 256) and the rotation
is done in fp32; the result is cast back to the input dtype. Positions are absolute, so decode
passes `offset` = number of tokens already in the cache and gets exactly the prefill rotation.
"""
from __future__ import annotations

import torch
from torch import nn


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float = 10000.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for integer `positions` [T] -> two fp32 tensors [T, head_dim // 2]."""
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim={head_dim}: RoPE needs an even head dimension (d_k)")
    half = head_dim // 2
    inv_freq = base ** (-torch.arange(half, device=positions.device, dtype=torch.float32) / half)
    ang = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, half]
    return ang.cos(), ang.sin()


def rope_table(T: int, head_dim: int, base: float = 10000.0, offset: int = 0,
               positions: torch.Tensor | None = None, device: torch.device | str | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, head_dim // 2] fp32 of T tokens at offset .. offset+T-1 (or at `positions` [T], a device
    tensor): the tables apply_rope and the fused projection kernel (nsa/ops/triton/rope_layout.py) share."""
    if positions is None:
        positions = torch.arange(offset, offset + T, device=device)
    return rope_cos_sin(positions, head_dim, base)


_TABLES: dict = {}     # (device, head_dim, base) -> (cos, sin) [L, head_dim // 2] for positions 0 .. L-1
_RETIRED: list = []    # outgrown tables, kept: a captured CUDA graph may still read them (sizes double: <= 2x)
MIN_TABLE = 4096


def shared_rope_table(T: int, head_dim: int, base: float, offset: int, device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_table(T, head_dim, base, offset) on a CUDA device as rows offset .. offset+T-1 of one table per
    (device, head_dim, base) grown by doubling: the layers of a model (each would rebuild the same tables,
    ~8 small kernels per layer and pass) share it. The same elementwise fp32 ops per position, so the same
    bits (a GPU's cos/sin do not depend on where an element sits; a CPU's vectorised loop and its scalar
    tail may differ, so CPU callers use rope_table). The tensors are made outside inference mode and
    autograd, read only; none is made for the cache inside a CUDA graph capture (its kernels have not run)."""
    key, end = (device, head_dim, float(base)), offset + T
    tab = _TABLES.get(key)
    if tab is None or tab[0].shape[0] < end:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return rope_table(T, head_dim, base, offset, device=device)
        with torch.inference_mode(False), torch.no_grad():
            new = rope_table(max(MIN_TABLE, 1 << (end - 1).bit_length()), head_dim, base, device=device)
        if tab is not None:
            _RETIRED.append(tab)
        _TABLES[key] = tab = new
    return tab[0][offset:end], tab[1][offset:end]


def apply_rope(x: torch.Tensor, offset: int = 0, base: float = 10000.0,
               positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate x [B, T, H, D] (D even) at absolute positions offset .. offset+T-1 (or `positions` [T]).

    Returns a tensor of x's dtype. The pairs rotated together are (x[..., i], x[..., i + D/2]).
    """
    if x.dim() != 4:
        raise ValueError(f"x: expected [B, T, H, D], got shape {tuple(x.shape)}")
    T, D = x.shape[1], x.shape[3]
    cos, sin = rope_table(T, D, base, offset, positions, x.device)  # [T, D/2] fp32
    cos = cos[None, :, None, :]  # [1, T, 1, D/2]
    sin = sin[None, :, None, :]
    xf = x.float()
    x1, x2 = xf[..., : D // 2], xf[..., D // 2:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Stateless module wrapper so the base shows up in `print(model)`."""

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"d_k={head_dim}: RoPE needs an even d_k")
        if base <= 0:
            raise ValueError(f"rope_base={base}: must be > 0")
        self.head_dim = head_dim
        self.base = float(base)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        return apply_rope(x, offset=offset, base=self.base)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}"
