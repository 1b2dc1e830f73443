import torch, time
from nsa.ops.triton import decode as tdec, decode_gluon as dg
from nsa.ops.tuning import tuning_for
P = dict(l=32, d=16, l_sel=64, n_sel=16, w=512)
for B, HQ, H, D in ((16, 64, 4, 128), (1, 64, 4, 128), (2, 12, 2, 64)):
    S = 65536; N = (S - 32) // 16 + 1
    r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)
    a = [r(B, 1, HQ, D) * 2, r(B, N, H, D), r(B, N, H, D), r(B, S, H, D), r(B, S, H, D), r(B, S, H, D), r(B, S, H, D), torch.rand(B, 1, HQ, 3, device="cuda")]
    for t in (0, 40, 5000, S - 1):
        pos = torch.full((1,), t, dtype=torch.int64, device="cuda"); win = torch.zeros(1, dtype=torch.int64, device="cuda")
        res = []
        for x in (True, False):
            tn = tuning_for("cuda").decode.with_knobs(gluon_cmp=x)
            res.append(tdec.nsa_decode_triton(*a, pos0=pos, win_pos0=win, scale=D ** -0.5, tuning=tn, **P))
        torch.cuda.synchronize()
        (og, ig), (ot, it) = res
        print(B, HQ, D, t, "idx eq", torch.equal(ig, it), "rel", ((og.float() - ot.float()).norm() / ot.float().norm().clamp_min(1e-9)).item(), dg._OFF, flush=True)
