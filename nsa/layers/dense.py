"""DenseAttention: the NSA layer's dense twin (causal full attention), for A/B against NSA.

Same interface as NSAAttention where it applies (x [B, T, dim] -> [B, T, dim]; prefill/decode with
a cache; reset_parameters(init_std, out_std)) and the same projection shapes where they apply:

  q, k, v = W_QKV x                  [B, T, HQ, d_k], [B, T, H, d_k], [B, T, H, d_v]  (one K/V pair,
                                     not NSA's three; rows of the fused Linear: [q | k | v])
  RoPE on q and k at absolute positions
  o = dense_attention(q, k, v)       [B, T, HQ, d_v], causal, GQA by head counts
  y = W_O concat_heads(o)            [B, T, dim]

The kernel is chosen once per (device, dtype) by nsa.ops.flash.choose_dense_backend (FA4, FA2,
cuDNN, ... on CUDA; torch SDPA on CPU) and honours allow_flash (nsa.allow_flash_attn).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from nsa.layers.rope import apply_rope
from nsa.ops.flash import BACKENDS, FLASH_BACKENDS, choose_dense_backend, dense_attention


class DenseKVCache:
    """Keys (RoPE'd) and values of the tokens seen so far: k [B, cap, H, d_k], v [B, cap, H, d_v].
    Storage grows by doubling, so appends are amortised O(new tokens); `length` is a host int."""

    def __init__(self, capacity: int = 256) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity}: must be >= 1")
        self.capacity = int(capacity)
        self.length = 0
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add k/v [B, Tn, H, *] after the cached tokens; returns views of all tokens [B, length, H, *]."""
        B, Tn = k.shape[:2]
        if self.k is None:
            cap = max(self.capacity, Tn)
            self.k = k.new_empty(B, cap, *k.shape[2:])
            self.v = v.new_empty(B, cap, *v.shape[2:])
        elif self.k.shape[0] != B:
            raise ValueError(f"cache holds batch {self.k.shape[0]}, got new tokens of batch {B}")
        need = self.length + Tn
        if need > self.k.shape[1]:
            cap = max(need, 2 * self.k.shape[1])
            for name in ("k", "v"):
                old = getattr(self, name)
                new = old.new_empty(B, cap, *old.shape[2:])
                new[:, :self.length] = old[:, :self.length]
                setattr(self, name, new)
        self.k[:, self.length:need] = k.to(self.k.dtype)
        self.v[:, self.length:need] = v.to(self.v.dtype)
        self.length = need
        return self.k[:, :need], self.v[:, :need]


class DenseAttention(nn.Module):
    """Causal full attention with RoPE and GQA: x [B, T, dim] -> [B, T, dim].

    `backend`: "auto" (choose_dense_backend per device/dtype, once) or one of nsa.ops.flash.BACKENDS.
    `record_stats`, `last_gates`, `last_block_idx` exist for the NSA telemetry and stay None."""

    def __init__(self, dim: int, n_heads: int, n_kv_groups: int, d_k: int, d_v: int,
                 rope_base: float = 10000.0, backend: str = "auto", allow_flash: bool = True) -> None:
        super().__init__()
        for name, val in (("dim", dim), ("n_heads", n_heads), ("n_kv_groups", n_kv_groups),
                          ("d_k", d_k), ("d_v", d_v)):
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"{name}={val!r}: must be a positive integer")
        if n_heads % n_kv_groups != 0:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_groups={n_kv_groups}")
        if d_k % 2 != 0:
            raise ValueError(f"d_k={d_k}: must be even (RoPE rotates pairs of features)")
        if rope_base <= 0:
            raise ValueError(f"rope_base={rope_base}: must be > 0")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: dense attention backends are {list(BACKENDS)}")
        if backend in FLASH_BACKENDS and not allow_flash:   # an explicit kernel would silently override the switch
            raise ValueError(f"backend={backend!r} (model.dense_backend) is flash-attn, which allow_flash=False "
                             "(nsa.allow_flash_attn=false) turns off: choose another backend or allow flash-attn")
        self.dim, self.n_heads, self.n_kv_groups, self.d_k, self.d_v = dim, n_heads, n_kv_groups, d_k, d_v
        self.rope_base, self.backend, self.allow_flash = float(rope_base), backend, bool(allow_flash)
        self._split = (n_heads * d_k, n_kv_groups * d_k, n_kv_groups * d_v)
        self.qkv_proj = nn.Linear(dim, sum(self._split), bias=False)
        self.o_proj = nn.Linear(n_heads * d_v, dim, bias=False)
        self.record_stats = False
        self.last_gates: torch.Tensor | None = None
        self.last_block_idx: torch.Tensor | None = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, init_std: float = 0.02, out_std: float | None = None) -> None:
        nn.init.normal_(self.qkv_proj.weight, std=init_std)
        nn.init.normal_(self.o_proj.weight, std=out_std if out_std is not None else init_std)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, n_heads={self.n_heads}, n_kv_groups={self.n_kv_groups}, d_k={self.d_k}, "
                f"d_v={self.d_v}, rope_base={self.rope_base}, backend={self.backend!r}, "
                f"allow_flash={self.allow_flash}")

    def kernel(self, q: torch.Tensor) -> str:
        """The dense backend for q's device/dtype (resolved once per key by choose_dense_backend)."""
        if self.backend != "auto":
            return self.backend
        return choose_dense_backend(q.device, q.dtype, self.d_k, self.allow_flash)[0]

    def project(self, x: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, dim] -> q [B, T, HQ, d_k], k [B, T, H, d_k] (both RoPE'd from `offset`), v [B, T, H, d_v]."""
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x: expected [B, T, {self.dim}], got {tuple(x.shape)}")
        B, T, _ = x.shape
        qp, kp, vp = self.qkv_proj(x).split(self._split, dim=-1)
        q = apply_rope(qp.view(B, T, self.n_heads, self.d_k), offset=offset, base=self.rope_base)
        k = apply_rope(kp.view(B, T, self.n_kv_groups, self.d_k), offset=offset, base=self.rope_base)
        return q, k, vp.view(B, T, self.n_kv_groups, self.d_v)

    def _out(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # "auto" resolves inside dense_attention, which also falls back if flash-attn refuses a shape
        o = dense_attention(q, k, v, causal=True, scale=1.0 / math.sqrt(self.d_k), backend=self.backend,
                            allow_flash=self.allow_flash)
        B, T = o.shape[:2]
        return self.o_proj(o.reshape(B, T, self.n_heads * self.d_v))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x)
        return self._out(q, k, v)

    # -------------------------------------------------------------- cached paths
    def new_cache(self, capacity: int = 256) -> DenseKVCache:
        return DenseKVCache(capacity)

    def prefill(self, x: torch.Tensor, cache: DenseKVCache) -> torch.Tensor:
        """Forward over x [B, T, dim] that also stores its keys/values in `cache`."""
        return self.decode(x, cache)

    def decode(self, x: torch.Tensor, cache: DenseKVCache) -> torch.Tensor:
        """New tokens x [B, Tq, dim] at positions cache.length .. +Tq-1 -> y [B, Tq, dim]; each attends
        to every cached token and to the new ones up to itself (bottom-right causal)."""
        q, k, v = self.project(x, offset=cache.length)
        k_all, v_all = cache.append(k, v)
        return self._out(q, k_all, v_all)
