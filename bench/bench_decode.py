"""Benchmark: one NSA decode step (one new token per sequence) against a dense SDPA decode step over
the same cache, at paper sizes (l=32, d=16, l_sel=64, n_sel=16, w=512; HQ=64, H=4, d_k=d_v=128,
bf16), contexts 8k..64k, batch 1 and 16.

NSA: the Triton decode kernel, eager through nsa.ops.nsa_decode (host-int position, validation
included) and CUDA-graph captured (device position tensor over capacity buffers, replayed).
Dense: F.scaled_dot_product_attention with enable_gqa over the [B, S, H, d] cache (transposed
views, no copies), each of cuDNN / flash / efficient / math that accepts the shape, eager and
graph-captured; the fastest is the reference. Times are medians of CUDA-event-timed runs. "cold":
L2 is flushed (a 512 MiB write) before every timed call, as in a real model where other layers
evict this layer's cache; "hot": back-to-back calls (inner loop of 10), the cache may sit in L2.

    python bench/bench_decode.py [--S 8192 16384 32768 65536] [--B 1 16] [--breakdown] [--sweep]
                                 [--jobs 8]

--sweep times the SWEEP variants of the launch knobs (nsa.ops.triton.decode.TUNE) at the largest S
first and keeps the one with the best geometric mean of dense/NSA over the batch sizes; --jobs N
compiles the variants in N parallel processes beforehand (Triton's on-disk cache), so the timed
process compiles nothing.

Prints a table and writes bench/out/decode_<date>.json (and a copy under $OUT or --copy-to).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import sys
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nsa.ops import nsa_decode  # noqa: E402
from nsa.ops.common import num_cmp_tokens  # noqa: E402
from nsa.ops.triton import decode as tdec  # noqa: E402

HP = dict(l=32, d=16, l_sel=64, n_sel=16, w=512)
_FLUSH: torch.Tensor | None = None


def _flush_l2() -> None:
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(512 * 2 ** 20, dtype=torch.uint8, device="cuda")
    _FLUSH.fill_(1)


def time_cold(fn, reps: int) -> float:
    """Median microseconds of one fn() call, L2 flushed before each."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        _flush_l2()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in times) * 1e3


def time_hot(fn, reps: int, inner: int = 10) -> float:
    """Median microseconds per call over reps runs of `inner` back-to-back calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(max(5, reps // 5)):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in times) * 1e3 / inner


def graphed(fn):
    """Capture fn() once (after a warm-up on a side stream) and return the replay callable."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def make_cache(B, S, HQ, H, dk, dv, dtype=torch.bfloat16):
    """One decode step's inputs at context S: the query at position S - 1 and the cache before it."""
    N = num_cmp_tokens(S, HP["l"], HP["d"])
    r = lambda *s: torch.randn(*s, device="cuda", dtype=dtype)  # noqa: E731
    w = min(HP["w"], S)
    return dict(q=r(B, 1, HQ, dk), k_cmp=r(B, N, H, dk), v_cmp=r(B, N, H, dv), k_slc=r(B, S, H, dk),
                v_slc=r(B, S, H, dv), k_win=r(B, w, H, dk), v_win=r(B, w, H, dv),
                gates=torch.rand(B, 1, HQ, 3, device="cuda", dtype=dtype), win_pos0=S - w)


def step_inputs(c, S):
    """The decode call's tensors in nsa_decode order, and the query / window-start positions as
    device tensors (the CUDA-graph form)."""
    args = [c[n] for n in ("q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates")]
    pos = torch.full((1,), S - 1, dtype=torch.int64, device="cuda")
    win = torch.full((1,), c["win_pos0"], dtype=torch.int64, device="cuda")
    return args, pos, win


