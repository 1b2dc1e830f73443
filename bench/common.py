"""Shared pieces of the benchmark scripts: timers, the dense baselines, peers, inputs, result files, and
the one adapter to the kernel tuning API.

Scripts in bench/ import this as `import common` (the running script's folder is on sys.path); `nsa`
comes from the installed package or PYTHONPATH. Nothing here needs a GPU at import time, so every
script's `--help` works on a CPU-only machine.

Results: each script writes bench/out/<name>_<UTC stamp>.json (git-ignored); `--save` also copies it
to bench/results/<name>.json (the one current file per benchmark that bench/RESULTS.md cites);
`--copy-to DIR` (default $OUT, what the device harness collects) copies it there too.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime as dt
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

# the selection locality tables, for the bench scripts (common.locality, ...)
from nsa.ops.locality import (GROUP_WINDOWS, KEY_LOCALITY_KB, LOCALITY_M, group_locality,  # noqa: F401
                              key_locality, locality, mean_locality)

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
OUT_DIR = BENCH / "out"
RESULTS_DIR = BENCH / "results"
# paper sizes (docs/nsa.md): compression block l, stride d, selection block l_sel, n_sel blocks, window w
HP = dict(l=32, d=16, l_sel=64, n_sel=16, w=512)
SHAPE = dict(B=1, HQ=64, H=4, dk=128, dv=128)   # the op benchmarks' default heads and head dims (bf16)


# ----------------------------------------------------------------------------------------- timing
def has_cuda() -> bool:
    return torch.cuda.is_available()


def device_name() -> str:
    return torch.cuda.get_device_name() if has_cuda() else f"cpu ({os.cpu_count()} cores)"


def sync() -> None:
    if has_cuda():
        torch.cuda.synchronize()  # sync-ok: benchmark timing only


_FLUSH: torch.Tensor | None = None


def flush_l2() -> None:
    """Evict the GPU's L2 (a 512 MiB write), as other layers would between two calls of this one."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(512 * 2 ** 20, dtype=torch.uint8, device="cuda")
    _FLUSH.fill_(1)


# how gpu_time runs fn on CUDA: "eager" (each call launches its kernels from Python, so host time shows
# wherever the GPU waits for it) or "graph" (fn captured once in a CUDA graph and replayed: device time
# plus launch gaps, what a CUDA-graphed training step sees). Set per process by a benchmark's --timer.
TIMER = {"mode": "eager"}


def set_timer(mode: str) -> None:
    if mode not in ("eager", "graph"):
        raise SystemExit(f"--timer must be eager or graph, got {mode!r}")
    TIMER["mode"] = mode


def gpu_time(fn: Callable[[], Any], warmup: int = 2, iters: int = 5, *, inner: int = 1,
             flush: bool = False, sync_each: bool = True) -> float:
    """Median milliseconds of one fn() call. CUDA: CUDA events around `inner` back-to-back calls per
    sample (iters samples after warmup calls); flush=True evicts L2 before each sample; sync_each=False
    records every sample's events first and syncs once (the host may run ahead, as in a model); under
    TIMER "graph" the calls are replays of fn captured once (a capture failure is printed and times
    fn eagerly). Off CUDA: wall-clock time (perf_counter) of the same loop."""
    for _ in range(warmup):
        fn()
    if has_cuda() and TIMER["mode"] == "graph":
        try:
            fn = graphed(fn)
        except Exception as exc:  # noqa: BLE001 - e.g. a host sync inside fn: the eager figure instead
            torch.cuda.synchronize()
            print(f"graph capture failed ({error_text(exc, 100)}); timing eager calls", flush=True)
    sync()
    if not has_cuda():
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / inner)
        return statistics.median(times)
    pairs = []
    for _ in range(iters):
        if flush:
            flush_l2()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        pairs.append((a, b))
        if sync_each:
            torch.cuda.synchronize()  # sync-ok: benchmark timing only
    sync()
    return statistics.median(a.elapsed_time(b) for a, b in pairs) / inner


