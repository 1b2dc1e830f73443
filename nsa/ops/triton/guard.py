"""A choice between two kernels made on the device, per call, without a host sync.

Both kernels are launched; each program of the one not chosen reads the int32 flag and returns
before any load of its operands (a few microseconds for the whole grid), so the choice can depend on
values the host never sees (e.g. the union sizes of the selection tiles) and stays capturable in a
CUDA graph. A launcher takes `guard=(flag, GUARD_IF_SET | GUARD_IF_CLEAR)`; None launches unguarded.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

GUARD_IF_SET = 1     # the program runs iff flag != 0
GUARD_IF_CLEAR = 2   # the program runs iff flag == 0
Guard = tuple[torch.Tensor, int]


@triton.jit
def skip_program(FLAG, GUARD: tl.constexpr):
    """True when this program must return at once under guard mode GUARD (1 or 2) of flag FLAG [1]."""
    f = tl.load(FLAG)
    if GUARD == 1:
        skip = f == 0
    else:
        skip = f != 0
    return skip


def pair(flag: torch.Tensor) -> tuple[Guard, Guard]:
    """(guard of the kernel chosen when flag is set, guard of the one chosen when it is clear)."""
    return (flag, GUARD_IF_SET), (flag, GUARD_IF_CLEAR)
