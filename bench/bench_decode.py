"""Decode: one NSA decode step (one new token per sequence) against the best dense decode over the same
cache, at paper sizes (l=32, d=16, l_sel=64, n_sel=16, w=512; HQ=64, H=4, d_k=d_v=128, bf16).

    python bench/bench_decode.py [--S 8192 16384 32768 65536] [--B 1 16] [--breakdown] [--stages] [--roofs]
                                 [--sweep [--jobs 8]] [--precompile-only --jobs 8]

NSA: the Triton decode kernel, eager through nsa.ops.nsa_decode (host-int position, validation
included) and CUDA-graph captured (device position tensors over capacity buffers, replayed).
Dense: each dense implementation present (SDPA cuDNN / flash / efficient, FlashAttention-4 / -2 when
importable; --dense narrows or widens it, e.g. sdpa-math) over the [B, S, H, d] cache with grouped-query
heads, eager and graph-captured; the fastest is the reference. Medians of CUDA-event timings. "cold":
L2 flushed (a 512 MiB write) before every timed call, as in a model where other layers evict this
layer's cache; "hot": back-to-back calls (inner loop of 10), the cache may sit in L2.

--sweep: the decode launch-knob variants of SWEEP, each passed as tuning= (nothing patched), at the
largest S first; the fastest per batch size (small batch -> the small regime, large batch -> the large
one) is used for the table. --jobs N compiles the variants in N processes first (Triton's on-disk
cache), so the timed process compiles nothing. --stages: graph replays of the first 1..4 launches (the
critical-path cost of each). --breakdown: per-kernel device times and registers at the largest S. --roofs:
what the step's bytes cost read once (cold) and what one dependent launch costs (bench/RESULTS.md, Decode).

JSON: bench/out/decode_<stamp>.json; --save copies it to bench/results/decode.json.
"""
from __future__ import annotations

import dataclasses
import warnings

import torch

import common
from common import HP