def bench_nsa(c, S, reps, sweeping: bool = False):
    args, pos, win = step_inputs(c, S)
    res = {}

    def eager():
        return nsa_decode(*args, pos0=S - 1, win_pos0=c["win_pos0"], **HP, backend="triton")

    sc = c["q"].shape[-1] ** -0.5

    def device_pos():
        return tdec.nsa_decode_triton(*args, pos0=pos, win_pos0=win, scale=sc, **HP)

    if not sweeping:
        res["eager_cold_us"] = time_cold(eager, reps)
        res["eager_hot_us"] = time_hot(eager, reps)
    try:
        replay = graphed(device_pos)
    except Exception as exc:  # noqa: BLE001 - e.g. PDL edges refused by this driver's graph capture
        print(f"graph capture failed ({type(exc).__name__}: {str(exc)[:120]}); retrying without PDL",
              flush=True)
        torch.cuda.synchronize()
        tdec.TUNE["pdl"] = False
        res["pdl_capture_failed"] = True
        replay = graphed(device_pos)
    res["graph_cold_us"] = time_cold(replay, reps)
    if not sweeping:
        res["graph_hot_us"] = time_hot(replay, reps)
    return res


def check_against_torch(c, S) -> dict:
    """The kernel (current knobs, device positions) against the fp32 torch path on the same cache."""
    args, pos, win = step_inputs(c, S)
    o, bi = tdec.nsa_decode_triton(*args, pos0=pos, win_pos0=win, scale=c["q"].shape[-1] ** -0.5, **HP)
    ro, rbi = nsa_decode(*[x.float() for x in args], pos0=S - 1, win_pos0=c["win_pos0"], **HP,
                         backend="torch")
    return {"block_idx_rows_equal": (bi == rbi).all(-1).float().mean().item(),
            "o_rel_err": ((o.float() - ro).norm() / ro.norm()).item()}


def _sdpa_backends():
    from torch.nn.attention import SDPBackend
    names = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")  # math: expands K/V, far slower
    return {n.split("_")[0].lower(): getattr(SDPBackend, n) for n in names if hasattr(SDPBackend, n)}


def bench_dense(c, reps):
    """SDPA decode over the same cache: q [B, HQ, 1, dk], k/v [B, H, S, d] views of [B, S, H, d]."""
    from torch.nn.attention import sdpa_kernel
    q, k, v = c["q"].transpose(1, 2), c["k_slc"].transpose(1, 2), c["v_slc"].transpose(1, 2)
    out = {}
    for name, be in _sdpa_backends().items():
        def call(be=be):
            with sdpa_kernel(be):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        try:
            r = {"eager_cold_us": time_cold(call, reps), "eager_hot_us": time_hot(call, reps)}
            replay = graphed(call)
            r["graph_cold_us"] = time_cold(replay, reps)
            r["graph_hot_us"] = time_hot(replay, reps)
            out[name] = r
        except Exception as exc:  # noqa: BLE001 - a backend that refuses this shape is skipped
            out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
        torch.cuda.synchronize()
    ok = {k: v for k, v in out.items() if "error" not in v}
    best = {m: min(ok, key=lambda k: ok[k][m]) for m in ("eager_cold_us", "graph_cold_us", "eager_hot_us")}
    return {"all": out, "best": {m: {"backend": k, "us": ok[k][m]} for m, k in best.items()}}


def breakdown(c, S, iters: int = 20) -> dict:
    """Per-kernel device microseconds (torch.profiler, L2 warm) and registers / spills per kernel."""
    from torch.profiler import ProfilerActivity, profile
    args, pos, win = step_inputs(c, S)

    def call():  # without PDL: a dependent kernel's time would include its wait for the previous one
        return tdec.nsa_decode_triton(*args, pos0=pos, win_pos0=win, scale=c["q"].shape[-1] ** -0.5, **HP,
                                      tune=dict(pdl=False))

    call()
    torch.cuda.synchronize()
    out = {}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    for evt in prof.key_averages():
        tot = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if evt.key.startswith("_") and evt.count:
            out[evt.key] = round(tot / evt.count, 2)
    for name, k in tdec.LAST_LAUNCH.items():
        out[f"{name}_regs_spills"] = (getattr(k, "n_regs", None), getattr(k, "n_spills", None))
    return out