def peak_mem_gib(fn: Callable[[], Any]) -> float:
    """Peak GiB allocated during fn() above what was allocated before it (CUDA; nan elsewhere)."""
    if not has_cuda():
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 30


def graphed(fn: Callable[[], Any]) -> Callable[[], None]:
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


def error_text(exc: BaseException, n: int = 160) -> str:
    return f"{type(exc).__name__}: {str(exc)[:n]}"


# ----------------------------------------------------------------------------------------- dense baselines
def _first(r):
    return r[0] if isinstance(r, tuple) else r


def dense_available() -> dict[str, str]:
    """Which dense attention implementations this machine has: the SDPA backends torch knows, and
    FlashAttention-4 (flash_attn.cute) / FlashAttention-2 (flash_attn) when importable ({name: note})."""
    out = {}
    try:
        from torch.nn.attention import SDPBackend
        for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"):
            if hasattr(SDPBackend, name):
                out[f"sdpa-{name.split('_')[0].lower()}"] = "torch SDPA"
    except ImportError:
        pass
    for name, mod in (("fa4", "flash_attn.cute"), ("fa2", "flash_attn")):
        try:
            m = __import__(mod, fromlist=["flash_attn_func"])
            getattr(m, "flash_attn_func")
            import flash_attn
            out[name] = f"{mod} {getattr(flash_attn, '__version__', '?')}"
        except Exception:  # noqa: BLE001 - not installed / no kernel for this GPU: not a baseline here
            pass
    return out


def dense_candidates(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                     only: list[str] | None = None) -> dict[str, Callable[[], torch.Tensor]]:
    """{name: fn() -> o [B, T, HQ, dv]} for every available dense implementation (restricted to the
    names in `only`, matched by prefix). q [B, T, HQ, dk], k/v [B, S, H, d], grouped-query (HQ = G*H).
    Each runs through the library's own dense op (nsa.ops.flash.dense_attention, the dense twin's), so the
    bar is what the model would run. The cuDNN backend is also tried with K/V expanded to HQ heads
    ("sdpa-cudnn/expand"), which it ran faster than its own GQA path on some shapes."""
    from nsa.ops.flash import dense_attention
    avail = dense_available()
    G = q.shape[2] // k.shape[2]
    out: dict[str, Callable[[], torch.Tensor]] = {}
    for name in avail:   # bench names: sdpa-cudnn, ..., fa4, fa2 -> the op's sdpa_cudnn, ..., fa4, fa2
        out[name] = (lambda be=name.replace("-", "_"): dense_attention(q, k, v, causal=causal, backend=be))
        if name == "sdpa-cudnn" and causal:
            out["sdpa-cudnn/expand"] = lambda: dense_attention(q, k.repeat_interleave(G, 2), v.repeat_interleave(G, 2),
                                                               causal=causal, backend="sdpa_cudnn")
    if only:
        out = {n: f for n, f in out.items() if any(n.startswith(p) for p in only)}
    return out


