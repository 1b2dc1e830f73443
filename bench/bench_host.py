"""Host cost of one eager NSA op call (forward+backward) against its CUDA-graph replay, per shape and T.

For each T and shape (paper: HQ=64, H=4, d=128; production: HQ=12, H=2, d=64) it prints
  eager ms   one forward+backward as a user's loop runs it (CUDA events, host and device together)
  graph ms   the same call captured once and replayed (device only)
  issue ms   wall time the host spends issuing one call (no sync; the GPU is still busy after it)
and writes the hottest host functions of a few eager calls (cProfile, by own time) to the JSON, which is
what the per-shape plan and the launch sequence have to shrink (issue: eager op <= 1.2x its replay).

    python bench/bench_host.py --T 8192 16384 [--shapes paper prod] [--save]
"""
from __future__ import annotations

import cProfile
import pstats
import time

import torch

import common

SHAPES = {"paper": dict(HQ=64, H=4, dk=128, dv=128), "prod": dict(HQ=12, H=2, dk=64, dv=64)}


def _call(x: list[torch.Tensor]):
    def run() -> None:
        for t in x:
            t.grad = None
        common.nsa_op(x).float().sum().backward()
    return run


def _hot(fn, calls: int = 3, top: int = 15) -> list[dict]:
    """The `top` host functions by own time over `calls` eager calls (ms per call)."""
    prof = cProfile.Profile()
    common.sync()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    common.sync()
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"fn": f"{f[0].split('site-packages/')[-1].split('/work/')[-1]}:{f[1]}({f[2]})",
             "calls": v[1] / calls, "own_ms": 1e3 * v[2] / calls, "cum_ms": 1e3 * v[3] / calls}
            for f, v in rows]


def _issue_ms(fn, iters: int) -> float:
    common.sync()
    times = []
    for _ in range(iters):
        common.sync()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    common.sync()
    return sorted(times)[len(times) // 2]


def main() -> int:
    ap = common.t_args(__doc__, default_t=(8192, 16384))
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args()
    if not common.has_cuda():
        raise SystemExit("bench_host.py needs CUDA (it times the Triton op)")
    rows, result = [], {"rows": [], "hot": {}}
    for name in args.shapes:
        s = SHAPES[name]
        for T in args.T:
            x = common.nsa_inputs(1, T, s["HQ"], s["H"], s["dk"], s["dv"])
            fn = _call(x)
            common.set_timer("eager")
            eager = common.gpu_time(fn, args.warmup, args.iters)
            issue = _issue_ms(fn, args.iters)
            common.set_timer("graph")
            graph = common.gpu_time(fn, args.warmup, args.iters)
            common.set_timer("eager")
            result["hot"][f"{name}@{T}"] = _hot(fn)
            row = {"shape": name, "T": T, "eager_ms": eager, "graph_ms": graph, "issue_ms": issue,
                   "eager_over_graph": eager / graph}
            result["rows"].append(row)
            rows.append([name, T, eager, graph, issue, eager / graph])
            del x, fn
            torch.cuda.empty_cache()
    common.print_table(["shape", "T", "eager ms", "graph ms", "issue ms", "eager/graph"], rows)
    for key, hot in result["hot"].items():
        print(f"\nhottest host functions, {key} (ms per call, own / cumulative):")
        for h in hot[:8]:
            print(f"  {h['own_ms']:7.3f} {h['cum_ms']:7.3f}  x{h['calls']:.0f}  {h['fn']}")
    common.write_result(result, "host_overhead", args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
