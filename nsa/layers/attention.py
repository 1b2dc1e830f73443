"""NSAAttention: projections, RoPE, compression, gates and output projection around nsa.ops.

Data flow for x [B, T, dim] (docs/nsa.md):
  q = W_Q x                          [B, T, HQ, d_k]
  k_c, v_c = W_K^c x, W_V^c x        [B, T, H, d_k|d_v] for c in (cmp, slc, win)
  RoPE on q and on k_cmp/k_slc/k_win at absolute positions (before compression)
  k~, v~ = phi_K(k_cmp), phi_V(v_cmp)  [B, N, H, *]
  g = sigmoid(MLP(x))                [B, T, HQ, 3]  (cmp, slc, win)
  o = nsa_attention(...)             [B, T, HQ, d_v]
  y = W_O concat_heads(o)            [B, T, dim]
The per-branch projections are separate weights stored in one fused Linear (one GEMM instead of
seven); the row blocks are [q | k_cmp k_slc k_win | v_cmp v_slc v_win].
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
from torch import nn

import nsa.ops as nsa_ops
from nsa.layers.cache import NSAKVCache, StaticNSACache
from nsa.layers.compression import COMPRESSION_KINDS, BlockCompressor
from nsa.config.env import triton_interpreter
from nsa.layers.rope import apply_rope, rope_table, shared_rope_table
from nsa.ops.common import check_block_geometry
from nsa.ops.tuning import FlashBranchTuning

BRANCHES = ("cmp", "slc", "win")
_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def _triton_runs() -> bool:
    """Triton kernels run natively here (CUDA and triton importable); asked once per process."""
    from nsa.ops.triton import triton_available
    return triton_available()


def _attend(*args, **kwargs):
    """The layer's op call (a seam for profilers, nsa/telemetry/step_split.py). Under torch.compile
    nsa_attention traces as the custom op nsa::attention (nsa/ops/custom_op.py): no graph break."""
    return nsa_ops.nsa_attention(*args, **kwargs)


def validate_nsa_args(dim: int, n_heads: int, n_kv_groups: int, d_k: int, d_v: int, l: int,
                      d: int, l_sel: int, n_sel: int, w: int, compression: str = "mlp") -> None:
    """Raise ValueError naming the offending field (spec: 'Shapes and names', 'Validation')."""
    for name, val in (("dim", dim), ("n_heads", n_heads), ("n_kv_groups", n_kv_groups),
                      ("d_k", d_k), ("d_v", d_v), ("l", l), ("d", d), ("l_sel", l_sel),
                      ("n_sel", n_sel), ("w", w)):
        if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
            raise ValueError(f"{name}={val!r}: must be a positive integer")
    if n_heads % n_kv_groups != 0:
        raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_groups={n_kv_groups} "
                         f"(each KV head serves n_heads/n_kv_groups query heads)")
    if d_k % 2 != 0:
        raise ValueError(f"d_k={d_k}: must be even (RoPE rotates pairs of features)")
    check_block_geometry(l, d, l_sel)
    if compression not in COMPRESSION_KINDS:
        raise ValueError(f"compression={compression!r}: choose one of {COMPRESSION_KINDS}")


class Projected(NamedTuple):
    """Per-token tensors of one forward/decode call (keys already RoPE'd)."""
    q: torch.Tensor      # [B, T, HQ, d_k]
    k_cmp: torch.Tensor  # [B, T, H, d_k] raw, before compression
    v_cmp: torch.Tensor  # [B, T, H, d_v]
    k_slc: torch.Tensor
    v_slc: torch.Tensor
    k_win: torch.Tensor
    v_win: torch.Tensor


class NSAAttention(nn.Module):
    """Native Sparse Attention layer (x [B, T, dim] -> [B, T, dim]), causal.

    Attributes: `record_stats` (bool): when True each forward stores detached `last_gates`
    [B, T, HQ, 3] and `last_block_idx` [B, T, H, n_sel] (no host sync). `op_capture` (callable or
    None): when set, each full forward calls op_capture(layer, inputs, o, block_idx) with the op's
    eight inputs (q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates) as passed to it and its outputs
    (bench/capture_inputs.py saves them as benchmark inputs). `project_kernel` ("auto", "triton" or
    "torch"): how project applies RoPE and the branch-major layout; "auto" runs the fused Triton kernel
    (nsa/ops/triton/rope_layout.py, apply_rope's numbers) on CUDA outside torch.compile, else torch;
    "triton" forces the kernel (on CPU only under TRITON_INTERPRET=1, the tests).
    """

    def __init__(self, dim: int, n_heads: int, n_kv_groups: int, d_k: int, d_v: int, l: int,
                 d: int, l_sel: int, n_sel: int, w: int, compression: str = "mlp",
                 rope_base: float = 10000.0, backend: str = "auto",
                 gate_hidden: int | None = None, compression_hidden: int | None = None,
                 allow_flash: bool = True, flash_branches: str = "preset") -> None:
        super().__init__()
        validate_nsa_args(dim, n_heads, n_kv_groups, d_k, d_v, l, d, l_sel, n_sel, w, compression)
        if rope_base <= 0:
            raise ValueError(f"rope_base={rope_base}: must be > 0")
        self.dim, self.n_heads, self.n_kv_groups = dim, n_heads, n_kv_groups
        self.d_k, self.d_v = d_k, d_v
        self.l, self.d, self.l_sel, self.n_sel, self.w = l, d, l_sel, n_sel, w
        self.rope_base, self.backend, self.compression = float(rope_base), backend, compression
        self.allow_flash = bool(allow_flash)   # false: no branch on flash-attn (nsa.allow_flash_attn)
        FlashBranchTuning.parse(flash_branches)   # fail at build, not at the first step
        self.flash_branches = flash_branches     # which branches may run on flash-attn (nsa.flash_branches)
        HQ, H = n_heads, n_kv_groups
        self._split = (HQ * d_k, 3 * H * d_k, 3 * H * d_v)
        self.qkv_proj = nn.Linear(dim, sum(self._split), bias=False)
        self.phi_k = BlockCompressor(d_k, l, d, compression, compression_hidden)
        self.phi_v = BlockCompressor(d_v, l, d, compression, compression_hidden)
        gh = gate_hidden if gate_hidden is not None else max(16, dim // 4)
        self.gate_mlp = nn.Sequential(nn.Linear(dim, gh), nn.SiLU(), nn.Linear(gh, 3 * HQ))
        self.o_proj = nn.Linear(HQ * d_v, dim, bias=False)
        self.record_stats = False
        self.last_gates: torch.Tensor | None = None
        self.last_block_idx: torch.Tensor | None = None
        self.op_capture = None
        self.project_kernel = "auto"
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, init_std: float = 0.02, out_std: float | None = None) -> None:
        nn.init.normal_(self.qkv_proj.weight, std=init_std)
        nn.init.normal_(self.o_proj.weight, std=out_std if out_std is not None else init_std)
        g1, g2 = self.gate_mlp[0], self.gate_mlp[2]
        nn.init.normal_(g1.weight, std=1.0 / math.sqrt(self.dim))
        nn.init.zeros_(g1.bias)
        # small output weights, zero bias: every gate starts near sigmoid(0) = 0.5
        nn.init.normal_(g2.weight, std=0.02 / math.sqrt(g1.out_features))
        nn.init.zeros_(g2.bias)
        self.phi_k.reset_parameters()
        self.phi_v.reset_parameters()

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, n_heads={self.n_heads}, n_kv_groups={self.n_kv_groups}, "
                f"d_k={self.d_k}, d_v={self.d_v}, l={self.l}, d={self.d}, l_sel={self.l_sel}, "
                f"n_sel={self.n_sel}, w={self.w}, rope_base={self.rope_base}, "
                f"backend={self.backend!r}")

    # ------------------------------------------------------------ building blocks
    def project(self, x: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None) -> Projected:
        """x [B, T, dim] -> q and per-branch raw k/v, RoPE'd at positions offset..offset+T-1 (or at
        `positions` [T], a device tensor, so nothing on the host depends on the position)."""
        B, T, _ = x.shape
        HQ, H, dk, dv = self.n_heads, self.n_kv_groups, self.d_k, self.d_v
        y = self.qkv_proj(x)
        # Branch-major layout [3, B, T, H, *] so that every branch's k/v handed to the op is a
        # contiguous [B, T, H, *] tensor: kernels index them with their own strides only.
        if self._fused_project(y):   # one kernel: RoPE and both layouts (nsa/ops/triton/rope_layout.py)
            from nsa.ops.triton.rope_layout import rope_layout
            q, k_cmp, k_slc, k_win, v_cmp, v_slc, v_win = rope_layout(
                y, *self._rope_rows(T, offset, positions, y.device), HQ, H, dk, dv)
            return Projected(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win)
        rope = dict(offset=offset, base=self.rope_base, positions=positions)
        q_part, k_part, v_part = y.split(self._split, dim=-1)
        q = apply_rope(q_part.view(B, T, HQ, dk), **rope)
        k = k_part.view(B, T, 3, H, dk).permute(2, 0, 1, 3, 4).reshape(3 * B, T, H, dk)
        k = apply_rope(k, **rope).view(3, B, T, H, dk)
        v = v_part.view(B, T, 3, H, dv).permute(2, 0, 1, 3, 4).contiguous()
        k_cmp, k_slc, k_win = k.unbind(0)
        v_cmp, v_slc, v_win = v.unbind(0)
        return Projected(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win)

    def _rope_rows(self, T: int, offset: int, positions: torch.Tensor | None, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, d_k/2] fp32 of the fused project: on CUDA at offset.. rows of the table all layers
        share (the per-call table's bits), else rope_table's."""
        if positions is not None and tuple(positions.shape) != (T,):
            raise ValueError(f"positions: expected [{T}] (one per token), got {tuple(positions.shape)}")
        if positions is None and device.type == "cuda":
            return shared_rope_table(T, self.d_k, self.rope_base, offset, device)
        return rope_table(T, self.d_k, self.rope_base, offset, positions, device)

    def _fused_project(self, y: torch.Tensor) -> bool:
        """Whether project runs the fused RoPE/layout kernel on the qkv GEMM output y (project_kernel)."""
        mode = self.project_kernel
        if mode == "torch":
            return False
        if mode == "triton":
            if not (y.is_cuda or triton_interpreter()):
                raise ValueError("project_kernel='triton' needs a CUDA tensor or TRITON_INTERPRET=1 (CPU tests); "
                                 "set project_kernel='auto' or 'torch'")
            return True
        if mode != "auto":
            raise ValueError(f"project_kernel={mode!r}: choose 'auto', 'triton' or 'torch'")
        # torch.compile fuses the torch path itself; fp64 stays on it (the kernel is fp16/bf16/fp32)
        return (y.is_cuda and y.dtype in _FUSED_DTYPES and not torch.compiler.is_compiling()
                and _triton_runs())

    def compute_gates(self, x: torch.Tensor) -> torch.Tensor:
        """g = sigmoid(MLP(x)): [B, T, dim] -> [B, T, HQ, 3] ordered (cmp, slc, win)."""
        B, T, _ = x.shape
        return torch.sigmoid(self.gate_mlp(x)).view(B, T, self.n_heads, 3)

    def _op_kwargs(self, decode: bool = False) -> dict:
        kw = dict(l=self.l, d=self.d, l_sel=self.l_sel, n_sel=self.n_sel, w=self.w, backend=self.backend)
        if not decode:   # decode runs the own kernels only (no flash-attn branch)
            kw.update(allow_flash=self.allow_flash, flash_branches=self.flash_branches)
        return kw

    def _output(self, o: torch.Tensor, gates: torch.Tensor, block_idx: torch.Tensor) -> torch.Tensor:
        """o [B, T, HQ, d_v] -> y [B, T, dim]; records stats when asked (detached, on device)."""
        if self.record_stats:
            self.last_gates = gates.detach()
            self.last_block_idx = block_idx.detach()
        B, T = o.shape[:2]
        return self.o_proj(o.reshape(B, T, self.n_heads * self.d_v))

    def _branch_outputs(self, p: Projected, k_cmp: torch.Tensor, v_cmp: torch.Tensor,
                        gates: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each branch's output alone: the op called with one-hot gates (diagnostics only)."""
        out = {}
        eye = torch.eye(3, device=gates.device, dtype=gates.dtype)
        for i, name in enumerate(BRANCHES):
            one_hot = eye[i].expand(gates.shape).contiguous()
            out[f"o_{name}"], _ = nsa_ops.nsa_attention(
                p.q, k_cmp, v_cmp, p.k_slc, p.v_slc, p.k_win, p.v_win, one_hot, **self._op_kwargs())
        return out

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, return_branches: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """x [B, T, dim] -> y [B, T, dim]; with return_branches also info = {o_cmp, o_slc, o_win
        [B, T, HQ, d_v], gates [B, T, HQ, 3], block_idx [B, T, H, n_sel]}."""
        y, info = self._full(x, cache=None, return_branches=return_branches)
        return (y, info) if return_branches else y

    def _full(self, x: torch.Tensor, cache: NSAKVCache | None, return_branches: bool = False
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x: expected [B, T, {self.dim}], got {tuple(x.shape)}")
        p = self.project(x)
        k_cmp, v_cmp = self.phi_k(p.k_cmp), self.phi_v(p.v_cmp)  # [B, N, H, *]
        gates = self.compute_gates(x)
        o, block_idx = _attend(p.q, k_cmp, v_cmp, p.k_slc, p.v_slc, p.k_win, p.v_win, gates,
                               **self._op_kwargs())
        if self.op_capture is not None:
            self.op_capture(self, (p.q, k_cmp, v_cmp, p.k_slc, p.v_slc, p.k_win, p.v_win, gates), o, block_idx)
        if cache is not None:
            cache.prefill(p.k_cmp, p.v_cmp, p.k_slc, p.v_slc, p.k_win, p.v_win, k_cmp, v_cmp)
        info: dict[str, torch.Tensor] = {}
        if return_branches:
            info = self._branch_outputs(p, k_cmp, v_cmp, gates)
            info.update(gates=gates, block_idx=block_idx)
        return self._output(o, gates, block_idx), info

    # -------------------------------------------------------------- cached paths
    def new_cache(self, capacity: int = 256) -> NSAKVCache:
        return NSAKVCache(self.l, self.d, self.w, capacity=capacity)

    def prefill(self, x: torch.Tensor, cache: NSAKVCache) -> torch.Tensor:
        """Batched forward over x [B, T, dim] that also fills `cache` (empty) for decoding.
        A cache that already holds tokens is extended chunk-wise through `decode`."""
        if cache.length != 0:
            return self.decode(x, cache)
        return self._full(x, cache=cache)[0]

    def decode(self, x: torch.Tensor, cache: NSAKVCache) -> torch.Tensor:
        """New tokens x [B, Tq, dim] at positions cache.length .. +Tq-1 -> y [B, Tq, dim].
        Appends them to the cache (emitting completed compressed tokens) and attends through
        nsa.ops.nsa_decode: cost per step ~ N_S + n_sel*l_sel + w, not S."""
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x: expected [B, Tq, {self.dim}], got {tuple(x.shape)}")
        pos0 = cache.length
        p = self.project(x, offset=pos0)
        gates = self.compute_gates(x)
        cache.append(p.k_cmp, p.v_cmp, p.k_slc, p.v_slc, p.k_win, p.v_win,
                     self.phi_k.compress_blocks, self.phi_v.compress_blocks)
        kv = cache.views()
        o, block_idx = nsa_ops.nsa_decode(p.q, kv["k_cmp"], kv["v_cmp"], kv["k_slc"], kv["v_slc"],
                                          kv["k_win"], kv["v_win"], gates, pos0=pos0,
                                          win_pos0=cache.win_pos0, **self._op_kwargs(decode=True))
        return self._output(o, gates, block_idx)

    def new_static_cache(self, capacity: int) -> StaticNSACache:
        return StaticNSACache(self.l, self.d, self.w, capacity)

    def decode_static(self, x: torch.Tensor, cache: StaticNSACache, pos: torch.Tensor) -> torch.Tensor:
        """One token per sequence x [B, 1, dim] at device position pos ([1] int64) -> y [B, 1, dim];
        graph-capturable (no host sync, no host int per token). Appends to `cache` with device-side
        writes and attends through nsa.ops.nsa_decode with the device position and the ring window
        buffer, under KernelPolicy.for_device_positions (the triton decode kernel: natively on CUDA,
        through the interpreter in CPU tests)."""
        if x.dim() != 3 or x.shape[1] != 1 or x.shape[-1] != self.dim:
            raise ValueError(f"x: expected [B, 1, {self.dim}], got {tuple(x.shape)}")
        p = self.project(x, positions=pos + torch.arange(1, device=x.device))
        gates = self.compute_gates(x)
        cache.append(pos, p.k_cmp, p.v_cmp, p.k_slc, p.v_slc, p.k_win, p.v_win,
                     self.phi_k.compress_block, self.phi_v.compress_block)
        policy = nsa_ops.KernelPolicy.for_device_positions(x.device, p.q.dtype)
        o, block_idx = nsa_ops.nsa_decode(p.q, cache.k_cmp, cache.v_cmp, cache.k_slc, cache.v_slc,
                                          cache.k_win, cache.v_win, gates, pos0=pos, win_pos0=None,
                                          win_ring=cache.w, l=self.l, d=self.d, l_sel=self.l_sel,
                                          n_sel=self.n_sel, w=self.w, scale=self.d_k ** -0.5,
                                          backend=policy)
        return self._output(o, gates, block_idx)
