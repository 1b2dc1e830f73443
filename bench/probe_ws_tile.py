import importlib.util, os, sys, json
sys.path.insert(0, "bench"); sys.path.insert(0, "."); sys.path.insert(0, "tests")
import torch, triton
import common
from nsa.ops.triton import select_tile as tt
from nsa.ops.tuning import TileTuning

def load(nc, stages):
    os.environ["WS_NC"], os.environ["WS_STAGES"] = str(nc), str(stages)
    spec = importlib.util.spec_from_file_location(f"ws_{nc}_{stages}", "nsa/ops/triton/tile_ws_proto.py")
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m

VARIANTS = [(2, 4, 168), (3, 5, 160), (3, 6, 160)]
mods = {v: load(v[0], v[1]) for v in VARIANTS}

def block_idx(T, H, mode, gen, alpha=0.25, n_sel=16, l_sel=64):
    nsb = triton.cdiv(T, l_sel)
    if mode == "random":
        s = torch.rand(1, T, H, nsb, generator=gen, device="cuda")
    else:
        s = torch.rand(1, triton.cdiv(T, 32), H, nsb, generator=gen, device="cuda").repeat_interleave(32, 1)[:, :T]
        if mode == "mixed":
            s = s + alpha * torch.rand(1, T, H, nsb, generator=gen, device="cuda")
    t = torch.arange(T, device="cuda").view(1, T, 1, 1); j = torch.arange(nsb, device="cuda"); cur = t // l_sel
    s = s + 40.0 * (j == cur) + 20.0 * (j == 0) + 10.0 * (j == cur - 1)
    s = torch.where(j <= cur, s, -1.0)
    val, idx = s.topk(min(n_sel, nsb), -1)
    idx = torch.where(val >= 0, idx, nsb).sort(-1).values
    return torch.where(idx < nsb, idx, -1).to(torch.int32)

res = []
for T in [int(x) for x in sys.argv[1:]] or [8192, 65536]:
    gen = torch.Generator(device="cuda").manual_seed(T)
    HQ, H, d = 64, 4, 128
    q = torch.randn(1, T, HQ, d, generator=gen, device="cuda").bfloat16()
    k = torch.randn(1, T, H, d, generator=gen, device="cuda").bfloat16()
    v = torch.randn(1, T, H, d, generator=gen, device="cuda").bfloat16()
    for mode in ("random", "mixed", "local"):
        bi = block_idx(T, H, mode, gen)
        fr = {m: float(tt.tile_union_fraction(bi, m)) for m in (4, 8, 12)}
        un4 = tt.tile_unions(bi, 4)
        f4 = lambda: tt.slc_fwd_tile(q, k, v, bi, l_sel=64, scale=d ** -0.5, m=4, union=un4,
                                     tuning=TileTuning(m=4, gluon_fwd_stages=2))
        o4, l4 = f4()
        row = dict(T=T, mode=mode, union=fr, base_ms=common.gpu_time(f4, warmup=2, iters=10))
        for (nc, st, cr) in VARIANTS:
            un = tt.tile_unions(bi, 4 * nc)
            f = lambda: mods[(nc, st, cr)].ws_fwd(q, k, v, un, nc, st, d ** -0.5, cregs=cr)
            try:
                o, l = f()
                torch.cuda.synchronize()
                same = bool(torch.equal(o, o4) and torch.equal(l, l4))
                row[f"ws{nc}s{st}"] = dict(ms=common.gpu_time(f, warmup=2, iters=10), same=same)
            except Exception as e:
                row[f"ws{nc}s{st}"] = dict(err=str(e)[:300])
        print(json.dumps(row), flush=True)
        res.append(row)
json.dump(res, open(os.path.join(os.environ.get("OUT", "bench/out"), "ws_probe.json"), "w"), indent=1)