def time_dense(B: int, T: int, HQ: int, H: int, dk: int, dv: int, warmup: int, iters: int,
               only: list[str] | None = None) -> dict[str, Any]:
    """Causal dense attention at these shapes (bf16), forward and forward+backward, every candidate of
    dense_candidates; the fastest of each is "best dense" (its name in fwd_backend / fwd_bwd_backend)."""
    bf = dict(device="cuda", dtype=torch.bfloat16)
    # [B, H, T, d] storage (SDPA's layout), handed over as [B, T, H, d] views
    q = torch.randn(B, HQ, T, dk, **bf).transpose(1, 2).requires_grad_()
    k = torch.randn(B, H, T, dk, **bf).transpose(1, 2).requires_grad_()
    v = torch.randn(B, H, T, dv, **bf).transpose(1, 2).requires_grad_()
    do = torch.randn(B, T, HQ, dv, **bf)
    tried: dict[str, dict] = {}
    for name, call in dense_candidates(q, k, v, causal=True, only=only).items():
        def fwd(call=call):
            with torch.no_grad():
                return call()

        def fwd_bwd(call=call):
            return torch.autograd.grad(call(), (q, k, v), do)

        try:
            r = {"fwd_ms": gpu_time(fwd, warmup, iters), "fwd_bwd_ms": gpu_time(fwd_bwd, warmup, iters)}
            r["fwd_mem_gib"], r["fwd_bwd_mem_gib"] = peak_mem_gib(fwd), peak_mem_gib(fwd_bwd)
            tried[name] = r
        except Exception as exc:  # noqa: BLE001 - a backend that refuses this shape (or runs out of memory)
            tried[name] = {"error": error_text(exc, 120)}
        torch.cuda.empty_cache()
    ok = {n: r for n, r in tried.items() if "error" not in r}
    if not ok:
        return {"error": "no dense implementation ran", "all": tried}
    bf_, bfb = min(ok, key=lambda n: ok[n]["fwd_ms"]), min(ok, key=lambda n: ok[n]["fwd_bwd_ms"])
    return {"fwd_ms": ok[bf_]["fwd_ms"], "fwd_backend": bf_, "fwd_mem_gib": ok[bf_]["fwd_mem_gib"],
            "fwd_bwd_ms": ok[bfb]["fwd_bwd_ms"], "fwd_bwd_backend": bfb,
            "fwd_bwd_mem_gib": ok[bfb]["fwd_bwd_mem_gib"], "all": tried}


def print_dense_available() -> dict[str, str]:
    avail = dense_available()
    print("dense baselines here: " + (", ".join(f"{n} ({v})" for n, v in avail.items()) or "none"), flush=True)
    return avail


# ----------------------------------------------------------------------------------------- peers
def fla_available() -> tuple[bool, str]:
    """fla-core (`fla.ops.nsa.parallel_nsa`, pip package fla-core): compression + selection (+ an
    optional window), mean-pooled compression with block = l_sel, G = HQ/H a power of two >= 16. On a
    GPU machine without network, carry its wheel (and einops), e.g. `.whl/fla_core-*.whl`."""
    try:
        from fla.ops.nsa import parallel_nsa  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not timed"
        return False, error_text(exc, 120)
    import fla
    return True, f"fla-core {getattr(fla, '__version__', '?')}"


def time_fla(B: int, T: int, HQ: int, H: int, dk: int, dv: int, n_sel: int, l_sel: int, warmup: int,
             iters: int, window: int = 0) -> dict[str, Any]:
    """fwd and fwd+bwd ms of fla's parallel_nsa (compression + selection; + window if window > 0)."""
    ok, why = fla_available()
    if not ok:
        return {"available": False, "why": why}
    from fla.ops.nsa import parallel_nsa
    G = HQ // H
    if G < 16 or G & (G - 1):
        return {"available": True, "version": why, "skipped": f"G={G}: fla needs a power of two >= 16"}
    dev, dt_ = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, T, HQ, dk, device=dev, dtype=dt_, generator=gen, requires_grad=True)
    k = torch.randn(B, T, H, dk, device=dev, dtype=dt_, generator=gen, requires_grad=True)
    v = torch.randn(B, T, H, dv, device=dev, dtype=dt_, generator=gen, requires_grad=True)
    gates = [torch.rand(B, T, HQ, device=dev, dtype=dt_, generator=gen).requires_grad_() for _ in range(3)]
    g_swa = gates[2] if window > 0 else None
    do = torch.randn(B, T, HQ, dv, device=dev, dtype=dt_, generator=gen)

    def call():
        return parallel_nsa(q, k, v, gates[0], gates[1], g_swa, block_counts=n_sel, block_size=l_sel,
                            window_size=window)

    def fwd():
        with torch.no_grad():
            return call()

    def fwd_bwd():
        call().backward(do)

    try:
        return {"available": True, "version": why, "window": window,
                "fwd_ms": gpu_time(fwd, warmup, iters), "fwd_bwd_ms": gpu_time(fwd_bwd, warmup, iters)}
    except Exception as exc:  # noqa: BLE001 - a peer failing must not lose our own numbers
        return {"available": True, "version": why, "error": error_text(exc, 200)}


