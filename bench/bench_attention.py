"""Benchmark: NSA attention op (Triton backend) vs the fastest dense causal SDPA, forward and
forward+backward, at paper sizes (l=32, d=16, l_sel=64, n_sel=16, w=512; B=1, HQ=64, H=4,
d_k=d_v=128, bf16). Times are medians of CUDA-event-timed iterations after warm-up. The NSA op
timed is nsa_attention_triton on precomputed q / k / v / compressed k~ v~ / gates (the layer's
projections and the compression MLP are excluded, as are the dense side's projections).

    python bench/bench_attention.py --T 8192 16384 32768 65536 [--breakdown 65536] [--decode]

Prints a table and writes bench/out/attention_<date>.json (and a copy under --copy-to, if given).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nsa.ops.common import num_cmp_tokens  # noqa: E402
from nsa.ops.triton import nsa_attention_triton  # noqa: E402

HP = dict(l=32, d=16, l_sel=64, n_sel=16, w=512)


def cuda_time(fn, warmup: int, iters: int) -> float:
    """Median milliseconds of fn() over iters, timed with CUDA events after warmup calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def t_args(doc: str, default_t=(8192, 65536)) -> argparse.ArgumentParser:
    """The command line shared by the per-T GPU scripts: --T (sequence lengths), --iters, --copy-to
    (also copy the JSON there); the caller adds its own flags. doc: the script's docstring."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--T", type=int, nargs="+", default=list(default_t))
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--copy-to", default=None, help="also copy the JSON into this directory")
    return ap


def save_json(result: dict, name: str, copy_to: str | None = None, out_dir: str | None = None) -> str:
    """Writes result to <out_dir or bench/out>/<name>_<date>.json (and a copy under copy_to); the path."""
    out_dir = out_dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}_{dt.date.today().isoformat()}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    if copy_to:
        os.makedirs(copy_to, exist_ok=True)
        shutil.copy(path, copy_to)
    print(f"wrote {path}")
    return path


def peak_mem(fn) -> float:
    """Peak GiB allocated during fn() above what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 30


def nsa_inputs(B, T, HQ, H, dk, dv, dtype=torch.bfloat16):
    N = num_cmp_tokens(T, HP["l"], HP["d"])
    r = lambda *s: torch.randn(*s, device="cuda", dtype=dtype).requires_grad_()  # noqa: E731
    x = [r(B, T, HQ, dk), r(B, N, H, dk), r(B, N, H, dv), r(B, T, H, dk), r(B, T, H, dv),
         r(B, T, H, dk), r(B, T, H, dv)]
    x.append(torch.rand(B, T, HQ, 3, device="cuda", dtype=dtype).requires_grad_())
    return x


def bench_nsa(B, T, HQ, H, dk, dv, warmup, iters):
    x = nsa_inputs(B, T, HQ, H, dk, dv)
    do = torch.randn(B, T, HQ, dv, device="cuda", dtype=torch.bfloat16)

    def fwd():
        with torch.no_grad():
            return nsa_attention_triton(*x, **HP)

    def fwd_bwd():
        o, _ = nsa_attention_triton(*x, **HP)
        return torch.autograd.grad(o, x, do)

    res = {"fwd_ms": cuda_time(fwd, warmup, iters), "fwd_bwd_ms": cuda_time(fwd_bwd, warmup, iters)}
    res["fwd_mem_gib"] = peak_mem(fwd)
    res["fwd_bwd_mem_gib"] = peak_mem(fwd_bwd)
    return res


def _sdpa_backends():
    from torch.nn.attention import SDPBackend
    out = {}
    for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):  # "efficient" measured 3-4x slower on H200
        if hasattr(SDPBackend, name):
            out[name.split("_")[0].lower()] = getattr(SDPBackend, name)
    return out


