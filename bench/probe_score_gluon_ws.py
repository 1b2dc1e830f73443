import sys, os, json
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
import torch
import common
from nsa.ops.tuning import HOPPER
from nsa.ops.triton.attn import attn_fwd
from nsa.ops.triton.scores import select_blocks
from nsa.ops.triton.scores_gluon_proto import select_blocks_ws
hp = common.HP
res = []
for T in [int(t) for t in sys.argv[1:]]:
    g = torch.Generator(device="cuda").manual_seed(T)
    B, HQ, H, dk = 1, 64, 4, 128
    q = torch.randn(B, T, HQ, dk, device="cuda", dtype=torch.bfloat16, generator=g)
    N = (T - hp["l"]) // hp["d"] + 1
    kc = torch.randn(B, N, H, dk, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(B, N, H, dk, device="cuda", dtype=torch.bfloat16, generator=g)
    _, lse = attn_fwd(q, kc, vc, stride=hp["d"], offset=hp["l"] - 1, window=0, scale=dk ** -0.5)
    kw = dict(l=hp["l"], d=hp["d"], l_sel=hp["l_sel"], n_sel=hp["n_sel"], scale=dk ** -0.5)
    base = lambda: select_blocks(q, kc, lse, tuning=HOPPER.scores, **kw)
    ref = base()
    row = dict(T=T, base=common.gpu_time(base, warmup=2, iters=10))
    for rw in (1, 2, 4):
        f = lambda: select_blocks_ws(q, kc, lse, rank_warps=rw, **kw)
        try:
            bi = f(); torch.cuda.synchronize()
            row[f"ws_rw{rw}"] = dict(ms=common.gpu_time(f, warmup=2, iters=10), rows_differ=int((bi != ref).any(-1).sum()))
        except Exception as e:
            row[f"ws_rw{rw}"] = dict(err=str(e)[:400])
    try:
        fs = lambda: select_blocks_ws(q, kc, lse, only="score", **kw)
        row["ws_score_only"] = common.gpu_time(fs, warmup=2, iters=10)
    except Exception as e:
        row["ws_score_only"] = str(e)[:300]
    print(json.dumps(row), flush=True)
    res.append(row)
json.dump(res, open(os.path.join(os.environ.get("OUT", "bench/out"), "gscore_ws_probe.json"), "w"), indent=1)
