"""Small host-side helpers shared by the Triton launchers (no triton import here)."""
from __future__ import annotations


def next_pow2(x: int) -> int:
    """Smallest power of two >= max(x, 1)."""
    return 1 << max(0, int(x) - 1).bit_length()


def row_block(gp: int, target: int) -> int:
    """Rows per program for a (tokens x heads) tile: a power of two >= 16 (tl.dot) and >= gp."""
    return max(16, target, gp)


def dot_precision(dtype, is_cuda: bool) -> str:
    """tl.dot input_precision: fp32 operands get ~fp32 accuracy on tensor cores (3 tf32 passes), so
    fp32 callers see fp32 results (and fp32 block selection); it is moot for bf16/fp16 operands."""
    if not is_cuda:
        return "ieee"
    return "tf32x3" if str(dtype) == "torch.float32" else "tf32"


def reg_cap(max_regs: int | None, is_cuda: bool) -> dict:
    """Launch options capping a kernel's registers per thread (ptxas .maxnreg): {} for no cap and off
    CUDA (the interpreter has no registers to cap)."""
    return {"maxnreg": max_regs} if max_regs is not None and is_cuda else {}
