"""Driver for Nsight Compute on the decode kernels: one batch size and context, a few decode calls.

    ncu --kernel-name regex:_cmp_kernel --launch-skip 2 --launch-count 1 --section WarpStateStats \
        python bench/ncu_decode.py --B 16 --S 65536

Runs `--calls` decode steps (device positions, the current TUNE) and nothing else, so the profiled
launches are the decode kernels only.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_decode import HP, make_cache  # noqa: E402
from nsa.ops.triton import decode as tdec  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--S", type=int, default=65536)
    ap.add_argument("--calls", type=int, default=4)
    a = ap.parse_args()
    torch.manual_seed(0)
    c = make_cache(a.B, a.S, 64, 4, 128, 128)
    args = [c[n] for n in ("q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates")]
    pos = torch.full((1,), a.S - 1, dtype=torch.int64, device="cuda")
    win = torch.full((1,), c["win_pos0"], dtype=torch.int64, device="cuda")
    for _ in range(a.calls):
        tdec.nsa_decode_triton(*args, pos0=pos, win_pos0=win, scale=128 ** -0.5, **HP,
                               tune=tdec.tune_for(a.B * 4, dict(pdl=False)))
    torch.cuda.synchronize()
    for name, k in tdec.LAST_LAUNCH.items():
        print(name, "regs", getattr(k, "n_regs", None), "spills", getattr(k, "n_spills", None),
              "shared", getattr(k.metadata, "shared", None))


if __name__ == "__main__":
    main()