# ----------------------------------------------------------------------------------------- inputs
def nsa_inputs(B: int, T: int, HQ: int, H: int, dk: int, dv: int, dtype=torch.bfloat16,
               grad: bool = True) -> list[torch.Tensor]:
    """The NSA op's inputs at T (CUDA): q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates."""
    from nsa.ops.common import num_cmp_tokens
    N = num_cmp_tokens(T, HP["l"], HP["d"])
    r = lambda *s: torch.randn(*s, device="cuda", dtype=dtype).requires_grad_(grad)  # noqa: E731
    x = [r(B, T, HQ, dk), r(B, N, H, dk), r(B, N, H, dv), r(B, T, H, dk), r(B, T, H, dv),
         r(B, T, H, dk), r(B, T, H, dv)]
    x.append(torch.rand(B, T, HQ, 3, device="cuda", dtype=dtype).requires_grad_(grad))
    return x


# ----------------------------------------------------------------------------------------- captured inputs
# bench/capture_inputs.py writes <dir>/meta.json and one <dir>/T<T>_L<layer>.pt per capture: a dict of the
# op's inputs (CAPTURE_NAMES, as the layer passed them) plus its block_idx [B, T, H, n_sel] and output o.
CAPTURE_NAMES = ("q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates")


def capture_file(T: int, layer: int) -> str:
    return f"T{T}_L{layer}.pt"


def read_captures(directory: str | os.PathLike) -> dict[str, Any]:
    """meta.json of a capture folder (written by bench/capture_inputs.py); one clear error if absent."""
    path = Path(directory) / "meta.json"
    if not path.is_file():
        raise SystemExit(f"--inputs captured:{directory}: no meta.json there; create it with "
                         f"python bench/capture_inputs.py --out {directory}")
    return json.loads(path.read_text())


