#!/usr/bin/env python
"""Where each kernel of an Nsight Compute report stalls, by source line: the warp-state samples
(ncu --set full collects them) summed per (file, line) and per stall reason.

    python bench/ncu_source.py REPORT.ncu-rep [--top 14]

Triton kernels carry their Python line numbers, so the lines are those of nsa/ops/triton/*.py. Uses
Nsight Compute's own Python module (ncu_report, under the install's extras/python), so it runs where
ncu is installed.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
from collections import Counter, defaultdict


def load_ncu_report():
    roots = sorted(glob.glob("/opt/nvidia/nsight-compute/*/extras/python")) + \
        sorted(glob.glob("/usr/local/cuda*/nsight-compute*/extras/python"))
    for r in roots[::-1]:
        if os.path.exists(os.path.join(r, "ncu_report.py")):
            sys.path.insert(0, r)   # a tool script outside the package: ncu ships its module this way
            break
    import ncu_report
    return ncu_report


STALL_PREFIX = "smsp__pcsamp_warps_issue_stalled_"


def per_line(action) -> tuple[dict, Counter, int]:
    """(stall reasons' samples per 'file:line', samples per stall reason, total samples) of one kernel."""
    lines: dict = defaultdict(Counter)
    reasons: Counter = Counter()
    total = 0
    names = [n for n in action.metric_names() if n.startswith(STALL_PREFIX) and not n.endswith("_not_issued")]
    for name in names:
        m = action.metric_by_name(name)
        n = m.num_instances()
        if not n:
            continue
        pcs = m.correlation_ids()
        reason = name[len(STALL_PREFIX):]
        for i in range(n):
            v = m.as_uint64(i)
            if not v:
                continue
            pc = pcs.as_uint64(i)
            info = action.source_info(pc)
            key = f"{os.path.basename(info.file_name())}:{info.line()}" if info is not None else f"pc {pc:#x}"
            lines[key][reason] += v
            reasons[reason] += v
            total += v
    return lines, reasons, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("report")
    ap.add_argument("--top", type=int, default=14)
    a = ap.parse_args()
    ncu_report = load_ncu_report()
    ctx = ncu_report.load_report(a.report)
    for r in range(ctx.num_ranges()):
        rng = ctx.range_by_idx(r)
        for i in range(rng.num_actions()):
            act = rng.action_by_idx(i)
            name = act.name()
            lines, reasons, total = per_line(act)
            dur = act.metric_by_name("gpu__time_duration.sum")
            print(f"== {name} ({dur.as_double() / 1e3 if dur else float('nan'):.1f} us, {total} samples)")
            if not total:
                continue
            print("  stalls: " + ", ".join(f"{k} {v / total:.0%}" for k, v in reasons.most_common(8)))
            ranked = sorted(lines.items(), key=lambda kv: -sum(kv[1].values()))[:a.top]
            for key, rs in ranked:
                v = sum(rs.values())
                why = ", ".join(f"{k} {c / v:.0%}" for k, c in rs.most_common(2))
                print(f"  {v / total:6.1%}  {key:<22} {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