_BASE = dict(tdec.TUNE)
# Variants tried on an H200 at 64k and dropped (2026-11-24, slower at both batch sizes): cmp_tile 32
# or 128, cmp_per_sm 3-4, cmp_warps 1, 2 or 8, cmp_stages 2 or 4, a maxnreg cap of 128/168 (the
# compressed pass stalls on instruction latency, not on memory: ncu shows 2 warps per scheduler and short-
# scoreboard/wait stalls), slc_warps 1 or 2, score_slice 64/256, score_warps 8; the window programs
# as a separate launch on a side stream beside the compressed pass (B=1 26.4 vs 24.5 us, B=16 83.7 vs
# 81.4: the compressed pass leaves no room for them on a multiprocessor). Transposed tiles in the
# split-K and selection+window kernels (keys as the MMA's M side, so 64-key tiles could use Hopper's
# warpgroup MMA; 2026-11-24T19:10Z): B=16 81.3 vs 80.9 us, B=1 27.0 vs 24.2 (and an illegal address
# from one variant on the GPU that the interpreter did not show), so the code was not kept. More, shorter
# selection/window programs with fewer stages (19:28Z): B=16 sw_per_sm 6 (2 stages) 84.1, 8 (1 stage) 85.4,
# 12 (1 stage) 91.3, 8 with 32-key tiles 86.1 vs 80.3 us; B=1 sw_per_sm 4 with 1 stage 25.2 vs 24.1.
# The whole step as one persistent launch (one program per multiprocessor taking the four launches'
# items round-robin, per-(row, kv head) counters instead of kernel boundaries; 19:35Z): B=1 38.4-41.1 vs
# 24.2 us, B=16 135.7-169.9 vs 80.4 (239 registers, one 4-warp program per multiprocessor), not kept.
_L = dict(comb_warps="auto", score_warps="auto", slc_warps=4, sw_per_sm=3, pdl=False)  # B=16 (64k) best
SWEEP = [dict(_BASE),
         dict(_BASE, pdl=False),
         dict(_BASE, sw_per_sm=4),
         dict(_BASE, slc_warps=4, slc_stages=2),
         dict(_BASE, **_L),
         dict(_BASE, **dict(_L, pdl=True)),
         dict(_BASE, **dict(_L, sw_per_sm=1)),
         dict(_BASE, **dict(_L, slc_stages=2))]


def _warm(cfg: dict, B: int, S: int, shape: tuple) -> str:
    """Compile one SWEEP variant for batch B at context S (a subprocess of --jobs)."""
    torch.manual_seed(0)
    tdec.TUNE.update(cfg)
    tdec.TUNE_LARGE.clear()
    c = make_cache(B, S, *shape)
    try:
        bench_nsa(c, S, 3, sweeping=cfg != _BASE)  # the defaults: the eager (host-int) kernels too
        return "ok"
    except Exception as exc:  # noqa: BLE001 - reported; the timed sweep records it again
        return f"{type(exc).__name__}: {str(exc)[:120]}"


def precompile(Bs, Ss, shape: tuple, jobs: int) -> None:
    """Fill Triton's on-disk cache with every SWEEP variant at the largest S and the defaults at
    every S, `jobs` processes at a time."""
    import concurrent.futures as cf
    import multiprocessing as mp
    work = [(cfg, B, max(Ss)) for cfg in SWEEP for B in Bs]
    work += [(_BASE, B, S) for B in Bs for S in Ss if S != max(Ss)]
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as ex:
        futs = [ex.submit(_warm, cfg, B, S, shape) for cfg, B, S in work]
        for (cfg, B, S), f in zip(work, futs):
            r = f.result()
            if r != "ok":
                print(f"  precompile B={B} S={S} {_key(cfg)}: {r}", flush=True)


def _key(cfg: dict) -> str:
    """A SWEEP variant's name: its differences from the defaults."""
    diff = {k: v for k, v in cfg.items() if _BASE.get(k) != v}
    return ",".join(f"{k}={v}" for k, v in diff.items()) or "defaults"


