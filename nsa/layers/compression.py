"""phi: the compression function of the compressed branch (NSA paper, eq. 7).

Block i covers raw tokens [i*d, i*d + l). For T raw tokens there are N = floor((T - l) / d) + 1
blocks (0 when T < l). All blocks are cut in one strided view (Tensor.unfold), never a Python loop.

kinds:
- "mlp" (default, the paper's): a learnable intra-block position embedding is added to the block's
  l tokens, the block is flattened (l * D) and mapped l*D -> hidden -> D by an MLP. We add the block
  mean as a residual and start the MLP's output layer small, so at init k~_i is close to the block
  mean (a sane summary) and training learns the correction.
- "linear": one linear map l*D -> D over the flattened (position-embedded) block, initialised to the
  exact block mean.
- "mean": average pooling, no parameters (ablation).
One module compresses one stream (keys or values); the layer owns separate phi_K and phi_V.
Weights are shared across heads (the MLP acts per head on that head's D features).
"""
from __future__ import annotations

import math

import torch
from torch import nn
import torch.nn.functional as F

COMPRESSION_KINDS = ("mlp", "linear", "mean")


def num_compressed(T: int, l: int, d: int) -> int:
    """Number of complete compression blocks among T raw tokens."""
    return (T - l) // d + 1 if T >= l else 0


def unfold_blocks(x: torch.Tensor, l: int, d: int) -> torch.Tensor:
    """x [B, T, H, D] -> blocks [B, N, H, l, D] (a strided view; no copy)."""
    B, T, H, D = x.shape
    n = num_compressed(T, l, d)
    if n == 0:
        return x.new_zeros(B, 0, H, l, D)
    # unfold puts the window last: [B, N, H, D, l]
    return x.unfold(1, l, d).transpose(-1, -2)


class _AddPos(torch.autograd.Function):
    """blocks [B, N, H, l, D] (unfold_blocks' strided view) + pos [l, D] written into a contiguous tensor, so
    that flattening each block to l*D is a view. `blocks + pos` would come out in blocks' memory order
    (B, N, l, H, D) and the flatten would copy it. Backward is autograd's for that add: the gradient
    itself for blocks, its sum over the broadcast dims (sum_to_size, the same reduction) for pos."""

    @staticmethod
    def forward(ctx, blocks, pos):
        ctx.pos_shape = pos.shape
        return torch.add(blocks, pos, out=blocks.new_empty(blocks.shape))

    @staticmethod
    def backward(ctx, grad):
        return grad, (grad.sum_to_size(ctx.pos_shape) if ctx.needs_input_grad[1] else None)


def add_pos(blocks: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """blocks + pos as a contiguous [B, N, H, l, D] tensor (_AddPos); under torch.compile the plain add,
    whose layout the compiler chooses itself."""
    if torch.compiler.is_compiling():
        return blocks + pos
    return _AddPos.apply(blocks, pos)


class BlockCompressor(nn.Module):
    """phi for one stream: x [B, T, H, D] -> compressed [B, N, H, D]."""

    def __init__(self, head_dim: int, l: int, d: int, kind: str = "mlp",
                 hidden: int | None = None) -> None:
        super().__init__()
        if kind not in COMPRESSION_KINDS:
            raise ValueError(f"compression={kind!r}: choose one of {COMPRESSION_KINDS}")
        if l <= 0 or d <= 0 or l < d:
            raise ValueError(f"l={l}, d={d}: need positive l and d with l >= d")
        self.head_dim, self.l, self.d, self.kind = head_dim, l, d, kind
        self.hidden = hidden if hidden is not None else 2 * head_dim
        flat = l * head_dim
        if kind == "mlp":
            self.pos_emb = nn.Parameter(torch.zeros(l, head_dim))  # [l, D]
            self.fc1 = nn.Linear(flat, self.hidden)
            self.fc2 = nn.Linear(self.hidden, head_dim)
        elif kind == "linear":
            self.pos_emb = nn.Parameter(torch.zeros(l, head_dim))
            self.proj = nn.Linear(flat, head_dim)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.kind == "mlp":
            nn.init.normal_(self.pos_emb, std=0.02)
            nn.init.normal_(self.fc1.weight, std=1.0 / math.sqrt(self.fc1.in_features))
            nn.init.zeros_(self.fc1.bias)
            # small, not zero: the first layer gets gradient from step 0
            nn.init.normal_(self.fc2.weight, std=0.02 / math.sqrt(self.hidden))
            nn.init.zeros_(self.fc2.bias)
        elif self.kind == "linear":
            nn.init.zeros_(self.pos_emb)
            # W[:, p*D + c] = 1/l if c == row: exact block mean at init
            eye = torch.eye(self.head_dim, device=self.proj.weight.device)
            self.proj.weight.copy_(eye.repeat(1, self.l) / self.l)
            nn.init.zeros_(self.proj.bias)

    def compress_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """blocks [B, N, H, l, D] -> [B, N, H, D]."""
        B, N, H, l, D = blocks.shape
        if self.kind == "mean":
            return blocks.mean(dim=3)
        flat = add_pos(blocks, self.pos_emb.to(blocks.dtype)).reshape(B, N, H, l * D)   # a view
        if self.kind == "linear":
            return self.proj(flat)
        return blocks.mean(dim=3) + self.fc2(F.silu(self.fc1(flat)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, H, D] raw (RoPE applied) -> [B, N, H, D]; N = 0 when T < l."""
        if x.dim() != 4 or x.shape[-1] != self.head_dim:
            raise ValueError(f"x: expected [B, T, H, {self.head_dim}], got {tuple(x.shape)}")
        B, T, H, D = x.shape
        if T < self.l:
            return x.new_zeros(B, 0, H, D)
        return self.compress_blocks(unfold_blocks(x, self.l, self.d))

    def compress_block(self, raw: torch.Tensor) -> torch.Tensor:
        """One newly completed block for decode: raw [B, l, H, D] -> [B, 1, H, D]."""
        if raw.shape[1] != self.l:
            raise ValueError(f"raw: expected exactly l={self.l} tokens, got {raw.shape[1]}")
        return self.compress_blocks(raw.transpose(1, 2).unsqueeze(1))

    def extra_repr(self) -> str:
        return f"kind={self.kind}, head_dim={self.head_dim}, l={self.l}, d={self.d}, hidden={self.hidden}"
