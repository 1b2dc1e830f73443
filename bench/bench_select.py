"""Benchmark: fused selection (nsa.ops.triton.scores.select_blocks) vs the unfused score tensor +
top-n kernels, at paper sizes (l=32, d=16, l_sel=64, n_sel=16; B=1, HQ=64, H=4, d_k=128, bf16), for
several tile settings. Also reports how many block_idx rows equal the unfused path's.

    python bench/bench_select.py [--T 65536] [--HQ 64 --H 4 --dk 128] [--tile 0 3] [--out DIR]

Prints one line per setting and writes select_<date>.json under --out.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_attention import HP, cuda_time  # noqa: E402
from nsa.ops.common import num_cmp_tokens  # noqa: E402

# (rows, min chunk tokens, warps, stages, map <= 16 tokens, map > 16 tokens); see scores.SCORE_TILE
TILES = [(128, 64, 8, 2, 2, 2), (256, 64, 8, 2, 2, 2), (256, 64, 8, 2, 0, 2), (128, 64, 8, 3, 2, 2),
         (128, 64, 4, 2, 2, 2), (128, 32, 8, 2, 2, 2), (128, 64, 4, 2, 0, 2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=65536)
    ap.add_argument("--HQ", type=int, default=64)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--tile", type=int, nargs="*", default=None, help="indices into TILES (default: all)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    a = ap.parse_args()
    from nsa.ops.triton import attn, scores, select
    torch.manual_seed(0)
    T, HQ, H, dk = a.T, a.HQ, a.H, a.dk
    l, d, l_sel, n_sel = HP["l"], HP["d"], HP["l_sel"], HP["n_sel"]
    bf = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, T, HQ, dk, **bf)
    kc = torch.randn(1, num_cmp_tokens(T, l, d), H, dk, **bf)
    vc = torch.randn_like(kc)
    sc = dk ** -0.5
    _, lse = attn.attn_fwd(q, kc, vc, stride=d, offset=l - 1, window=0, scale=sc)
    res = {"device": torch.cuda.get_device_name(), "shape": dict(T=T, HQ=HQ, H=H, dk=dk), "tiles": {}}

    def unfused():
        s = select.block_scores(q, kc, lse, l=l, d=d, l_sel=l_sel, scale=sc)
        return select.select_topn(s, G=HQ // H, l=l, d=d, l_sel=l_sel, n_sel=n_sel)

    ref = unfused()
    res["unfused_ms"] = cuda_time(unfused, 1, a.iters)
    print(f"T={T} HQ={HQ} H={H} dk={dk}: unfused scores+topn {res['unfused_ms']:.2f} ms", flush=True)
    tiles = TILES if a.tile is None else [TILES[i] for i in a.tile]
    for tile in tiles:
        for skip in (False, True) if tile == TILES[0] else (False,):
            key = f"{tile} skip={skip}"
            try:
                def fused():
                    return scores.select_blocks(q, kc, lse, l=l, d=d, l_sel=l_sel, n_sel=n_sel, scale=sc,
                                                tile=tile, skip_merge=skip)
                bi = fused()
                same = (bi == ref).all(-1).float().mean().item()   # sync-ok: benchmark
                ms = cuda_time(fused, 1, a.iters)
                res["tiles"][key] = {"ms": ms, "rows_equal_unfused": same}
                print(f"  fused {key}: {ms:.2f} ms ({res['unfused_ms'] / ms:.2f}x), rows equal {same:.6f}",
                      flush=True)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory for this tile
                res["tiles"][key] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                print(f"  fused {key}: {res['tiles'][key]['error']}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    tag = "" if a.tile is None else "_tile" + "_".join(map(str, a.tile))
    path = os.path.join(a.out, f"select_{dt.date.today().isoformat()}_T{T}_HQ{HQ}_H{H}{tag}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