def load_capture(directory: str | os.PathLike, entry: dict[str, Any], device: str = "cuda",
                 grad: bool = True) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(the op's eight inputs on `device`, leaf tensors with requires_grad=grad; block_idx) of one
    meta.json capture entry."""
    saved = torch.load(Path(directory) / entry["file"], map_location=device, weights_only=True)
    x = [saved[n].detach().contiguous().requires_grad_(grad) for n in CAPTURE_NAMES]
    return x, saved["block_idx"]


def check_inputs(inputs: str) -> None:
    """--inputs: random, or captured:DIR (a bench/capture_inputs.py folder); else one clear exit."""
    if inputs != "random" and not (inputs.startswith("captured:") and len(inputs) > 9):
        raise SystemExit(f"--inputs {inputs!r}: use random or captured:DIR (a bench/capture_inputs.py folder)")


def capture_case(directory: str | os.PathLike, entry: dict[str, Any]):
    """(inputs, block_idx, hp, (B, HQ, H, dk, dv)) of one capture entry, on CUDA when present: what the
    benchmarks run the op on (load_capture's tensors, the capture's hyperparameters and shapes)."""
    x, bi = load_capture(directory, entry, device="cuda" if has_cuda() else "cpu")
    B, _, HQ, dk = x[0].shape
    return x, bi, {k: entry["op"][k] for k in HP}, (B, HQ, x[4].shape[2], dk, x[4].shape[3])


def print_locality(rows: dict[str, dict[int, float]], title: str, keys: bool = False, group: bool = False) -> None:
    """rows {label: locality table}: the issue's table (fraction of m x n_sel blocks per m), or with keys
    key_locality's (q / dO rows of key tiles of kb blocks per (token, block) pair), or with group
    group_locality's (m = 4 tiles regrouped within windows of W)."""
    ms = sorted({m for r in rows.values() for m in r})
    what = ("distinct (token, tile of kb consecutive blocks) / (token, block) pairs" if keys
            else "union of 4 tokens' selections / (4 x n_sel), the 4 grouped within windows of W (tile.group)"
            if group else "union of m consecutive tokens' selections / (m x n_sel)")
    print(f"\n{title}: {what}, second half of the sequence")
    name = "kb" if keys else "W" if group else "m"
    print_table(["inputs"] + [f"{name}={m}" for m in ms], [[k] + [r.get(m, "-") for m in ms] for k, r in rows.items()])


# ----------------------------------------------------------------------------------------- kernel tuning
# Every use of nsa.ops.tuning by the benchmarks is in this section, so an API rename touches one place.
def base_tuning(device: str = "cuda"):
    """The KernelTuning the kernel policy would pick on this device."""
    from nsa.ops.tuning import tuning_for
    return tuning_for(device)


def attn_tile(rows: int, keys: int, warps: int, stages: int):
    """A compressed / window attention tile (nsa.ops.tuning.Tile)."""
    from nsa.ops.tuning import Tile
    return Tile(rows, keys, warps, stages)


def score_tile(*fields: int, max_regs: int | None = None):
    """A fused-selection tile (nsa.ops.tuning.ScoreTile): rows, min keys, warps, stages, two map kinds,
    and a register cap (None: the compiler's choice)."""
    from nsa.ops.tuning import ScoreTile
    return ScoreTile(*fields, max_regs=max_regs)


def parse_changes(items: list[str]) -> dict:
    """["select.loop=block", "scores.tile=ScoreTile(128,64,8,2,2,2)"] -> {dotted field: value}: a value
    is a Python expression over literals and nsa.ops.tuning's classes (true / false as in YAML), else the
    plain string."""
    from nsa.ops import tuning as names
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--tuning takes FIELD=VALUE (e.g. select.loop=block), got {item!r}")
        if raw.strip().lower() in ("true", "false"):
            out[key] = raw.strip().lower() == "true"
            continue
        try:
            tree = ast.parse(raw, mode="eval")
            calls_ok = all(isinstance(n.func, ast.Name) for n in ast.walk(tree) if isinstance(n, ast.Call))
            out[key] = eval(compile(tree, "<tuning>", "eval"), {"__builtins__": {}}, vars(names)) \
                if calls_ok else raw
        except (ValueError, SyntaxError, NameError, TypeError):
            out[key] = raw
    return out


def changed_tuning(items: list[str], base=None):
    """The device preset (or base) with FIELD=VALUE items applied (parse_changes); None without items."""
    if not items:
        return None
    return tuning_variant(base_tuning() if base is None else base, parse_changes(items))


def tuning_variant(base, changes: dict[str, Any]):
    """base with dotted fields replaced, e.g. {"select.fwd_warps": 4, "attn.fwd": Tile(...)}; each level
    is rebuilt with dataclasses.replace (the configs are frozen; nothing is patched)."""
    def put(obj, path: list[str], value):
        if len(path) == 1:
            return dataclasses.replace(obj, **{path[0]: value})
        return dataclasses.replace(obj, **{path[0]: put(getattr(obj, path[0]), path[1:], value)})
    out = base
    for key, value in changes.items():
        out = put(out, key.split("."), value)
    return out


def tile_m_variant(base, m: int):
    """base with the selection on query tiles of m tokens at every G (nsa.ops.tuning.TileTuning.m,
    min_g=1; m=1: per token); m=0: base itself (the preset's own tile policy)."""
    if m == 0:
        return base
    return tuning_variant(base, {"tile.m": m, "tile.min_g": 1})


def flash_variant(base, spec: str):
    """base with NSA branches on flash-attn as nsa.flash_branches spells them (FlashBranchTuning.parse):
    "off" or "+"-joined branches ("win", "cmp", "win+cmp"), each in mode "auto" from T = 0."""
    from nsa.ops.tuning import FlashBranchTuning
    return tuning_variant(base, {"flash": FlashBranchTuning.parse(spec) or base.flash})


def flash_installed_names() -> list[str]:
    """The flash-attn backends (fa4, fa2) that import and may run on this GPU (nsa.ops.flash's rules)."""
    from nsa.ops import flash
    dev = torch.device("cuda")
    return [n for n in flash.FLASH_BACKENDS if flash.ineligible(n, dev, torch.bfloat16, 64, True) is None]


def tuning_dict(tuning) -> dict[str, Any]:
    return dataclasses.asdict(tuning)


def host_hotspots(x: list[torch.Tensor], calls: int = 3, top: int = 12) -> list[dict[str, Any]]:
    """The host functions that cost most own time over `calls` eager forward+backward calls of the op on x
    (cProfile; ms per call): what a cached per-shape plan and a short launch sequence have to remove."""
    import cProfile
    import pstats
    for t in x:
        t.grad = None
    prof = cProfile.Profile()
    sync()
    prof.enable()
    for _ in range(calls):
        nsa_op(x)[0].float().sum().backward()
    prof.disable()
    sync()
    rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"fn": f"{Path(f[0]).name}:{f[1]}({f[2]})", "calls": v[1] / calls, "own_ms": 1e3 * v[2] / calls,
             "cum_ms": 1e3 * v[3] / calls} for f, v in rows]


