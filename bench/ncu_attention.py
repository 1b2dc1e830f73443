"""Driver for Nsight Compute on the prefill kernels: one forward+backward of the Triton NSA op.

    ncu --kernel-name regex:_slc_fwd_kernel --launch-count 1 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis python bench/ncu_attention.py --T 65536

Paper sizes (l=32, d=16, l_sel=64, n_sel=16, w=512), B=1, HQ=64, H=4, d=128, bf16; --calls runs (the
first compiles, so profile with --launch-skip or a later call).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_attention import HP, nsa_inputs  # noqa: E402
from nsa.ops import nsa_attention  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=65536)
    ap.add_argument("--calls", type=int, default=2)
    a = ap.parse_args()
    torch.manual_seed(0)
    x = nsa_inputs(1, a.T, 64, 4, 128, 128)
    do = torch.randn(1, a.T, 64, 128, device="cuda", dtype=torch.bfloat16)
    for _ in range(a.calls):
        o, _ = nsa_attention(*x, **HP, backend="triton")
        torch.autograd.grad(o, x, do)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
