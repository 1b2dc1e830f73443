#!/usr/bin/env python
"""Accuracy of the bf16 op on captured inputs against the same op in fp32, per loop order and pair dtype.

    python bench/accuracy_captured.py [--dir bench/captured] [--T 8192 65536]

For every captured layer at T: relative RMS of o and every gradient of the bf16 op against the fp32
per-token op (same kernels, tf32x3 products), for the per-token loop, the block-order loop with bf16
(q's dtype) pair partials, with fp32 ones, and with the device preset's; then the block-order variants
against the bf16 per-token op (what tests/test_triton_pairs.py bounds at 0.5%). Needs a GPU and
bench/capture_inputs.py's folder (bash bench/gpu.sh capture-model).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from nsa.ops.testing import rel_rms
from nsa.ops.triton.function import nsa_triton_apply
from nsa.ops.tuning import tuning_for

NAMES = ("o", "dq", "dk_cmp", "dv_cmp", "dk_slc", "dv_slc", "dk_win", "dv_win", "dgates")
INPUTS = ("q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates")


def run(xs, do, hp, tuning, dtype):
    x = [a.detach().to(dtype).clone().requires_grad_() for a in xs]
    o, bi = nsa_triton_apply(*x, **hp, tuning=tuning)
    return bi, [t.float() for t in (o, *torch.autograd.grad(o, x, do.to(dtype)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--dir", default="bench/captured")
    ap.add_argument("--T", type=int, nargs="+", default=[8192, 65536])
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/accuracy_captured.py needs a CUDA device")
    folder = Path(a.dir)
    meta = json.loads((folder / "meta.json").read_text())
    base = tuning_for("cuda")
    sel = base.select
    variants = {"token": dataclasses.replace(sel, loop="token"),
                "block-input": dataclasses.replace(sel, loop="block", pair_dtype="input", dq_pair_dtype="input"),
                "block-fp32": dataclasses.replace(sel, loop="block", pair_dtype="fp32", dq_pair_dtype="fp32"),
                "block-preset": dataclasses.replace(sel, loop="block")}
    for e in (e for e in meta["captures"] if e["T"] in a.T):
        s = torch.load(folder / e["file"], map_location="cuda", weights_only=True)
        xs = [s[n].contiguous() for n in INPUTS]
        hp = {k: e["op"][k] for k in ("l", "d", "l_sel", "n_sel", "w")} | dict(scale=xs[0].shape[-1] ** -0.5)
        do = torch.randn(xs[0].shape[:3] + (xs[6].shape[-1],), device="cuda", dtype=xs[0].dtype,
                         generator=torch.Generator("cuda").manual_seed(1))
        bi32, ref = run(xs, do, hp, dataclasses.replace(base, select=variants["token"]), torch.float32)
        res = {}
        for label, v in variants.items():
            bi, res[label] = run(xs, do, hp, dataclasses.replace(base, select=v), torch.bfloat16)
            same = (bi == bi32).all(-1).float().mean().item()   # sync-ok: report
            print(f"T={e['T']} L{e['layer']} {label:12s} vs fp32: bi rows equal {same:.5f} "
                  + " ".join(f"{n} {rel_rms(x, r):.2e}" for n, x, r in zip(NAMES, res[label], ref)), flush=True)
        for label in ("block-input", "block-fp32", "block-preset"):
            print(f"T={e['T']} L{e['layer']} {label} vs token: "
                  + " ".join(f"{n} {rel_rms(x, r):.2e}" for n, x, r in zip(NAMES, res[label], res["token"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