def sweep(c, S, reps):
    """Every SWEEP setting as the knobs of this batch (TUNE, no TUNE_LARGE): graph replay, cold L2
    (us). TUNE and TUNE_LARGE are restored afterwards."""
    out = {}
    saved, saved_large = dict(tdec.TUNE), dict(tdec.TUNE_LARGE)
    tdec.TUNE_LARGE.clear()
    for cfg in SWEEP:
        tdec.TUNE.update(cfg)
        key = _key(cfg)
        try:
            out[key] = bench_nsa(c, S, reps, sweeping=True)["graph_cold_us"]
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory for this tile
            out[key] = f"{type(exc).__name__}: {str(exc)[:120]}"
        print(f"  sweep S={S} B={c['q'].shape[0]} {key}: {out[key]}", flush=True)
    tdec.TUNE.clear()
    tdec.TUNE.update(saved)
    tdec.TUNE_LARGE.update(saved_large)
    return out


def pick_best(res: dict) -> dict:
    """The fastest SWEEP setting of one batch size's sweep."""
    ok = [i for i in range(len(SWEEP)) if isinstance(res[_key(SWEEP[i])], float)]
    return SWEEP[min(ok, key=lambda i: res[_key(SWEEP[i])])]


def apply_choice(best: dict) -> None:
    """best[B] = chosen knobs: the smallest batch's become TUNE, the others' (rows >= large_rows
    with H kv heads) the TUNE_LARGE overrides."""
    Bs = sorted(best)
    tdec.TUNE.update(best[Bs[0]])
    if len(Bs) > 1:
        tdec.TUNE_LARGE.clear()
        tdec.TUNE_LARGE.update({k: v for k, v in best[Bs[-1]].items() if tdec.TUNE.get(k) != v})


