"""Temporary GPU probe for nsa.ops (ops helper); deleted after use."""
import json, os, time
import torch
import torch.nn.functional as F
from nsa.ops import nsa_attention
from nsa.ops.testing import make_inputs

dev = "cuda"
res = []
def timeit(fn, n=5):
    fn(); torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3, torch.cuda.max_memory_allocated() / 2**20
hp = dict(l=32, d=16, l_sel=64, n_sel=16, w=512)
for B, T in [(1, 2048), (4, 2048), (1, 8192)]:
    xs = make_inputs(B, T, 12, 2, 64, 64, l=32, d=16, dtype=torch.bfloat16, device=dev, requires_grad=True)
    go = torch.randn(B, T, 12, 64, device=dev, dtype=torch.bfloat16)
    base = torch.cuda.memory_allocated() / 2**20
    def dense():
        q, k, v = xs[0].transpose(1, 2), xs[3].transpose(1, 2), xs[4].transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        o.backward(go.transpose(1, 2))
    ms, mem = timeit(dense)
    res.append(dict(B=B, T=T, what="sdpa_dense", ms=ms, peak_mb=mem - base)); print(res[-1], flush=True)
    for tile in (256, 512, 1024):
        for rc in (True, False):
            if T == 8192 and not rc and tile < 512: continue
            def nsa():
                o, _ = nsa_attention(*xs, **hp, backend="torch", tile=tile, recompute=rc)
                o.backward(go)
            ms, mem = timeit(nsa)
            with torch.no_grad():
                fms, _ = timeit(lambda: nsa_attention(*xs, **hp, backend="torch", tile=tile))
            res.append(dict(B=B, T=T, what=f"nsa tile={tile} recompute={rc}", ms=ms, fwd_ms=fms, peak_mb=mem - base))
            print(res[-1], flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe.json"), "w"), indent=1)