def host_cost_rows(sizes: list[int], family: str) -> dict[str, Any]:
    """nsa.ops.host_cost.measure at the production shape per T, printed one line each (bench_cpu_layer --host-cost)."""
    from nsa.ops import host_cost
    rows = [host_cost.measure(T, family=family, calls=30) for T in sizes]
    for r in rows:
        r.pop("plan")
        print(f"T={r['T']} {family}: {r['ms']:.3f} ms (own Python {r['own_ms']:.3f}), {r['launches']} launches, "
              f"{sum(r['flash'].values())} flash calls, {r['torch_ops']} torch ops "
              f"({sum(r['compute_ops'].values())} running a kernel)", flush=True)
    return dict(meta=dict(shape=dict(host_cost.PROD), family=family, device="meta tensors, kernels as no-ops"), rows=rows)


def nsa_op(x: list[torch.Tensor], tuning=None, hp: dict[str, int] | None = None):
    """The NSA op on the Triton backend, with `tuning` (a KernelTuning) or the policy's default, and the
    hyperparameters hp (l, d, l_sel, n_sel, w; default the paper's HP)."""
    from nsa.ops import nsa_attention
    kw = {} if tuning is None else {"tuning": tuning}
    return nsa_attention(*x, **(HP if hp is None else hp), backend="triton", **kw)


def decode_op(args: list[torch.Tensor], pos: torch.Tensor, win: torch.Tensor, tuning=None,
              launch_info: dict | None = None):
    """One decode step on the Triton launcher with device positions (the CUDA-graph form); tuning: a
    KernelTuning (its decode part is used) or None for the policy's default; launch_info: a dict that
    receives the compiled kernels (registers / spills)."""
    from nsa.ops.triton import decode as tdec
    kw = {} if tuning is None else {"tuning": tuning.decode}
    if launch_info is not None:
        kw["launch_info"] = launch_info
    return tdec.nsa_decode_triton(*args, pos0=pos, win_pos0=win, scale=args[0].shape[-1] ** -0.5, **HP, **kw)


def decode_eager_op(args: list[torch.Tensor], pos0: int, win_pos0: int, tuning=None):
    """One decode step through the public op (host-int positions, validation included)."""
    from nsa.ops import nsa_decode
    kw = {} if tuning is None else {"tuning": tuning}
    return nsa_decode(*args, pos0=pos0, win_pos0=win_pos0, **HP, backend="triton", **kw)


def decode_knobs_variant(base, **fields):
    """base (KernelTuning) with these DecodeKnobs fields set in both batch regimes."""
    return base.replace(decode=base.decode.with_knobs(**fields))


