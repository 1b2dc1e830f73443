"""Small host-side helpers shared by the Triton launchers (no triton import here)."""
from __future__ import annotations


def next_pow2(x: int) -> int:
    """Smallest power of two >= max(x, 1)."""
    return 1 << max(0, int(x) - 1).bit_length()


def row_block(gp: int, target: int) -> int:
    """Rows per program for a (tokens x heads) tile: a power of two >= 16 (tl.dot) and >= gp."""
    return max(16, target, gp)
