#!/usr/bin/env python
"""Registers, spills and shared memory of the selection walks' kernels, compiled for a GPU that is not
here (default sm_90), without running them.

    pip install --target /tmp/t36 --no-deps triton==3.6.0      # the device's Triton
    PYTHONPATH=/tmp/t36:$PWD python bench/bench_regs.py [--T 16384] [--tuning select.block_dkdv_rows=64 ...]

The launchers run on CPU tensors of the production shape (HQ=12, H=2, d=64 unless told) with a stand-in
driver that reports the target GPU: every launch compiles and returns instead of running (JITFunction.run's
warm-up path), and ptxas -v reports each kernel. --tuning changes the Hopper preset; --dump writes each
kernel's TTGIR and PTX (a name compiled twice: <name>.2.*); --sass also disassembles each kernel (nvdisasm,
shipped with Triton) and prints the instruction mix of its loop bodies per thread and iteration. The launchers see CUDA tensors (Tensor.is_cuda
answers True while they compile), so precision choices and register caps are the GPU's. Nsight Compute showed
the 128-row dK/dV walk spilling at 255 registers; this answers such questions in seconds instead of device time
(bench/RESULTS.md, Tried: the walks without spills). The loop mix found the scores kernel ranking 8 copies of each
block score (Tried: the scores relaid out before ranking).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch

import common


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dump", default=None, metavar="DIR", help="also write each kernel's TTGIR and PTX there")
    ap.add_argument("--sass", action="store_true", help="also print each kernel's loop bodies' instruction mix")
    ap.add_argument("--top", type=int, default=14, help="opcodes listed per loop with --sass")
    ap.add_argument("--tuning", nargs="*", default=[], metavar="FIELD=VALUE", help="changes to the Hopper preset")
    for name, dflt in (("HQ", 12), ("H", 2), ("dk", 64), ("dv", 64)):
        ap.add_argument(f"--{name}", type=int, default=dflt)
    return ap.parse_args()


class _Driver:
    """What JITFunction.run asks the active driver for, answered for a GPU that is not here."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def is_active(self):
        return True


def compile_only(arch: int) -> list:
    """Makes every Triton launch compile and return (no run); returns the list the kernels go to."""
    import triton
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction
    driver.set_active(_Driver(arch))
    seen: list = []
    run = JITFunction.run

    def warm(self, *args, grid, warmup, **kwargs):
        k = run(self, *args, grid=grid, warmup=True, **kwargs)
        seen.append((self.__name__, kwargs.get("num_warps"), kwargs.get("num_stages"), k))
        return k

    JITFunction.run = warm
    assert triton is not None
    return seen


def ptxas_report(ptx: str, arch: int, sass: bool = False) -> dict:
    """ptxas -v of one kernel's PTX: registers, spill stores / loads (bytes), shared memory; with sass also
    the cubin's disassembly (nvdisasm -c) under "sass"."""
    from triton.backends.nvidia.compiler import get_ptxas
    try:
        ptxas = get_ptxas(arch).path
    except TypeError:   # older Triton: no arch argument
        ptxas = get_ptxas().path
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a", src, "-o", os.path.join(d, "k.o")],
                           capture_output=True, text=True)
        dis = ""
        if sass and r.returncode == 0:
            nvdisasm = os.path.join(os.path.dirname(ptxas), "nvdisasm")
            dis = subprocess.run([nvdisasm, "-c", os.path.join(d, "k.o")], capture_output=True, text=True).stdout
    text = r.stderr + r.stdout
    def num(pat):
        m = re.search(pat, text)
        return int(m.group(1)) if m else None
    return dict(regs=num(r"Used (\d+) registers"), spill_stores=num(r"(\d+) bytes spill stores"),
                spill_loads=num(r"(\d+) bytes spill loads"), stack=num(r"(\d+) bytes stack frame"), sass=dis)