def decode_sweep_variant(base, fields: dict[str, Any]):
    """base whose decode knobs are, in both regimes, the small-batch defaults with `fields` changed:
    one candidate of a decode sweep, the same at every batch size."""
    knobs = dataclasses.replace(base.decode.small, **fields)
    return base.replace(decode=dataclasses.replace(base.decode, small=knobs, large=knobs))


def decode_choice(base, small: dict[str, Any], large: dict[str, Any] | None):
    """base with the decode knobs a sweep chose: `small` (changes to the small-batch defaults) below
    large_rows, `large` (changes to the same defaults) from it; large=None: one regime for all."""
    s = dataclasses.replace(base.decode.small, **small)
    lg = s if large is None else dataclasses.replace(base.decode.small, **large)
    return base.replace(decode=dataclasses.replace(base.decode, small=s, large=lg))


def decode_large_rows(base) -> int:
    return base.decode.large_rows


def select_blocks_op(q, kc, lse, scale: float, tuning=None):
    """The fused scores + top-n kernel alone, with tuning.scores (or the default tile)."""
    from nsa.ops.triton import scores
    kw = {} if tuning is None else {"tuning": tuning.scores, "relayout": tuning.scores.relayout}
    return scores.select_blocks(q, kc, lse, l=HP["l"], d=HP["d"], l_sel=HP["l_sel"], n_sel=HP["n_sel"],
                                scale=scale, **kw)


# ----------------------------------------------------------------------------------------- CLI and results
def t_args(doc: str, default_t=(8192, 16384, 32768, 65536), t_flag: str = "--T",
           timing: bool = True) -> argparse.ArgumentParser:
    """The command line the GPU scripts share: sequence lengths, warm-up and timed iterations, the shape,
    and where the JSON goes (--out, --save, --copy-to); the caller adds its own flags."""
    ap = argparse.ArgumentParser(description=doc.strip().split("\n")[0], epilog=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(t_flag, type=int, nargs="+", default=list(default_t), help="sequence lengths / contexts")
    for k, v in SHAPE.items():
        if k != "B":
            ap.add_argument(f"--{k}", type=int, default=v)
    if timing:
        ap.add_argument("--warmup", type=int, default=2, help="untimed calls first")
        ap.add_argument("--iters", type=int, default=5, help="timed calls (the median is reported)")
    result_args(ap)
    return ap


def result_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default=str(OUT_DIR), help="folder for the JSON (default bench/out, git-ignored)")
    ap.add_argument("--save", action="store_true",
                    help="also copy the JSON to bench/results/<name>.json (the file bench/RESULTS.md cites)")
    ap.add_argument("--copy-to", default=os.environ.get("OUT"), help="also copy the JSON here (default $OUT)")


def metadata() -> dict[str, Any]:
    """Device, versions, UTC date and the command line, for every result file."""
    meta = {"device": device_name(), "torch": torch.__version__,
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python", os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])}
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    return meta


def write_result(result: dict, name: str, args: argparse.Namespace) -> Path:
    """Writes {**metadata(), **result} to <args.out>/<name>_<UTC stamp>.json, copies it to
    bench/results/<name>.json with args.save and into args.copy_to (as <name>.json) if set; the path."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}_{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({**metadata(), **result}, indent=1, default=str))
    targets = ([RESULTS_DIR] if getattr(args, "save", False) else []) + \
        ([Path(args.copy_to)] if getattr(args, "copy_to", None) else [])
    for t in targets:
        t.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, t / f"{name}.json")
    print(f"wrote {path}" + "".join(f", {t / (name + '.json')}" for t in targets), flush=True)
    return path


def print_table(headers: list[str], rows: list[list[Any]], fmt: str | list[str] = ".2f") -> None:
    """A plain aligned table: floats with `fmt` (one for all columns, or one per column), the rest as str."""
    fmts = fmt if isinstance(fmt, list) else [fmt] * len(headers)
    cells = [[format(c, f) if isinstance(c, float) else str(c) for c, f in zip(r, fmts)] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