DENSE_DEFAULT = ["sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "fa4", "fa2"]   # math expands K/V: far slower
_L = dict(comb_warps="auto", score_warps="auto", slc_warps=4, sw_per_sm=3, pdl=False)  # B=16 (64k) best so far
# changes to the small-batch default knobs (nsa.ops.tuning.DecodeKnobs); each runs at every batch size
SWEEP = [{}, dict(pdl=False), dict(sw_per_sm=4), dict(slc_warps=4, slc_stages=2), dict(_L),
         dict(_L, pdl=True), dict(_L, sw_per_sm=1), dict(_L, slc_stages=2)]


def time_cold(fn, reps: int) -> float:
    """Median microseconds of one fn() call, L2 flushed before each."""
    return common.gpu_time(fn, 1, reps, flush=True, sync_each=False) * 1e3


def time_hot(fn, reps: int) -> float:
    """Median microseconds per call over runs of 10 back-to-back calls."""
    return common.gpu_time(fn, 3, max(5, reps // 5), inner=10, sync_each=False) * 1e3


def make_cache(B, S, HQ, H, dk, dv, dtype=torch.bfloat16, layout: str = "bshd"):
    """One decode step's inputs at context S: the query at position S - 1 and the cache before it. The cache
    tensors are [B, S, H, d] views of token-major storage, or with layout "bhsd" of head-major storage (each
    head's rows contiguous, SDPA's own layout)."""
    from nsa.ops.common import num_cmp_tokens
    N = num_cmp_tokens(S, HP["l"], HP["d"])

    def r(*s):
        if layout == "bhsd" and len(s) == 4 and s[1] > 1:
            return torch.randn(s[0], s[2], s[1], s[3], device="cuda", dtype=dtype).transpose(1, 2)
        return torch.randn(*s, device="cuda", dtype=dtype)
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


def bench_nsa(c, S, reps, tuning, sweeping: bool = False):
    """NSA step times (us); the tuning actually used comes back under "tuning_used" (PDL is turned
    off when this driver's graph capture refuses it)."""
    args, pos, win = step_inputs(c, S)
    res = {}
    if not sweeping:
        eager = lambda: common.decode_eager_op(args, S - 1, c["win_pos0"], tuning)  # noqa: E731
        res["eager_cold_us"] = time_cold(eager, reps)
        res["eager_hot_us"] = time_hot(eager, reps)
    try:
        replay = common.graphed(lambda: common.decode_op(args, pos, win, tuning))
    except Exception as exc:  # noqa: BLE001 - e.g. PDL edges refused by this driver's graph capture
        print(f"graph capture failed ({common.error_text(exc, 120)}); retrying without PDL", flush=True)
        torch.cuda.synchronize()
        tuning = common.decode_knobs_variant(tuning, pdl=False)
        res["pdl_capture_failed"] = True
        replay = common.graphed(lambda: common.decode_op(args, pos, win, tuning))
    res["graph_cold_us"] = time_cold(replay, reps)
    if not sweeping:
        res["graph_hot_us"] = time_hot(replay, reps)
    res["tuning_used"] = tuning
    return res


def check_against_torch(c, S, tuning) -> dict:
    """The kernel (device positions) against the fp32 torch path on the same cache."""
    from nsa.ops import nsa_decode
    args, pos, win = step_inputs(c, S)
    o, bi = common.decode_op(args, pos, win, tuning)
    ro, rbi = nsa_decode(*[x.float() for x in args], pos0=S - 1, win_pos0=c["win_pos0"], **HP, backend="torch")
    return {"block_idx_rows_equal": (bi == rbi).all(-1).float().mean().item(),
            "o_rel_err": ((o.float() - ro).norm() / ro.norm()).item()}


def bench_dense(c, reps, only):
    """Dense decode over the same cache: q [B, 1, HQ, dk] against k/v [B, S, H, d] (no copies)."""
    out = {}
    for name, call in common.dense_candidates(c["q"], c["k_slc"], c["v_slc"], causal=False, only=only).items():
        try:
            r = {"eager_cold_us": time_cold(call, reps), "eager_hot_us": time_hot(call, reps)}
            replay = common.graphed(call)
            r["graph_cold_us"] = time_cold(replay, reps)
            r["graph_hot_us"] = time_hot(replay, reps)
            out[name] = r
        except Exception as exc:  # noqa: BLE001 - a backend that refuses this shape is skipped
            out[name] = {"error": common.error_text(exc, 160)}
        torch.cuda.synchronize()
    ok = {k: v for k, v in out.items() if "error" not in v}
    if not ok:
        raise SystemExit(f"no dense decode ran: {out}")
    best = {m: min(ok, key=lambda k: ok[k][m]) for m in ("eager_cold_us", "graph_cold_us", "eager_hot_us")}
    return {"all": out, "best": {m: {"backend": k, "us": ok[k][m]} for m, k in best.items()}}


def breakdown(c, S, tuning, iters: int = 20) -> dict:
    """Per-kernel device microseconds (torch.profiler, L2 warm) and registers / spills per kernel.
    PDL off: a dependent kernel's time would include its wait for the previous one."""
    from torch.profiler import ProfilerActivity, profile
    args, pos, win = step_inputs(c, S)
    tn = common.decode_knobs_variant(tuning, pdl=False)
    kernels: dict = {}
    call = lambda: common.decode_op(args, pos, win, tn, launch_info=kernels)  # noqa: E731
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
    for name, k in kernels.items():   # the compiled kernels of the last call
        out[f"{name}_regs_spills"] = (getattr(k, "n_regs", None), getattr(k, "n_spills", None))
    return out


def _key(changes: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in changes.items()) or "defaults"


def _warm(changes: dict, B: int, S: int, shape: tuple) -> str:
    """Compile one SWEEP variant for batch B at context S (a subprocess of --jobs)."""
    torch.manual_seed(0)
    c = make_cache(B, S, *shape)
    try:
        bench_nsa(c, S, 3, common.decode_sweep_variant(common.base_tuning(), changes), sweeping=bool(changes))
        return "ok"
    except Exception as exc:  # noqa: BLE001 - reported; the timed sweep records it again
        return common.error_text(exc, 120)


def precompile(Bs, Ss, shape: tuple, jobs: int, variants: list[dict]) -> None:
    """Fill Triton's on-disk cache with every sweep variant at the largest S and the defaults at
    every S, `jobs` processes at a time."""
    import concurrent.futures as cf
    import multiprocessing as mp
    work = [(ch, B, max(Ss)) for ch in variants for B in Bs] + [({}, B, S) for B in Bs for S in Ss if S != max(Ss)]
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as ex:
        futs = [ex.submit(_warm, ch, B, S, shape) for ch, B, S in work]
        for (ch, B, S), f in zip(work, futs):
            if (r := f.result()) != "ok":
                print(f"  precompile B={B} S={S} {_key(ch)}: {r}", flush=True)


def sweep(c, S, reps, base, variants: list[dict]) -> dict:
    """Graph replay, cold L2 (us) of every sweep variant at this batch size."""
    out = {}
    for ch in variants:
        try:
            out[_key(ch)] = bench_nsa(c, S, reps, common.decode_sweep_variant(base, ch), sweeping=True)["graph_cold_us"]
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory for this tile
            out[_key(ch)] = common.error_text(exc, 120)
        print(f"  sweep S={S} B={c['q'].shape[0]} {_key(ch)}: {out[_key(ch)]}", flush=True)
    return out


def pick_best(res: dict, variants: list[dict]) -> dict:
    """The fastest changes of one batch size's sweep."""
    ok = [ch for ch in variants if isinstance(res[_key(ch)], float)]
    return min(ok, key=lambda ch: res[_key(ch)])


def stage_costs(c, S, reps, tuning) -> dict:
    """Graph replay microseconds (cold L2, hot) of the first n launches of the decode step, n = 1 .. the
    step's launches (each row names its last one), and of a graph with one trivial kernel: the differences are
    each launch's cost on the critical path (the truncated steps compute garbage; only their time is used).
    The truncation wraps the launcher's internal launch function for the duration of this call only."""
    from nsa.ops.triton import decode as tdec
    args, pos, win = step_inputs(c, S)
    orig = tdec._launch_with_pdl_fallback
    one = torch.zeros(1, device="cuda")
    trivial = common.graphed(lambda: one.add_(1))
    out = {"trivial": {"cold_us": time_cold(trivial, reps), "hot_us": time_hot(trivial, reps)}}
    names: list = []
    try:
        for n in (1, 2, 3, 4, 5):
            def launch(specs, pdl, *rest, n=n):
                names[:] = [sp[0] for sp in specs]
                orig(specs[:n], pdl, *rest)
            tdec._launch_with_pdl_fallback = launch
            replay = common.graphed(lambda: common.decode_op(args, pos, win, tuning))
            if n > len(names):
                break
            out[f"first_{n}"] = {"cold_us": time_cold(replay, reps), "hot_us": time_hot(replay, reps),
                                 "last": names[n - 1]}
    finally:
        tdec._launch_with_pdl_fallback = orig
    return out


def _roof_kernels():
    """Two probe kernels, built on first use: a streaming read (persistent programs summing [BLOCK] bf16
    slices) and a one-program hop (reads the previous hop's value, writes it + 1; PDL waits before the read)."""
    import triton
    import triton.language as tl
    from nsa.ops.triton.decode import _pdl_launch_dependents, _pdl_wait

    @triton.jit
    def stream(X, OUT, n, BLOCK: tl.constexpr):
        acc = tl.zeros([BLOCK], tl.float32)
        for i in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
            offs = i.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(X + offs, mask=offs < n, other=0.0, eviction_policy="evict_first").to(tl.float32)
        tl.store(OUT + tl.program_id(0), tl.sum(acc, 0))

    @triton.jit
    def hop(X, PDL: tl.constexpr):
        _pdl_launch_dependents(PDL)
        _pdl_wait(PDL)
        tl.store(X, tl.load(X) + 1)
    return stream, hop


def roofs(Bs, S, shape, reps) -> dict:
    """What the decode targets ask of the GPU: the streaming read roof (cold L2, graph replay) at the byte
    counts of the step's compressed pass and of its selection + window pass, and the critical-path cost of
    each dependent launch (a chain of n one-program kernels, plain or programmatic)."""
    from nsa.ops.common import num_cmp_tokens
    HQ, H, dk, dv = shape
    stream, hop = _roof_kernels()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = {"read": {}, "chain": {}}
    N = num_cmp_tokens(S, HP["l"], HP["d"])
    for B in Bs:
        cmp_b = B * N * H * (dk + dv) * 2
        sw_b = B * H * (HP["n_sel"] * HP["l_sel"] + HP["w"]) * (dk + dv) * 2
        for what, nb in (("cmp", cmp_b), ("slc_win", sw_b), ("both", cmp_b + sw_b)):
            x = torch.ones(nb // 2, device="cuda", dtype=torch.bfloat16)
            part = torch.empty(sms * 8, device="cuda")
            best = None
            for progs in (2 * sms, 4 * sms, 8 * sms):
                us = time_cold(common.graphed(lambda: stream[(progs,)](x, part, x.numel(), BLOCK=4096,
                                                                       num_warps=8)), reps)
                best = us if best is None else min(best, us)
            out["read"][f"B{B}_{what}"] = {"MB": nb / 1e6, "us": best, "TB_s": nb / best / 1e6}
            print(f"roof B={B} {what}: {nb / 1e6:.1f} MB in {best:.1f} us = {nb / best / 1e6:.2f} TB/s", flush=True)
            del x
    x = torch.zeros(1, device="cuda", dtype=torch.int32)
    for pdl in (False, True):
        for n in (1, 2, 3, 4, 5):
            def chain(n=n, pdl=pdl):
                for i in range(n):
                    hop[(1,)](x, PDL=pdl, **(dict(launch_pdl=True) if pdl and i else {}))
            us = time_cold(common.graphed(chain), reps)
            out["chain"][f"{'pdl' if pdl else 'plain'}_{n}"] = us
        c = out["chain"]
        k = "pdl" if pdl else "plain"
        print(f"chain ({k}): " + ", ".join(f"{n}: {c[f'{k}_{n}']:.1f}" for n in range(1, 6)) + " us (cold)", flush=True)
    return out


def main() -> None:
    ap = common.t_args(__doc__, t_flag="--S", timing=False)
    ap.add_argument("--B", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--reps", type=int, default=100, help="timed calls per figure")
    ap.add_argument("--dense", nargs="*", default=DENSE_DEFAULT, help="dense baselines (name prefixes)")
    ap.add_argument("--sweep", action="store_true",
                    help="time the SWEEP launch knobs at the largest S first and use the best for the table")
    ap.add_argument("--variants", nargs="+", metavar="KNOB=V[,KNOB=V]",
                    help="--sweep over these instead of SWEEP: changes to the small-batch DecodeKnobs, "
                         "e.g. 'cmp_per_sm=4' 'cmp_tile=128,cmp_warps=8' (an empty string: the defaults)")
    ap.add_argument("--breakdown", action="store_true", help="per-kernel times at the largest S")
    ap.add_argument("--stages", action="store_true",
                    help="at the largest S: graph times of the first 1..4 launches (critical-path cost of each)")
    ap.add_argument("--layout", choices=("bshd", "bhsd"), default="bshd",
                    help="cache storage: token-major (as the model's caches) or head-major (SDPA's own)")
    ap.add_argument("--roofs", action="store_true",
                    help="first: the read roof at the step's byte counts and the cost of a dependent launch")
    ap.add_argument("--jobs", type=int, default=1, help="processes compiling the SWEEP variants first")
    ap.add_argument("--precompile-only", action="store_true",
                    help="only compile the SWEEP variants (--jobs processes) and exit")
    a = ap.parse_args()
    shape = (a.HQ, a.H, a.dk, a.dv)
    variants = SWEEP if a.variants is None else [
        common.parse_changes([x for x in v.split(",") if x.strip()]) for v in a.variants]
    warnings.filterwarnings("ignore", category=UserWarning)  # SDPA's "kernel not used because" notes
    if not common.has_cuda():
        raise SystemExit("bench_decode.py needs a CUDA device (the Triton kernels run natively)")
    if a.precompile_only or a.jobs > 1:
        precompile(a.B, a.S, shape, max(1, a.jobs), variants)
        if a.precompile_only:
            return
    torch.manual_seed(0)
    tuning = common.base_tuning()
    result = {"hparams": HP, "shape": dict(HQ=a.HQ, H=a.H, dk=a.dk, dv=a.dv, dtype="bf16"), "layout": a.layout,
              "dense_available": common.print_dense_available(), "runs": []}
    if a.roofs:
        result["roofs"] = roofs(a.B, max(a.S), shape, a.reps)
    if a.sweep:  # first: choose the launch knobs per batch size at the largest S, then the table
        S, sweeps, best = max(a.S), {}, {}
        for B in a.B:
            c = make_cache(B, S, *shape, layout=a.layout)
            sweeps[B] = sweep(c, S, a.reps, tuning, variants)
            best[B] = pick_best(sweeps[B], variants)
            del c
            torch.cuda.empty_cache()
        lr = common.decode_large_rows(tuning)
        two = min(a.B) * a.H < lr <= max(a.B) * a.H   # the batch sizes span both regimes
        tuning = common.decode_choice(tuning, best[min(a.B)], best[max(a.B)] if two else None)
        result["sweep"] = {"S": S, "us": {str(B): v for B, v in sweeps.items()},
                           "chosen": {str(B): _key(v) for B, v in best.items()}}
        print(f"chosen: {result['sweep']['chosen']}", flush=True)
    if a.stages:
        for B in a.B:
            c = make_cache(B, max(a.S), *shape, layout=a.layout)
            result[f"stages_B{B}"] = st = stage_costs(c, max(a.S), a.reps, tuning)
            print(f"stages B={B} S={max(a.S)}: " + ", ".join(
                f"{k} {v['cold_us']:.1f}/{v['hot_us']:.1f}" for k, v in st.items()) + " us (cold/hot)", flush=True)
            del c
            torch.cuda.empty_cache()
    result["tuning"] = common.tuning_dict(tuning)["decode"]
    for B in a.B:
        c = make_cache(B, max(a.S), *shape, layout=a.layout)
        result[f"check_B{B}_S{max(a.S)}"] = chk = check_against_torch(c, max(a.S), tuning)
        print(f"check vs torch fp32 B={B} S={max(a.S)}: {chk}", flush=True)
        del c
        torch.cuda.empty_cache()
    rows = []
    for B in a.B:
        for S in a.S:
            c = make_cache(B, S, *shape, layout=a.layout)
            nsa = bench_nsa(c, S, a.reps, tuning)
            if nsa.pop("tuning_used") is not tuning:
                nsa["pdl"] = False
            dense = bench_dense(c, a.reps, a.dense)
            run = {"B": B, "S": S, "nsa": nsa, "dense": dense}
            if a.breakdown and S == max(a.S):
                run["breakdown"] = breakdown(c, S, tuning)
                print(f"  breakdown B={B} S={S}: {run['breakdown']}", flush=True)
            result["runs"].append(run)
            de, dg = dense["best"]["eager_cold_us"], dense["best"]["graph_cold_us"]
            rows.append([B, S, nsa["eager_cold_us"], nsa["graph_cold_us"], nsa["graph_hot_us"], de["us"],
                         de["backend"], dg["us"], de["us"] / nsa["graph_cold_us"], dg["us"] / nsa["graph_cold_us"],
                         de["us"] / nsa["eager_cold_us"]])
            print(f"B={B} S={S}: nsa {nsa} dense best {dense['best']}", flush=True)
            del c
            torch.cuda.empty_cache()
    print(f"\ndecode knobs: {dataclasses.asdict(tuning.decode)}")
    print("microseconds per decode step (median, cold L2); x = dense / NSA")
    common.print_table(["B", "S", "nsa eager", "nsa graph", "(hot)", "dense", "backend", "dense graph", "x graph",
                        "x vs dense graph", "x eager"], rows, [".1f"] * 8 + [".2f"] * 3)
    common.write_result(result, "decode", a)


if __name__ == "__main__":
    main()