_SASS_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
_SASS_LABEL = re.compile(r"^\s*\.L_x_(\d+):")


def sass_loops(sass: str) -> list[dict]:
    """Loop bodies of an nvdisasm -c listing: every backward branch (BRA to a label above it) closes one;
    [{"start", "end" (addresses), "instructions", "ops": {opcode without modifiers: count}}], largest first.
    Counts are per thread and iteration: what one warp issues each time round the loop."""
    ins, labels, pending = [], {}, []
    for line in sass.splitlines():
        lab = _SASS_LABEL.match(line)
        if lab:
            pending.append(lab.group(1))
            continue
        m = _SASS_LINE.match(line)
        if not m:
            continue
        addr = int(m.group(1), 16)
        for name in pending:
            labels[name] = addr
        pending = []
        target = re.search(r"BRA\S*\s+`?\(?\.L_x_(\d+)", line)
        ins.append((addr, m.group(2), target.group(1) if target else None))
    loops = []
    for addr, op, target in ins:
        if op == "BRA" and target in labels and labels[target] < addr:   # not the exit's self-branch
            body = [o for a, o, _ in ins if labels[target] <= a <= addr]
            ops: dict[str, int] = {}
            for o in body:
                ops[o] = ops.get(o, 0) + 1
            loops.append({"start": labels[target], "end": addr, "instructions": len(body),
                          "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1]))})
    return sorted(loops, key=lambda lp: -lp["instructions"])


def selection(T: int, H: int, nsb: int, n_sel: int, l_sel: int) -> torch.Tensor:
    """A valid block_idx [1, T, H, n_sel]: forced blocks plus random eligible ones, ascending, -1 padded."""
    t = torch.arange(T).view(1, T, 1, 1)
    j = torch.arange(nsb).view(1, 1, 1, nsb)
    cur = t // l_sel
    s = torch.rand(1, T, H, nsb)
    s = torch.where(j > cur, float("-inf"), s)
    s = torch.where((j == cur) | (j == 0) | (j == cur - 1), float("inf"), s)
    v, idx = torch.topk(s, min(n_sel, nsb), dim=-1)
    idx = torch.where(v == float("-inf"), -1, idx)
    idx = torch.sort(torch.where(idx < 0, nsb, idx), dim=-1).values
    return torch.where(idx == nsb, -1, idx)


def main() -> int:
    a = parse_args()
    from nsa.ops.route import pair_plan
    from nsa.ops.tuning import HOPPER
    from nsa.ops.triton import select as tsel
    from nsa.ops.triton import select_block as sb
    from nsa.ops.triton.scores import select_blocks
    tuning = common.changed_tuning(a.tuning, HOPPER) or HOPPER
    seen = compile_only(a.arch)
    # the launchers' CUDA-only choices (dot precision, the score map's, register caps) as on the GPU
    torch.Tensor.is_cuda = property(lambda self: True)
    hp = common.HP
    l_sel, n_sel = hp["l_sel"], hp["n_sel"]
    B, T, HQ, H, dk, dv = 1, a.T, a.HQ, a.H, a.dk, a.dv
    bf = dict(dtype=torch.bfloat16)
    q, k, v = torch.randn(B, T, HQ, dk, **bf), torch.randn(B, T, H, dk, **bf), torch.randn(B, T, H, dv, **bf)
    do = torch.randn(B, T, HQ, dv, **bf)
    gates = torch.rand(B, T, HQ, 3, **bf)
    bi = selection(T, H, -(-T // l_sel), n_sel, l_sel)
    tn = tuning.select
    inv = tsel.invert_selection(bi, l_sel, tn.chunk, ranks=True)
    o, lse = sb.slc_fwd_pairs(q, k, v, bi, inv, l_sel=l_sel, scale=dk ** -0.5, chunk=tn.chunk, tuning=tn)
    lse = torch.zeros(B, T, HQ)
    delta = torch.zeros(B, T, HQ)
    dqp = sb.pair_buffer(q, n_sel, H, dk, pair_plan(tn, HQ // H), dq=True)
    tsel.slc_dkdv(q, k, v, bi, do, lse, delta, gates[..., 1], l_sel=l_sel, scale=dk ** -0.5, chunk=tn.chunk,
                  tuning=tn, inv=inv, dq_pairs=dqp)
    # the same walk without dq (the query-tile path's, which the captured inputs take): listed second
    tsel.slc_dkdv(q, k, v, bi, do, lse, delta, gates[..., 1], l_sel=l_sel, scale=dk ** -0.5, chunk=tn.chunk,
                  tuning=tn, inv=inv)
    # the per-token forward and dq, and the fused block scores + top-n
    tsel.slc_fwd(q, k, v, bi, l_sel=l_sel, scale=dk ** -0.5, tuning=tn)
    tsel.slc_dq(q, k, v, bi, do, lse, delta, gates[..., 1], l_sel=l_sel, scale=dk ** -0.5, tuning=tn)
    k_cmp = torch.randn(B, (T - hp["l"]) // hp["d"] + 1, H, dk, **bf)
    select_blocks(q, k_cmp, lse, l=hp["l"], d=hp["d"], l_sel=l_sel, n_sel=n_sel, scale=dk ** -0.5,
                  tuning=tuning.scores, relayout=tuning.scores.relayout)
    # the query-tile forward and dq (the paper shape's path where m consecutive tokens share blocks)
    from nsa.ops.triton import select_tile as stile
    m = tuning.tile.m
    un = stile.tile_unions(bi, m)
    stile.slc_fwd_tile(q, k, v, bi, l_sel=l_sel, scale=dk ** -0.5, m=m, union=un, tuning=tuning.tile)
    stile.tile_dq(q, k, v, do, lse, delta, gates[..., 1], un, l_sel=l_sel, scale=dk ** -0.5, m=m,
                  tuning=tuning.tile)
    rows, mixes = [], []
    for name, warps, stages, ck in seen:
        if ck is None or "ptx" not in getattr(ck, "asm", {}):
            continue
        r = ptxas_report(ck.asm["ptx"], a.arch, sass=a.sass)
        for lp in sass_loops(r["sass"])[:2]:
            top = ", ".join(f"{o} {c}" for o, c in list(lp["ops"].items())[:a.top])
            line = f"  {name} loop {lp['start']:#x}-{lp['end']:#x}: {lp['instructions']} instructions; {top}"
            if line not in mixes:   # a kernel compiled twice with the same constants
                mixes.append(line)
        if a.dump:   # a kernel compiled again with other constants (the two dK/dV walks) gets .2, .3, ...
            os.makedirs(a.dump, exist_ok=True)
            nth = sum(r[0] == name for r in rows)
            stem = name + (f".{nth + 1}" if nth else "")
            for ext in ("ttgir", "ptx"):
                with open(os.path.join(a.dump, f"{stem}.{ext}"), "w") as f:
                    f.write(ck.asm[ext])
        rows.append([name, warps, stages, r["regs"], r["spill_stores"], r["spill_loads"],
                     ck.metadata.shared])
    print(f"sm_{a.arch}, T={T}, HQ={HQ}, H={H}, dk={dk}, dv={dv}" + (f", {' '.join(a.tuning)}" if a.tuning else ""))
    common.print_table(["kernel", "warps", "stages", "regs", "spill st B", "spill ld B", "shared B"], rows, "")
    caps = {"_pair_fwd_kernel": tn.pair_max_regs, "_select_kernel": tuning.scores.tile_for(dk > 128).max_regs}
    print("register caps (applied, as on the GPU): "
          + (", ".join(f"{k} {v}" for k, v in caps.items() if v is not None) or "none"))
    if a.sass:
        print("\nloop bodies (the two largest per kernel), instructions per thread and iteration:")
        print("\n".join(mixes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
