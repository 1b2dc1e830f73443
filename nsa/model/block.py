"""LlamaBlockNSA: pre-RMSNorm transformer block with NSA attention and a SwiGLU MLP."""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from nsa.layers.attention import NSAAttention
from nsa.layers.cache import NSAKVCache, StaticNSACache
from nsa.layers.dense import DenseAttention


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 (bf16 sums of squares drift), result in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32:
            # the usual case under autocast (fp32 residual stream and weight): torch's fused kernel, one launch
            # forward instead of six elementwise passes over [B, T, dim] fp32, the same formula in fp32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def swiglu_hidden(dim: int, ffn_mult: float, multiple_of: int = 16) -> int:
    """Hidden width ffn_mult * dim rounded up to a multiple of `multiple_of` (GEMM friendly)."""
    h = int(ffn_mult * dim)
    return multiple_of * ((h + multiple_of - 1) // multiple_of)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up share one fused Linear."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.hidden, dim=-1)
        return self.down(F.silu(gate) * up)


class LlamaBlockNSA(nn.Module):
    """x + attn(norm(x)); then + mlp(norm(.)). x [B, T, dim] -> [B, T, dim]."""

    def __init__(self, dim: int = 512, n_heads: int = 8, n_kv_groups: int = 2, d_k: int = 64,
                 d_v: int = 64, l: int = 32, d: int = 16, l_sel: int = 64, n_sel: int = 4,
                 w: int = 128, ffn_mult: float = 8.0 / 3.0, backend: str = "auto",
                 compression: str = "mlp", rope_base: float = 10000.0,
                 norm_eps: float = 1e-6, attention: str = "nsa", allow_flash_attn: bool = True,
                 flash_branches: str = "preset", dense_backend: str = "auto") -> None:
        super().__init__()
        if ffn_mult <= 0:
            raise ValueError(f"ffn_mult={ffn_mult}: must be > 0")
        self.attn_norm = RMSNorm(dim, norm_eps)
        if attention == "dense":  # the dense twin (nsa/layers/dense.py): same block, full attention
            self.attn = DenseAttention(dim, n_heads, n_kv_groups, d_k, d_v, rope_base=rope_base,
                                       backend=dense_backend, allow_flash=allow_flash_attn)
        else:
            self.attn = NSAAttention(dim, n_heads, n_kv_groups, d_k, d_v, l, d, l_sel, n_sel, w,
                                     compression=compression, rope_base=rope_base, backend=backend,
                                     allow_flash=allow_flash_attn, flash_branches=flash_branches)
        self.mlp_norm = RMSNorm(dim, norm_eps)
        self.mlp = SwiGLU(dim, swiglu_hidden(dim, ffn_mult))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))

    def prefill(self, x: torch.Tensor, cache: NSAKVCache) -> torch.Tensor:
        """Same as forward, and fills this block's attention cache."""
        x = x + self.attn.prefill(self.attn_norm(x), cache)
        return x + self.mlp(self.mlp_norm(x))

    def decode(self, x: torch.Tensor, cache: NSAKVCache) -> torch.Tensor:
        """New tokens x [B, Tq, dim] following the cached ones."""
        x = x + self.attn.decode(self.attn_norm(x), cache)
        return x + self.mlp(self.mlp_norm(x))

    def decode_static(self, x: torch.Tensor, cache: StaticNSACache, pos: torch.Tensor) -> torch.Tensor:
        """One new token x [B, 1, dim] at device position pos ([1] int64) over a StaticNSACache:
        the CUDA-graph-capturable form of decode (no host int changes per token)."""
        x = x + self.attn.decode_static(self.attn_norm(x), cache, pos)
        return x + self.mlp(self.mlp_norm(x))
