"""Op speed: the NSA attention op (Triton backend) against the best dense attention and fla-core, or one
branch of it against its alternative.

    python bench/bench_attention.py [--T 8192 16384 32768 65536] [--breakdown 65536] [--sweep 65536]
    python bench/bench_attention.py --branch window|cmp|select [--T ...]
    python bench/bench_attention.py --inputs captured:bench/captured --HQ 12 --H 2 --dk 64 --dv 64 --tile-m 1 2 4 8

Paper sizes (l=32, d=16, l_sel=64, n_sel=16, w=512; B=1, HQ=64, H=4, d_k=d_v=128, bf16); times are
medians of CUDA-event-timed calls after warm-up.

--branch op (default): the whole op on precomputed q / k / v / compressed k~ v~ / gates (the layer's
  projections and compression MLP excluded, as are the dense side's projections), forward and
  forward+backward, with peak memory, against every dense implementation present (SDPA cuDNN / flash /
  efficient / math, FlashAttention-4 and -2 when importable; --dense narrows it); the fastest is "best
  dense". fla-core's parallel_nsa as a peer when importable (--no-peers skips it). --breakdown T: per-
  kernel-stage times; --sweep T: the op under each kernel-tuning variant of bench/sweeps.yaml (passed as
  tuning=, nothing patched; --sweep-only PREFIX picks some). --tile-m M [M ...]: the op with the selection
  on query tiles of M tokens (KernelTuning.tile.m; 1 = the per-token kernels, default 0 = the preset's
  policy), one row per M.
  --inputs captured:DIR: instead of random tensors, the captures of bench/capture_inputs.py (a trained
  model's op inputs per (T, layer), shapes and hyperparameters from the capture; dense bar at the same
  shapes). Both inputs print the locality table: the union of m consecutive tokens' selections as a
  fraction of m x n_sel blocks, second half of the sequence (bench/common.py: locality), and its key-side
  twin: the q / dO rows a dK/dV walk over tiles of kb consecutive blocks would gather per (token, block)
  pair (key_locality); captured inputs also the union of 4-token tiles regrouped within windows of W
  (group_locality: what tile.group would save).
--branch window: the sliding-window kernel against torch.compile(flex_attention) with a sliding-window
  block mask (flex on contiguous [B, H, T, d] copies, transposes untimed; our fwd+bwd excludes the
  delta = rowsum(dO * o) the op computes anyway as the window gate's gradient). Checks flex's output.
  Also each installed flash-attn, with GQA and with K/V repeated to one KV head per query head ("fa4+kv16":
  its backward then writes dK/dV per head instead of accumulating 16 heads in fp32; repeat and sum timed).
--branch cmp: the compressed branch alone, Triton kernel vs the residue-split dense SDPA
  (nsa/ops/triton/cmp_dense.py) on each of its backends, with errors against the Triton kernel.
--branch select: the fused scores + top-n kernel under several score tiles against the unfused score
  tensor + top-n kernels, with the share of block_idx rows equal to the unfused path's.

JSON: bench/out/attention_<branch> or attention_<paper|prod>_<random|captured>_<stamp>.json; --save copies it to
bench/results/ without the stamp.
"""
from __future__ import annotations

from pathlib import Path

import torch

import common
from common import HP
from nsa.ops import eager_graph

BRANCH_DEFAULTS = {"op": (2, 5), "window": (3, 10), "cmp": (2, 5), "select": (1, 5),
                   "flash": (2, 5)}   # (warmup, iters)
FLASH_VARIANTS = ("off", "win", "cmp", "win+cmp")


# ----------------------------------------------------------------------------------------- whole op
def bench_nsa(B, T, HQ, H, dk, dv, warmup, iters, tuning=None, mem=True, x=None, hp=None):
    """fwd and fwd+bwd ms (and peak GiB) of the op on x (the op's eight inputs; default random ones of
    these shapes) with hyperparameters hp (default HP)."""
    x = common.nsa_inputs(B, T, HQ, H, dk, dv) if x is None else x
    do = torch.randn(B, T, HQ, dv, device=x[0].device, dtype=x[0].dtype)

    def fwd():
        with torch.no_grad():
            return common.nsa_op(x, tuning, hp)

    def fwd_bwd():
        o, _ = common.nsa_op(x, tuning, hp)
        return torch.autograd.grad(o, x, do)

    res = {"fwd_ms": common.gpu_time(fwd, warmup, iters), "fwd_bwd_ms": common.gpu_time(fwd_bwd, warmup, iters)}
    if mem:
        res["fwd_mem_gib"], res["fwd_bwd_mem_gib"] = common.peak_mem_gib(fwd), common.peak_mem_gib(fwd_bwd)
    return res