def bench_dense(B, T, HQ, H, dk, dv, warmup, iters):
    """Fastest causal SDPA among cuDNN / flash / efficient, with enable_gqa or expanded K/V."""
    from torch.nn.attention import sdpa_kernel
    q = torch.randn(B, HQ, T, dk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, H, T, dk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, H, T, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(B, HQ, T, dv, device="cuda", dtype=torch.bfloat16)
    G = HQ // H
    tried = {}
    for bname, backend in _sdpa_backends().items():
        for gqa in (("enable_gqa", "expand") if bname == "cudnn" else ("enable_gqa",)):
            def call():
                with sdpa_kernel(backend):
                    if gqa == "enable_gqa":
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
                    return F.scaled_dot_product_attention(q, kk, vv, is_causal=True)

            def fwd():
                with torch.no_grad():
                    return call()

            def fwd_bwd():
                return torch.autograd.grad(call(), (q, k, v), do)

            key = f"{bname}/{gqa}"
            try:
                r = {"fwd_ms": cuda_time(fwd, warmup, iters), "fwd_bwd_ms": cuda_time(fwd_bwd, warmup, iters)}
                r["fwd_mem_gib"] = peak_mem(fwd)
                r["fwd_bwd_mem_gib"] = peak_mem(fwd_bwd)
                tried[key] = r
            except Exception as exc:  # noqa: BLE001 - a backend that refuses this shape is skipped
                tried[key] = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
    ok = {k: v for k, v in tried.items() if "error" not in v}
    best_f = min(ok, key=lambda k: ok[k]["fwd_ms"])
    best_fb = min(ok, key=lambda k: ok[k]["fwd_bwd_ms"])
    return {"fwd_ms": ok[best_f]["fwd_ms"], "fwd_backend": best_f, "fwd_mem_gib": ok[best_f]["fwd_mem_gib"],
            "fwd_bwd_ms": ok[best_fb]["fwd_bwd_ms"], "fwd_bwd_backend": best_fb,
            "fwd_bwd_mem_gib": ok[best_fb]["fwd_bwd_mem_gib"], "all": tried}


def breakdown(B, T, HQ, H, dk, dv, warmup, iters):
    """Per-stage times (ms) of the Triton NSA forward and backward."""
    from nsa.ops.triton import attn, function, scores, select
    q, kc, vc, ks, vs, kw, vw, g = [t.detach() for t in nsa_inputs(B, T, HQ, H, dk, dv)]
    sc = dk ** -0.5
    l, d, l_sel, n_sel, w = HP["l"], HP["d"], HP["l_sel"], HP["n_sel"], HP["w"]
    out = {}
    t = lambda name, fn: out.__setitem__(name, cuda_time(fn, warmup, iters))  # noqa: E731
    oc, lc = attn.attn_fwd(q, kc, vc, stride=d, offset=l - 1, window=0, scale=sc)
    t("cmp_fwd", lambda: attn.attn_fwd(q, kc, vc, stride=d, offset=l - 1, window=0, scale=sc))
    # "select": the fused scores + top-n the forward uses; the unfused pair for comparison
    bi = scores.select_blocks(q, kc, lc, l=l, d=d, l_sel=l_sel, n_sel=n_sel, scale=sc)
    t("select", lambda: scores.select_blocks(q, kc, lc, l=l, d=d, l_sel=l_sel, n_sel=n_sel, scale=sc))
    sc_old = select.block_scores(q, kc, lc, l=l, d=d, l_sel=l_sel, scale=sc)
    t("scores_unfused", lambda: select.block_scores(q, kc, lc, l=l, d=d, l_sel=l_sel, scale=sc))
    t("topn_unfused", lambda: select.select_topn(sc_old, G=HQ // H, l=l, d=d, l_sel=l_sel, n_sel=n_sel))
    os_, ls = select.slc_fwd(q, ks, vs, bi, l_sel=l_sel, scale=sc)
    t("slc_fwd", lambda: select.slc_fwd(q, ks, vs, bi, l_sel=l_sel, scale=sc))
    ow, lw = attn.attn_fwd(q, kw, vw, stride=1, offset=0, window=w, scale=sc)
    t("win_fwd", lambda: attn.attn_fwd(q, kw, vw, stride=1, offset=0, window=w, scale=sc))
    t("combine", lambda: function.combine(oc, os_, ow, g))
    do = torch.randn_like(oc)
    dg, _ = function.gate_grads(do, oc, os_, ow)
    t("gate_bwd", lambda: function.gate_grads(do, oc, os_, ow))
    delta = dg[..., 0].contiguous()
    t("cmp_bwd", lambda: attn.attn_bwd(q, kc, vc, do, lc, delta, g[..., 0], stride=d, offset=l - 1,
                                       window=0, scale=sc))
    t("slc_invert", lambda: select.invert_selection(bi, l_sel, 1024))
    t("slc_bwd", lambda: select.slc_bwd(q, ks, vs, bi, do, ls, delta, g[..., 1], l_sel=l_sel, scale=sc))
    t("win_bwd", lambda: attn.attn_bwd(q, kw, vw, do, lw, delta, g[..., 2], stride=1, offset=0, window=w,
                                       scale=sc))
    return out


SWEEP = {
    "attn.FWD_TILE": [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 2)],
    "attn.DQ_TILE": [(128, 32, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3)],
    "attn.DKDV_TILE": [(32, 128, 8, 3), (32, 128, 4, 3), (64, 128, 8, 3), (32, 64, 4, 3), (16, 128, 4, 3)],
    "select.SLC_WARPS": [(4, 4, 4), (2, 4, 4), (1, 4, 4), (2, 2, 4), (2, 2, 2), (4, 4, 2), (4, 2, 4)],
    "select.SLC_DKDV_ROWS": [16, 32, 64],
    "select.SLC_STAGES": [(2, 2, 2), (3, 3, 2), (4, 4, 2), (1, 1, 2)],
    "select.SLC_BS": [(64, 64), (32, 32), (32, 64), (64, 32), (16, 16)],
    "scores.SCORE_TILE": [(256, 64, 8, 3, 0, 2), (128, 64, 8, 2, 2, 2), (256, 128, 8, 3, 0, 2),
                          (128, 128, 8, 3, 2, 2), (256, 128, 8, 2, 0, 2), (512, 64, 8, 3, 0, 2)],
}


def sweep(B, T, HQ, H, dk, dv, warmup, iters, only: str = ""):
    """Times the stages a tile setting affects, for each candidate in SWEEP whose key starts with
    `only` (ms). The backward calls pass the gates as the op does (a gated dO changes the kernels)."""
    from nsa.ops.triton import attn, scores, select
    mods = {"attn": attn, "select": select, "scores": scores}
    q, kc, vc, ks, vs, kw, vw, g = [t.detach() for t in nsa_inputs(B, T, HQ, H, dk, dv)]
    sc = dk ** -0.5
    l, d, l_sel, n_sel, w = HP["l"], HP["d"], HP["l_sel"], HP["n_sel"], HP["w"]
    oc, lc = attn.attn_fwd(q, kc, vc, stride=d, offset=l - 1, window=0, scale=sc)
    ow, lw = attn.attn_fwd(q, kw, vw, stride=1, offset=0, window=w, scale=sc)
    bi = select.select_topn(select.block_scores(q, kc, lc, l=l, d=d, l_sel=l_sel, scale=sc), G=HQ // H,
                            l=l, d=d, l_sel=l_sel, n_sel=n_sel)
    os_, ls = select.slc_fwd(q, ks, vs, bi, l_sel=l_sel, scale=sc)
    do = torch.randn_like(oc)
    delta = (do.float() * oc.float()).sum(-1)
    stages = {
        "attn.FWD_TILE": {
            "cmp_fwd": lambda: attn.attn_fwd(q, kc, vc, stride=d, offset=l - 1, window=0, scale=sc),
            "win_fwd": lambda: attn.attn_fwd(q, kw, vw, stride=1, offset=0, window=w, scale=sc)},
        "attn.DQ_TILE": {
            "cmp_bwd": lambda: attn.attn_bwd(q, kc, vc, do, lc, delta, g[..., 0], stride=d, offset=l - 1,
                                             window=0, scale=sc),
            "win_bwd": lambda: attn.attn_bwd(q, kw, vw, do, lw, delta, g[..., 2], stride=1, offset=0, window=w,
                                             scale=sc)},
        "select.SLC_WARPS": {
            "slc_fwd": lambda: select.slc_fwd(q, ks, vs, bi, l_sel=l_sel, scale=sc),
            "slc_bwd": lambda: select.slc_bwd(q, ks, vs, bi, do, ls, delta, g[..., 1], l_sel=l_sel, scale=sc)},
    }
    stages["scores.SCORE_TILE"] = {
        "select": lambda: scores.select_blocks(q, kc, lc, l=l, d=d, l_sel=l_sel, n_sel=n_sel, scale=sc)}
    stages["attn.DKDV_TILE"] = stages["attn.DQ_TILE"]
    stages["select.SLC_DKDV_ROWS"] = {"slc_bwd": stages["select.SLC_WARPS"]["slc_bwd"]}
    stages["select.SLC_STAGES"] = stages["select.SLC_WARPS"]
    stages["select.SLC_BS"] = stages["select.SLC_WARPS"]
    out = {}
    for key, cands in SWEEP.items():
        if not key.startswith(only):
            continue
        mod, name = key.split(".")
        orig = getattr(mods[mod], name)
        for cand in cands:
            setattr(mods[mod], name, cand)
            try:
                out[f"{key}={cand}"] = {st: round(cuda_time(fn, warmup, iters), 3) for st, fn in stages[key].items()}
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory for this tile
                out[f"{key}={cand}"] = {"error": f"{type(exc).__name__}: {str(exc)[:100]}"}
            print(f"sweep T={T} {key}={cand}: {out[f'{key}={cand}']}", flush=True)
        setattr(mods[mod], name, orig)
    return out


def bench_decode(B, S, HQ, H, dk, dv, warmup, iters):
    """One query token at context S: NSA decode (nsa.ops.nsa_decode, torch backend) vs dense SDPA."""
    from nsa.ops import nsa_decode
    l, d, w = HP["l"], HP["d"], HP["w"]
    N = num_cmp_tokens(S, l, d)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(B, 1, HQ, dk, **bf)
    kc, vc = torch.randn(B, N, H, dk, **bf), torch.randn(B, N, H, dv, **bf)
    ks, vs = torch.randn(B, S, H, dk, **bf), torch.randn(B, S, H, dv, **bf)
    wp0 = S - w
    kw, vw = torch.randn(B, w, H, dk, **bf), torch.randn(B, w, H, dv, **bf)
    g = torch.rand(B, 1, HQ, 3, **bf)
    res = {}
    with torch.no_grad():
        def nsa():
            return nsa_decode(q, kc, vc, ks, vs, kw, vw, g, pos0=S - 1, win_pos0=wp0, **HP, backend="torch")
        res["nsa_torch_ms"] = cuda_time(nsa, warmup, iters)
        qd = q.transpose(1, 2)
        kd, vd = ks.transpose(1, 2), vs.transpose(1, 2)

        def dense():
            return F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)
        res["dense_ms"] = cuda_time(dense, warmup, iters)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--HQ", type=int, default=64)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--breakdown", type=int, nargs="*", default=[], help="T values for per-stage times")
    ap.add_argument("--sweep", type=int, nargs="*", default=[], help="T values for the tile-config sweep")
    ap.add_argument("--sweep-only", default="", help="sweep only the SWEEP keys with this prefix")
    ap.add_argument("--no-peers", action="store_true", help="skip peer implementations (fla-core)")
    ap.add_argument("--decode", action="store_true", help="also time a decode step at 64k (B=1, 16)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    ap.add_argument("--copy-to", default=None, help="also copy the JSON into this directory")
    a = ap.parse_args()
    torch.manual_seed(0)
    dims = (a.B, a.HQ, a.H, a.dk, a.dv)
    rows, result = [], {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                        "date": dt.datetime.now().isoformat(timespec="seconds"), "hparams": HP,
                        "shape": dict(zip(("B", "HQ", "H", "dk", "dv"), dims)), "T": {}}
    import triton
    result["triton"] = triton.__version__
    for T in a.T:
        nsa = bench_nsa(a.B, T, *dims[1:], a.warmup, a.iters)
        torch.cuda.empty_cache()
        dense = bench_dense(a.B, T, *dims[1:], a.warmup, a.iters)
        torch.cuda.empty_cache()
        rf, rfb = dense["fwd_ms"] / nsa["fwd_ms"], dense["fwd_bwd_ms"] / nsa["fwd_bwd_ms"]
        result["T"][T] = {"nsa": nsa, "dense": dense, "speedup_fwd": rf, "speedup_fwd_bwd": rfb}
        if not a.no_peers:   # fla-core when importable: same shapes, ratios to dense and to ours
            from peers import time_fla
            fla = time_fla(a.B, T, *dims[1:], HP["n_sel"], HP["l_sel"], cuda_time, a.warmup, a.iters)
            torch.cuda.empty_cache()
            if "fwd_ms" in fla:
                fla.update(speedup_fwd=dense["fwd_ms"] / fla["fwd_ms"],
                           speedup_fwd_bwd=dense["fwd_bwd_ms"] / fla["fwd_bwd_ms"],
                           ours_vs_fla_fwd=fla["fwd_ms"] / nsa["fwd_ms"],
                           ours_vs_fla_fwd_bwd=fla["fwd_bwd_ms"] / nsa["fwd_bwd_ms"])
            result["T"][T]["fla"] = fla
            print(f"T={T}: fla-core {fla}", flush=True)
        rows.append((T, nsa["fwd_ms"], dense["fwd_ms"], rf, nsa["fwd_bwd_ms"], dense["fwd_bwd_ms"], rfb,
                     nsa["fwd_bwd_mem_gib"], dense["fwd_bwd_mem_gib"], dense["fwd_backend"]))
        print(f"T={T}: nsa {nsa} dense fwd {dense['fwd_ms']:.2f} fwd+bwd {dense['fwd_bwd_ms']:.2f}", flush=True)
    for T in a.breakdown:
        result.setdefault("breakdown", {})[T] = breakdown(a.B, T, *dims[1:], a.warmup, a.iters)
        print(f"breakdown T={T}: " + " ".join(f"{k}={v:.2f}" for k, v in result["breakdown"][T].items()),
              flush=True)
    for T in a.sweep:
        result.setdefault("sweep", {})[T] = sweep(a.B, T, *dims[1:], 1, 3, a.sweep_only)
    if a.decode:
        for B in (1, 16):
            try:
                result.setdefault("decode", {})[B] = bench_decode(B, 65536, *dims[1:], a.warmup, a.iters)
            except Exception as exc:  # noqa: BLE001 - report and continue
                result.setdefault("decode", {})[B] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
            print(f"decode B={B} S=65536: {result['decode'][B]}", flush=True)
    path = save_json(result, "attention", a.copy_to, a.out)
    print(f"\n{result['device']}  torch {result['torch']}  triton {result['triton']}  B,HQ,H,dk,dv={dims}")
    print(f"{'T':>6} {'nsa fwd':>9} {'dense fwd':>9} {'x':>6} {'nsa f+b':>9} {'dense f+b':>9} {'x':>6} "
          f"{'nsa GiB':>8} {'dense GiB':>9}  dense backend")
    for r in rows:
        print(f"{r[0]:>6} {r[1]:>9.2f} {r[2]:>9.2f} {r[3]:>6.2f} {r[4]:>9.2f} {r[5]:>9.2f} {r[6]:>6.2f} "
              f"{r[7]:>8.2f} {r[8]:>9.2f}  {r[9]}")
    peer_rows = [(T, v["fla"]) for T, v in result["T"].items() if "fwd_ms" in v.get("fla", {})]
    if peer_rows:
        print(f"\nfla-core parallel_nsa (compression + selection, mean-pooled compression):")
        print(f"{'T':>6} {'fla fwd':>9} {'x dense':>8} {'ours x':>7} {'fla f+b':>9} {'x dense':>8} {'ours x':>7}")
        for T, f in peer_rows:
            print(f"{T:>6} {f['fwd_ms']:>9.2f} {f['speedup_fwd']:>8.2f} {f['ours_vs_fla_fwd']:>7.2f} "
                  f"{f['fwd_bwd_ms']:>9.2f} {f['speedup_fwd_bwd']:>8.2f} {f['ours_vs_fla_fwd_bwd']:>7.2f}")
    else:
        first = next(iter(result["T"].values()), {}).get("fla", {})
        print(f"\nfla-core not timed: {first.get('why') or first.get('skipped') or first.get('error') or 'skipped'}")


if __name__ == "__main__":
    main()