def stage_costs(c, S, reps) -> dict:
    """Graph replay microseconds (cold L2, hot) of the first n launches of the decode step, n = 1..4,
    and of a graph with one trivial kernel: the differences are each launch's cost on the critical
    path (the truncated steps compute garbage; only their time is used)."""
    args, pos, win = step_inputs(c, S)
    sc = c["q"].shape[-1] ** -0.5
    orig = tdec._launch_with_pdl_fallback
    one = torch.zeros(1, device="cuda")
    trivial = graphed(lambda: one.add_(1))
    out = {"trivial": {"cold_us": time_cold(trivial, reps), "hot_us": time_hot(trivial, reps)}}
    try:
        for n in (1, 2, 3, 4):
            tdec._launch_with_pdl_fallback = lambda specs, pdl, n=n: orig(specs[:n], pdl)
            replay = graphed(lambda: tdec.nsa_decode_triton(*args, pos0=pos, win_pos0=win, scale=sc, **HP))
            out[f"first_{n}"] = {"cold_us": time_cold(replay, reps), "hot_us": time_hot(replay, reps)}
    finally:
        tdec._launch_with_pdl_fallback = orig
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--S", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    ap.add_argument("--B", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--HQ", type=int, default=64)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--sweep", action="store_true",
                    help="time the SWEEP launch knobs at the largest S first and use the best for the table")
    ap.add_argument("--breakdown", action="store_true", help="per-kernel times at the largest S")
    ap.add_argument("--stages", action="store_true",
                    help="at the largest S: graph times of the first 1..4 launches (critical-path cost of each)")
    ap.add_argument("--jobs", type=int, default=1, help="processes compiling the SWEEP variants first")
    ap.add_argument("--precompile-only", action="store_true",
                    help="only compile the SWEEP variants (--jobs processes) and exit")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    ap.add_argument("--copy-to", default=os.environ.get("OUT"), help="also copy the JSON here")
    a = ap.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)  # SDPA's "kernel not used because" notes
    if a.precompile_only:
        precompile(a.B, a.S, (a.HQ, a.H, a.dk, a.dv), max(1, a.jobs))
        return
    import triton
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__,
              "date": dt.datetime.now().isoformat(timespec="seconds"), "hparams": HP,
              "shape": dict(HQ=a.HQ, H=a.H, dk=a.dk, dv=a.dv, dtype="bf16"), "runs": []}
    if a.sweep:  # first: choose the launch knobs per batch size at the largest S, then the table
        S = max(a.S)
        sweeps, best = {}, {}
        for B in a.B:
            c = make_cache(B, S, a.HQ, a.H, a.dk, a.dv)
            sweeps[B] = sweep(c, S, a.reps)
            best[B] = pick_best(sweeps[B])
            del c
            torch.cuda.empty_cache()
        if min(a.B) * a.H >= tdec.TUNE["large_rows"] or max(a.B) * a.H < tdec.TUNE["large_rows"]:
            best = {min(a.B): best[min(a.B)]}  # one regime only: one choice (the smallest batch's)
        apply_choice(best)
        result["sweep"] = {"S": S, "us": {str(B): v for B, v in sweeps.items()},
                           "chosen": {str(B): _key(v) for B, v in best.items()}}
        print(f"chosen: {result['sweep']['chosen']}", flush=True)
    if a.stages:
        for B in a.B:
            c = make_cache(B, max(a.S), a.HQ, a.H, a.dk, a.dv)
            result[f"stages_B{B}"] = st = stage_costs(c, max(a.S), a.reps)
            print(f"stages B={B} S={max(a.S)}: " + ", ".join(
                f"{k} {v['cold_us']:.1f}/{v['hot_us']:.1f}" for k, v in st.items()) + " us (cold/hot)", flush=True)
            del c
            torch.cuda.empty_cache()
    result["tune"] = dict(tdec.TUNE)
    result["tune_large"] = dict(tdec.TUNE_LARGE)
    for B in a.B:
        c = make_cache(B, max(a.S), a.HQ, a.H, a.dk, a.dv)
        result[f"check_B{B}_S{max(a.S)}"] = chk = check_against_torch(c, max(a.S))
        print(f"check vs torch fp32 B={B} S={max(a.S)}: {chk}", flush=True)
        del c
        torch.cuda.empty_cache()
    rows = []
    for B in a.B:
        for S in a.S:
            c = make_cache(B, S, a.HQ, a.H, a.dk, a.dv)
            nsa = bench_nsa(c, S, a.reps)
            dense = bench_dense(c, a.reps)
            run = {"B": B, "S": S, "nsa": nsa, "dense": dense}
            if a.breakdown and S == max(a.S):
                run["breakdown"] = breakdown(c, S)
                print(f"  breakdown B={B} S={S}: {run['breakdown']}", flush=True)
            result["runs"].append(run)
            de, dg = dense["best"]["eager_cold_us"], dense["best"]["graph_cold_us"]
            rows.append((B, S, nsa["eager_cold_us"], nsa["graph_cold_us"], nsa["graph_hot_us"], de["us"],
                         de["backend"], dg["us"], de["us"] / nsa["graph_cold_us"],
                         dg["us"] / nsa["graph_cold_us"], de["us"] / nsa["eager_cold_us"]))
            print(f"B={B} S={S}: nsa {nsa} dense best {dense['best']}", flush=True)
            del c
            torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"decode_{dt.date.today().isoformat()}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    if a.copy_to:
        os.makedirs(a.copy_to, exist_ok=True)
        shutil.copy(path, a.copy_to)
    print(f"\n{result['device']}  torch {result['torch']}  triton {result['triton']}  {result['date']}")
    print(f"launch knobs: {result['tune']}  large-batch overrides: {result['tune_large']}")
    print("microseconds per decode step (median, cold L2); x = dense / NSA")
    print(f"{'B':>3} {'S':>6} {'nsa eager':>10} {'nsa graph':>10} {'(hot)':>7} {'dense':>8} {'backend':>8} "
          f"{'dense graph':>11} {'x graph':>8} {'x vs dense graph':>16} {'x eager':>8}")
    for r in rows:
        print(f"{r[0]:>3} {r[1]:>6} {r[2]:>10.1f} {r[3]:>10.1f} {r[4]:>7.1f} {r[5]:>8.1f} {r[6]:>8} "
              f"{r[7]:>11.1f} {r[8]:>8.2f} {r[9]:>16.2f} {r[10]:>8.2f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