def breakdown(B, T, HQ, H, dk, dv, warmup, iters):
    """Per-stage times (ms) of the Triton NSA forward and backward, each launcher called alone."""
    from nsa.ops.triton import attn, function, scores, scores_unfused, select
    q, kc, vc, ks, vs, kw, vw, g = [t.detach() for t in common.nsa_inputs(B, T, HQ, H, dk, dv)]
    sc = dk ** -0.5
    l, d, l_sel, n_sel, w = HP["l"], HP["d"], HP["l_sel"], HP["n_sel"], HP["w"]
    out = {}
    t = lambda name, fn: out.__setitem__(name, common.gpu_time(fn, warmup, iters))  # noqa: E731
    oc, lc = attn.attn_fwd(q, kc, vc, stride=d, offset=l - 1, window=0, scale=sc)
    t("cmp_fwd", lambda: attn.attn_fwd(q, kc, vc, stride=d, offset=l - 1, window=0, scale=sc))
    # "select": the fused scores + top-n the forward uses; the unfused pair for comparison
    bi = scores.select_blocks(q, kc, lc, l=l, d=d, l_sel=l_sel, n_sel=n_sel, scale=sc)
    t("select", lambda: scores.select_blocks(q, kc, lc, l=l, d=d, l_sel=l_sel, n_sel=n_sel, scale=sc))
    sc_old = scores_unfused.block_scores(q, kc, lc, l=l, d=d, l_sel=l_sel, scale=sc)
    t("scores_unfused", lambda: scores_unfused.block_scores(q, kc, lc, l=l, d=d, l_sel=l_sel, scale=sc))
    t("topn_unfused", lambda: scores_unfused.select_topn(sc_old, G=HQ // H, l=l, d=d, l_sel=l_sel, n_sel=n_sel))
    os_, ls = select.slc_fwd(q, ks, vs, bi, l_sel=l_sel, scale=sc)
    t("slc_fwd", lambda: select.slc_fwd(q, ks, vs, bi, l_sel=l_sel, scale=sc))
    ow, lw = attn.attn_fwd(q, kw, vw, stride=1, offset=0, window=w, scale=sc)
    t("win_fwd", lambda: attn.attn_fwd(q, kw, vw, stride=1, offset=0, window=w, scale=sc))
    t("combine", lambda: function.combine(oc, os_, ow, g))
    do = torch.randn_like(oc)
    dg = function.gate_grads(do, oc, os_, ow, g)[0]
    t("gate_bwd", lambda: function.gate_grads(do, oc, os_, ow, g))
    delta = dg[..., 0].contiguous()
    t("cmp_bwd", lambda: attn.attn_bwd(q, kc, vc, do, lc, delta, g[..., 0], stride=d, offset=l - 1,
                                       window=0, scale=sc))
    t("slc_invert", lambda: select.invert_selection(bi, l_sel, 1024))
    t("slc_bwd", lambda: select.slc_bwd(q, ks, vs, bi, do, ls, delta, g[..., 1], l_sel=l_sel, scale=sc))
    t("win_bwd", lambda: attn.attn_bwd(q, kw, vw, do, lw, delta, g[..., 2], stride=1, offset=0, window=w,
                                       scale=sc))
    return out


def sweep_space() -> dict[str, list[dict]]:
    """{group: [changes to the default KernelTuning]}: the launch-parameter candidates --sweep tries,
    from bench/sweeps.yaml (each variant a list of --tuning's FIELD=VALUE items, common.parse_changes)."""
    import yaml
    with open(Path(__file__).with_name("sweeps.yaml")) as f:
        groups = yaml.safe_load(f)
    return {g: [common.parse_changes(items) for items in variants] for g, variants in groups.items()}


def sweep(B, T, HQ, H, dk, dv, warmup, iters, only: str = "", x=None, hp=None):
    """The whole op (fwd and fwd+bwd ms) under each sweep_space() variant whose group starts with one of
    the comma-separated prefixes `only`, each built from the device's default tuning and passed as tuning=;
    on x (a capture's inputs, hyperparameters hp) when given, else on random inputs."""
    base = common.base_tuning()
    x = common.nsa_inputs(B, T, HQ, H, dk, dv) if x is None else x
    out = {"defaults": bench_nsa(B, T, HQ, H, dk, dv, warmup, iters, base, mem=False, x=x, hp=hp)}
    print(f"sweep T={T} defaults: {out['defaults']}", flush=True)
    for group, variants in sweep_space().items():
        if not group.startswith(tuple(only.split(","))):
            continue
        for changes in variants:
            key = ",".join(f"{k}={v}" for k, v in changes.items())
            try:
                out[key] = bench_nsa(B, T, HQ, H, dk, dv, warmup, iters, common.tuning_variant(base, changes),
                                     mem=False, x=x, hp=hp)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory for this tile
                out[key] = {"error": common.error_text(exc, 100)}
            print(f"sweep T={T} {key}: {out[key]}", flush=True)
            torch.cuda.empty_cache()
    return out


def tile_tunings(ms: list[int]) -> dict[int, object]:
    """{m: KernelTuning} for --tile-m (m=0: the preset; m=1: the per-token kernels)."""
    return {m: common.tile_m_variant(common.base_tuning(), m) for m in ms}


def op_rows(label, T, per_m: dict, dense: dict) -> list[list]:
    return [[T, label, m, r["fwd_ms"], dense["fwd_ms"], dense["fwd_ms"] / r["fwd_ms"], r["fwd_bwd_ms"],
             dense["fwd_bwd_ms"], dense["fwd_bwd_ms"] / r["fwd_bwd_ms"], r.get("fwd_bwd_mem_gib", float("nan")),
             dense["fwd_bwd_mem_gib"], f"{dense['fwd_backend']} / {dense['fwd_bwd_backend']}"]
            for m, r in per_m.items()]


def dense_bar(a, B, T, HQ, H, dk, dv) -> dict:
    dense = common.time_dense(B, T, HQ, H, dk, dv, a.warmup, a.iters, only=a.dense)
    torch.cuda.empty_cache()
    if "error" in dense:
        raise SystemExit(f"T={T}: {dense['error']}: {dense['all']}")
    return dense


def run_op(a, dims) -> dict:
    result = {"hparams": HP, "shape": dict(zip(("B", "HQ", "H", "dk", "dv"), dims)), "T": {},
              "dense_available": common.print_dense_available(), "inputs": a.inputs, "tile_m": a.tile_m,
              "rows": [], "locality": {}, "key_locality": {}, "group_locality": {}}
    if a.inputs.startswith("captured:"):
        return run_captured(a, result)
    rows, peer_rows = [], []
    tunings = tile_tunings(a.tile_m)
    for T in a.T:
        x = common.nsa_inputs(*dims[:1], T, *dims[1:])
        with torch.no_grad():
            bi = common.nsa_op(x)[1]
            result["locality"][f"T={T} random"] = common.locality(bi)
            result["key_locality"][f"T={T} random"] = common.key_locality(bi)
            del bi
        per_m = {m: bench_nsa(*dims[:1], T, *dims[1:], a.warmup, a.iters, tn, x=x) for m, tn in tunings.items()}
        nsa = per_m[a.tile_m[0]]
        if getattr(a, "host_profile", 0):
            result["T"].setdefault(T, {})["host_hot"] = hot = common.host_hotspots(x, a.host_profile)
            print(f"T={T} hottest host functions (ms per eager call, own / cumulative):\n" + "\n".join(
                f"  {h['own_ms']:7.3f} {h['cum_ms']:7.3f}  x{h['calls']:.0f}  {h['fn']}" for h in hot[:8]), flush=True)
        del x
        torch.cuda.empty_cache()
        dense = dense_bar(a, dims[0], T, *dims[1:])
        rf, rfb = dense["fwd_ms"] / nsa["fwd_ms"], dense["fwd_bwd_ms"] / nsa["fwd_bwd_ms"]
        result["T"][T] = {**result["T"].get(T, {}), "nsa": nsa, "dense": dense, "speedup_fwd": rf, "speedup_fwd_bwd": rfb,
                          "nsa_tile_m": per_m}
        result["rows"] += [{"T": T, "inputs": "random", "m": m, "nsa": r, "speedup_fwd": dense["fwd_ms"] / r["fwd_ms"],
                            "speedup_fwd_bwd": dense["fwd_bwd_ms"] / r["fwd_bwd_ms"]} for m, r in per_m.items()]
        if not a.no_peers:   # same shapes; ratios to best dense and to ours
            fla = common.time_fla(dims[0], T, *dims[1:], HP["n_sel"], HP["l_sel"], a.warmup, a.iters)
            torch.cuda.empty_cache()
            if "fwd_ms" in fla:
                fla.update(speedup_fwd=dense["fwd_ms"] / fla["fwd_ms"],
                           speedup_fwd_bwd=dense["fwd_bwd_ms"] / fla["fwd_bwd_ms"],
                           ours_vs_fla_fwd=fla["fwd_ms"] / nsa["fwd_ms"],
                           ours_vs_fla_fwd_bwd=fla["fwd_bwd_ms"] / nsa["fwd_bwd_ms"])
                peer_rows.append([T, fla["fwd_ms"], fla["speedup_fwd"], fla["ours_vs_fla_fwd"], fla["fwd_bwd_ms"],
                                  fla["speedup_fwd_bwd"], fla["ours_vs_fla_fwd_bwd"]])
            result["T"][T]["fla"] = fla
        rows += op_rows("random", T, per_m, dense)
        print(f"T={T}: nsa {per_m} dense fwd {dense['fwd_ms']:.2f} fwd+bwd {dense['fwd_bwd_ms']:.2f}", flush=True)
    for T in a.breakdown:
        result.setdefault("breakdown", {})[T] = bd = breakdown(dims[0], T, *dims[1:], a.warmup, a.iters)
        print(f"breakdown T={T}: " + " ".join(f"{k}={v:.2f}" for k, v in bd.items()), flush=True)
    for T in a.sweep:
        result.setdefault("sweep", {})[T] = sweep(dims[0], T, *dims[1:], 1, 3, a.sweep_only)
    print_op_table(rows, f"B,HQ,H,dk,dv={dims}, random inputs")
    common.print_locality(result["locality"], "random inputs (the op's own selection)")
    common.print_locality(result["key_locality"], "random inputs (the op's own selection)", keys=True)
    if peer_rows:
        print("\nfla-core parallel_nsa (compression + selection, mean-pooled compression); x dense = dense / fla, "
              "ours x = fla / ours")
        common.print_table(["T", "fla fwd", "x dense", "ours x", "fla f+b", "x dense", "ours x"], peer_rows)
    elif not a.no_peers:
        first = next(iter(result["T"].values()), {}).get("fla", {})
        print(f"\nfla-core not timed: {first.get('why') or first.get('skipped') or first.get('error')}")
    return result


def print_op_table(rows: list[list], what: str) -> None:
    print(f"\nms ({common.TIMER['mode']} calls); x = best dense / NSA; {what}; m = selection tile (tokens per "
          "program, 1 = per-token kernels, 0 = the preset's policy)")
    common.print_table(["T", "inputs", "m", "nsa fwd", "dense fwd", "x", "nsa f+b", "dense f+b", "x", "nsa GiB",
                        "dense GiB", "best dense fwd / f+b"], rows)


def run_captured(a, result: dict) -> dict:
    """The op on each capture of bench/capture_inputs.py (T in --T) under every --tile-m, against the best
    dense kernel at the capture's shapes (timed once per T: dense cost does not depend on the values)."""
    folder = a.inputs.split(":", 1)[1]
    meta = common.read_captures(folder)
    entries = [e for e in meta["captures"] if e["T"] in a.T]
    if not entries:
        raise SystemExit(f"--inputs {a.inputs}: no capture at --T {a.T} (captured: "
                         f"{sorted({e['T'] for e in meta['captures']})})")
    result.update(capture_recipe=meta.get("recipe"), captured_locality=meta.get("locality"), dense={})
    rec = meta.get("recipe") or {}
    print(f"captured inputs {folder}: model {rec.get('profile', rec.get('loaded_from', '?'))}, {rec.get('steps')} "
          f"steps at seq {rec.get('seq')}, final loss {rec.get('final_loss')}, trained on {rec.get('device')} "
          f"{rec.get('date')}; text {meta.get('text')}", flush=True)
    tunings = tile_tunings(a.tile_m)
    rows = []
    for e in entries:
        T, layer = e["T"], e["layer"]
        x, bi, hp, (B, HQ, H, dk, dv) = common.capture_case(folder, e)
        with torch.no_grad():
            same = (common.nsa_op(x, None, hp)[1] == bi).all(-1).float().mean().item()   # sync-ok: report
        result["locality"][f"T={T} layer {layer}"] = common.locality(bi)
        result["key_locality"][f"T={T} layer {layer}"] = common.key_locality(bi)
        if T >= 2 * max(common.GROUP_WINDOWS):   # a whole window of each size in the second half
            result["group_locality"][f"T={T} layer {layer}"] = common.group_locality(bi)
        per_m = {m: bench_nsa(B, T, HQ, H, dk, dv, a.warmup, a.iters, tn, x=x, hp=hp) for m, tn in tunings.items()}
        if T in a.sweep:   # the launch-parameter sweep on this capture
            result.setdefault("sweep", {})[f"T={T} layer {layer}"] = sweep(B, T, HQ, H, dk, dv, 1, 3, a.sweep_only,
                                                                          x=x, hp=hp)
        del x, bi
        torch.cuda.empty_cache()
        if T not in result["dense"]:
            result["dense"][T] = dense_bar(a, B, T, HQ, H, dk, dv)
        dense = result["dense"][T]
        for m, r in per_m.items():
            result["rows"].append({"T": T, "inputs": "captured", "layer": layer, "m": m, "nsa": r,
                                   "speedup_fwd": dense["fwd_ms"] / r["fwd_ms"],
                                   "speedup_fwd_bwd": dense["fwd_bwd_ms"] / r["fwd_bwd_ms"],
                                   "block_idx_rows_equal_capture": same})
        rows += op_rows(f"layer {layer}", T, per_m, dense)
        print(f"T={T} layer {layer}: nsa {per_m} dense fwd {dense['fwd_ms']:.2f} fwd+bwd {dense['fwd_bwd_ms']:.2f}; "
              f"block_idx rows equal to the capture's {same:.6f}", flush=True)
    shape = {k: v for k, v in zip(("B", "HQ", "H", "dk", "dv"), (B, HQ, H, dk, dv))}
    result["shape"], result["hparams"] = shape, hp
    print_op_table(rows, f"captured inputs {folder} (B,HQ,H,dk,dv={tuple(shape.values())}, {hp})")
    loc = dict(result["locality"])
    for T, t in (meta.get("locality") or {}).items():
        if int(T) in a.T:
            loc[f"T={T} mean of {len(t['layers'])} layers"] = {int(m): v for m, v in t["mean"].items()}
    common.print_locality(loc, "captured inputs")
    common.print_locality(result["key_locality"], "captured inputs", keys=True)
    common.print_locality(result["group_locality"], "captured inputs", group=True)
    return result


# ----------------------------------------------------------------------------------------- branches
def run_window(a, dims) -> dict:
    from nsa.ops.triton import attn
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    _, HQ, H, dk, _ = dims
    w, sc = HP["w"], dk ** -0.5
    res, rows = {"w": w, "rows": []}, []
    fa = torch.compile(flex_attention, dynamic=False)
    for T in a.T:
        torch.manual_seed(T)
        r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
        q, k, v, do = r(1, T, HQ, dk), r(1, T, H, dk), r(1, T, H, dk), r(1, T, HQ, dk)
        ones = torch.ones(q.shape[:-1], device="cuda", dtype=q.dtype)

        def ours_fwd():
            return attn.attn_fwd(q, k, v, stride=1, offset=0, window=w, scale=sc)

        delta = (do.float() * ours_fwd()[0].float()).sum(-1)

        def ours_fwd_bwd():
            o, lse = ours_fwd()
            return attn.attn_bwd(q, k, v, do, lse, delta, ones, stride=1, offset=0, window=w, scale=sc)

        row = {"T": T, "ours_fwd_ms": common.gpu_time(ours_fwd, a.warmup, a.iters),
               "ours_fwd_bwd_ms": common.gpu_time(ours_fwd_bwd, a.warmup, a.iters)}
        try:
            bm = create_block_mask(lambda b, h, qi, ki: (ki <= qi) & (qi - ki < w), None, None, T, T, device="cuda")
            qt, kt, vt, dot = (x.transpose(1, 2).contiguous() for x in (q, k, v, do))
            qg, kg, vg = (x.detach().requires_grad_() for x in (qt, kt, vt))

            def flex_fwd():
                with torch.no_grad():
                    return fa(qt, kt, vt, block_mask=bm, scale=sc, enable_gqa=True)

            def flex_fwd_bwd():
                return torch.autograd.grad(fa(qg, kg, vg, block_mask=bm, scale=sc, enable_gqa=True), (qg, kg, vg), dot)

            o_f, o_o = flex_fwd().transpose(1, 2).float(), ours_fwd()[0].float()
            row["flex_rel_err"] = ((o_f - o_o).norm() / o_o.norm()).item()
            row["flex_fwd_ms"] = common.gpu_time(flex_fwd, a.warmup, a.iters)
            row["flex_fwd_bwd_ms"] = common.gpu_time(flex_fwd_bwd, a.warmup, a.iters)
            rows.append([T, row["ours_fwd_ms"], row["flex_fwd_ms"], row["flex_fwd_ms"] / row["ours_fwd_ms"],
                         row["ours_fwd_bwd_ms"], row["flex_fwd_bwd_ms"],
                         row["flex_fwd_bwd_ms"] / row["ours_fwd_bwd_ms"], f"{row['flex_rel_err']:.2e}"])
        except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON
            row["flex_error"] = common.error_text(exc, 200)
            rows.append([T, row["ours_fwd_ms"], "-", "-", row["ours_fwd_bwd_ms"], "-", "-", row["flex_error"]])
        # the same window on flash-attn (FA4 / FA2); "+kv16": K/V repeated to HQ heads first (inside the
        # timed call, the repeat's backward summing dK/dV), so the backward has no GQA accumulation
        for be, rep in [(f, r) for f in common.flash_installed_names() for r in sorted({1, HQ // H})]:
            from nsa.ops.flash import dense_attention
            xg = [t.detach().requires_grad_() for t in (q, k, v)]
            fb = be if rep == 1 else f"{be}+kv{rep}"   # the row's and the JSON keys' name

            def fa_call(x, be=be, rep=rep):
                kk, vv = (x[1], x[2]) if rep == 1 else (x[1].repeat_interleave(rep, 2), x[2].repeat_interleave(rep, 2))
                return dense_attention(x[0], kk, vv, causal=True, window=w, scale=sc, backend=be)

            def fa_fwd(fa_call=fa_call):
                with torch.no_grad():
                    return fa_call((q, k, v))

            def fa_fwd_bwd(fa_call=fa_call, xg=xg):
                return torch.autograd.grad(fa_call(xg), xg, do)

            try:
                row[f"{fb}_rel_err"] = _rel(fa_fwd(), ours_fwd()[0])
                row[f"{fb}_fwd_ms"] = common.gpu_time(fa_fwd, a.warmup, a.iters)
                row[f"{fb}_fwd_bwd_ms"] = common.gpu_time(fa_fwd_bwd, a.warmup, a.iters)
                rows.append([T, row["ours_fwd_ms"], f"{fb}: {row[f'{fb}_fwd_ms']:.3f}",
                             row[f"{fb}_fwd_ms"] / row["ours_fwd_ms"], row["ours_fwd_bwd_ms"],
                             row[f"{fb}_fwd_bwd_ms"], row[f"{fb}_fwd_bwd_ms"] / row["ours_fwd_bwd_ms"],
                             f"{row[f'{fb}_rel_err']:.2e}"])
            except Exception as exc:  # noqa: BLE001 - reported in the JSON
                row[f"{fb}_error"] = common.error_text(exc, 200)
        res["rows"].append(row)
        print(f"T={T}: {row}", flush=True)
    print(f"\nwindow branch, w={w}, HQ={HQ} H={H} d={dk} bf16; ms; x = flex (or fa4/fa2) / ours")
    common.print_table(["T", "ours fwd", "flex fwd", "x", "ours f+b", "flex f+b", "x", "flex rel err"], rows, ".3f")
    return res


def run_flash(a, dims) -> dict:
    """The whole op with its window / compressed branch on flash-attn (tuning.flash, mode auto from
    T = 0) against the own kernels (off) and the best dense kernel: which branches to move, and from
    which T (the preset's tuning.flash)."""
    res = {"dense_available": common.print_dense_available(), "variants": list(a.flash), "T": {}}
    base, rows = common.base_tuning(), []
    for T in a.T:
        dense = common.time_dense(dims[0], T, *dims[1:], a.warmup, a.iters, only=a.dense)
        torch.cuda.empty_cache()
        res["T"][T] = out = {"dense": dense}
        for v in a.flash:
            try:
                out[v] = bench_nsa(*dims[:1], T, *dims[1:], a.warmup, a.iters, common.flash_variant(base, v),
                                   mem=False)
            except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON
                out[v] = {"error": common.error_text(exc, 200)}
            torch.cuda.empty_cache()
            r = out[v]
            if "fwd_ms" in r:
                off = out.get("off", r)
                rows.append([T, v, r["fwd_ms"], r["fwd_bwd_ms"], off["fwd_bwd_ms"] / r["fwd_bwd_ms"],
                             dense.get("fwd_bwd_ms", float("nan")) / r["fwd_bwd_ms"]])
            print(f"T={T} {v}: {r}", flush=True)
    print(f"\nwhole op, branches on flash-attn ({', '.join(common.flash_installed_names()) or 'none installed'}); "
          f"B,HQ,H,dk,dv={dims}; ms; x off = off / variant (f+b), x dense = best dense / variant (f+b)")
    common.print_table(["T", "variant", "fwd ms", "f+b ms", "x off", "x dense"], rows)
    return res


def _rel(x, y):
    x, y = x.float(), y.float()
    return float((x - y).norm() / y.norm().clamp_min(1e-30))


def run_cmp(a, dims) -> dict:
    from nsa.ops.common import num_cmp_tokens
    from nsa.ops.triton import attn, cmp_dense
    B, HQ, H, dk, dv = dims
    l, d, sc = HP["l"], HP["d"], dk ** -0.5
    res = {"probe": cmp_dense.probe("cuda:0", torch.bfloat16, dk, dv), "T": {}}
    print("probe:", res["probe"], flush=True)
    rows = []
    kw = dict(stride=d, offset=l - 1, window=0, scale=sc)
    for T in a.T:
        N = num_cmp_tokens(T, l, d)
        g = torch.Generator(device="cuda").manual_seed(T)
        mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        q, kc, vc, do = mk(B, T, HQ, dk), mk(B, N, H, dk), mk(B, N, H, dv), mk(B, T, HQ, dv)
        o_t, lse_t = attn.attn_fwd(q, kc, vc, **kw)
        gq, gk, gv = attn.attn_bwd(q, kc, vc, do, lse_t, (do.float() * o_t.float()).sum(-1), None, **kw)

        def tri_fwd_bwd():
            o, s = attn.attn_fwd(q, kc, vc, **kw)
            return attn.attn_bwd(q, kc, vc, do, s, (do.float() * o.float()).sum(-1), None, **kw)

        out = {"triton": {"fwd_ms": common.gpu_time(lambda: attn.attn_fwd(q, kc, vc, **kw), a.warmup, a.iters),
                          "fwd_bwd_ms": common.gpu_time(tri_fwd_bwd, a.warmup, a.iters)}}
        for be in cmp_dense.BACKENDS + tuple(common.flash_installed_names()):
            try:
                x = [t.clone().requires_grad_() for t in (q, kc, vc)]

                def call(be=be, x=x):
                    return cmp_dense.cmp_attention_dense(*x, l=l, d=d, scale=sc, backend=be)

                def fwd(call=call):
                    with torch.no_grad():
                        return call()

                o, lse = call()
                grads = torch.autograd.grad(o, x, do)
                same = all(torch.equal(u, w) for u, w in zip(grads, torch.autograd.grad(call()[0], x, do)))
                fin = torch.isfinite(lse_t)
                err = {"o": _rel(o, o_t), "lse_max_abs": float((lse[fin] - lse_t[fin]).abs().max()),
                       "lse_inf_equal": bool((torch.isinf(lse) == torch.isinf(lse_t)).all()),
                       "dq": _rel(grads[0], gq), "dk": _rel(grads[1], gk), "dv": _rel(grads[2], gv),
                       "bitwise_repeatable_grads": same}
                out[be] = {"fwd_ms": common.gpu_time(fwd, a.warmup, a.iters),
                           "fwd_bwd_ms": common.gpu_time(lambda call=call, x=x: torch.autograd.grad(
                               call()[0], x, do), a.warmup, a.iters), "err_vs_triton": err}
            except Exception as exc:  # noqa: BLE001 - report and go on
                out[be] = {"error": common.error_text(exc, 300)}
            print(f"T={T} {be}: {out[be]}", flush=True)
        res["T"][T] = out
        rows += [[T, be, v["fwd_ms"], v["fwd_bwd_ms"], out["triton"]["fwd_ms"] / v["fwd_ms"],
                  out["triton"]["fwd_bwd_ms"] / v["fwd_bwd_ms"]] for be, v in out.items() if "fwd_ms" in v]
        torch.cuda.empty_cache()
    print("\ncompressed branch; ms; x = Triton / impl")
    common.print_table(["T", "impl", "fwd ms", "f+b ms", "x fwd", "x f+b"], rows)
    return res


def run_select(a, dims) -> dict:
    from nsa.ops.common import num_cmp_tokens
    from nsa.ops.triton import attn, scores_unfused
    _, HQ, H, dk, _ = dims
    l, d, l_sel, n_sel = HP["l"], HP["d"], HP["l_sel"], HP["n_sel"]
    sc = dk ** -0.5
    variants = {k: v for k, v in select_variants().items()
                if not a.sweep_only or k.startswith(tuple(a.sweep_only.split("|")))}
    res = {"T": {}}
    for T in a.T:
        torch.manual_seed(0)
        bf = dict(device="cuda", dtype=torch.bfloat16)
        q = torch.randn(1, T, HQ, dk, **bf)
        kc = torch.randn(1, num_cmp_tokens(T, l, d), H, dk, **bf)
        _, lse = attn.attn_fwd(q, kc, torch.randn_like(kc), stride=d, offset=l - 1, window=0, scale=sc)

        def unfused():
            s = scores_unfused.block_scores(q, kc, lse, l=l, d=d, l_sel=l_sel, scale=sc)
            return scores_unfused.select_topn(s, G=HQ // H, l=l, d=d, l_sel=l_sel, n_sel=n_sel)

        ref = unfused()
        r = res["T"][T] = {"unfused_ms": common.gpu_time(unfused, a.warmup, a.iters), "fused": {}}
        print(f"T={T}: unfused scores+topn {r['unfused_ms']:.2f} ms", flush=True)
        for key, tuning in variants.items():
            try:
                bi = common.select_blocks_op(q, kc, lse, sc, tuning)
                same = (bi == ref).all(-1).float().mean().item()   # sync-ok: benchmark
                ms = common.gpu_time(lambda t=tuning: common.select_blocks_op(q, kc, lse, sc, t), a.warmup, a.iters)
                r["fused"][key] = {"ms": ms, "rows_equal_unfused": same}
                print(f"  fused {key}: {ms:.2f} ms ({r['unfused_ms'] / ms:.2f}x), rows equal {same:.6f}", flush=True)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory for this tile
                r["fused"][key] = {"error": common.error_text(exc, 200)}
                print(f"  fused {key}: {r['fused'][key]['error']}", flush=True)
    return res


def select_variants() -> dict[str, object]:
    """{name: KernelTuning} for --branch select: score tiles (rows, min keys, warps, stages, map <= 16
    tokens, map > 16 tokens), each also with its block scores relaid out before ranking (ScoreTuning.relayout)."""
    base = common.base_tuning()
    out = {"defaults": base, "defaults relayout": common.tuning_variant(base, {"scores.relayout": True})}
    for t, regs in [((128, 64, 8, 2, 2, 2), None), ((256, 64, 8, 2, 2, 2), None), ((256, 64, 8, 2, 0, 2), None),
                    ((128, 64, 8, 3, 2, 2), None), ((128, 64, 4, 2, 2, 2), None), ((128, 32, 8, 2, 2, 2), None),
                    ((128, 64, 4, 2, 0, 2), None), ((256, 64, 8, 3, 0, 2), None),
                    # register caps (the preset's tile runs at 80): more programs per SM, or bigger tiles
                    ((128, 64, 8, 2, 2, 2), 72), ((128, 64, 8, 3, 2, 2), 80), ((128, 128, 8, 2, 2, 2), 128),
                    ((256, 64, 8, 2, 2, 2), 128), ((128, 64, 4, 2, 2, 2), 128), ((128, 32, 8, 2, 2, 2), 80)]:
        tile = common.score_tile(*t, max_regs=regs)
        name = str(t) + (f" regs {regs}" if regs else "")
        out[name] = common.tuning_variant(base, {"scores.tile": tile})
        out[name + " relayout"] = common.tuning_variant(out[name], {"scores.relayout": True})
    return out


def main() -> None:
    ap = common.t_args(__doc__)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--branch", choices=sorted(BRANCH_DEFAULTS), default="op",
                    help="op: the whole NSA op; window / cmp / select: that branch against its alternative")
    ap.add_argument("--dense", nargs="*", default=None,
                    help="dense baselines to try (name prefixes: sdpa-cudnn sdpa-flash sdpa-efficient sdpa-math "
                         "fa4 fa2; default all present)")
    ap.add_argument("--breakdown", type=int, nargs="*", default=[], help="T values for per-stage times")
    ap.add_argument("--timer", choices=["eager", "graph"], default="eager",
                    help="eager calls (host time included) or CUDA-graph replays (what a graphed training "
                         "step sees; every op and dense baseline is captured once per shape)")
    ap.add_argument("--sweep", type=int, nargs="*", default=[],
                    help="T values for the kernel-tuning sweep (with --inputs captured:DIR on each capture at T)")
    ap.add_argument("--sweep-only", default="", help="sweep only the groups with these prefixes (comma-separated, e.g. "
                    "select.block,scores.); with --branch select: only the score variants whose names start with one "
                    "of these, '|'-separated (the names hold commas)")
    ap.add_argument("--host-profile", type=int, default=0, metavar="CALLS",
                    help="--branch op: also profile the host side of CALLS eager calls (hottest functions)")
    ap.add_argument("--no-peers", action="store_true", help="skip peer implementations (fla-core)")
    ap.add_argument("--flash", nargs="+", default=list(FLASH_VARIANTS), choices=FLASH_VARIANTS,
                    help="--branch flash: op variants with these branches on flash-attn (off = own kernels)")
    ap.add_argument("--tile-m", type=int, nargs="+", default=[0],
                    help="--branch op: selection on query tiles of M tokens at every G (KernelTuning.tile.m; "
                         "1 = per token; 0 = the preset's own tile policy, the default); several values: the "
                         "op timed under each (e.g. --tile-m 0 1 4 8)")
    ap.add_argument("--inputs", default="random",
                    help="--branch op: random (default) or captured:DIR (bench/capture_inputs.py's captures at "
                         "the --T lengths; shapes and hyperparameters from the capture)")
    ap.set_defaults(warmup=None, iters=None)
    a = ap.parse_args()
    w0, i0 = BRANCH_DEFAULTS[a.branch]
    a.warmup = w0 if a.warmup is None else a.warmup
    a.iters = i0 if a.iters is None else a.iters
    common.check_inputs(a.inputs)
    if a.inputs != "random" and a.branch != "op":
        raise SystemExit(f"--inputs {a.inputs}: captured inputs are for --branch op only")
    if not common.has_cuda():
        raise SystemExit("bench_attention.py needs a CUDA device (the Triton kernels run natively)")
    torch.manual_seed(0)
    common.set_timer(a.timer)
    dims = (a.B, a.HQ, a.H, a.dk, a.dv)
    run = {"op": run_op, "window": run_window, "cmp": run_cmp, "select": run_select, "flash": run_flash}[a.branch]
    result = run(a, dims)
    result["timer"] = a.timer
    result["eager_graphs"] = eager_graph.ON   # NSA_EAGER_GRAPHS=auto: eager calls replay per-signature CUDA graphs
    # the op's file is named by shape and inputs (attention_paper_random, attention_prod_captured, ...): --save
    # replaces the one current file per variant that bench/RESULTS.md cites
    sh = result.get("shape") or dict(HQ=a.HQ, H=a.H, dk=a.dk, dv=a.dv)   # captured runs: the capture's shape
    dims4 = (sh["HQ"], sh["H"], sh["dk"], sh["dv"])
    shape = {(64, 4, 128, 128): "paper", (12, 2, 64, 64): "prod"}.get(dims4, "hq{}_h{}_dk{}_dv{}".format(*dims4))
    inputs = "random" if a.inputs == "random" else "captured"
    name = f"attention_{a.branch}" if a.branch != "op" else f"attention_{shape}_{inputs}"
    common.write_result(result, name, a)


if __name__ == "__main__":
    main()
