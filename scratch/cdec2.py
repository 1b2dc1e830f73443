import sys, torch
sys.path.insert(0, "bench")
import bench_regs as br
seen = br.compile_only(90)
torch.cuda.is_current_stream_capturing = lambda: False
torch.Tensor.is_cuda = property(lambda self: True)
from nsa.ops.triton import decode as tdec, decode_gluon as dg
for B in (1, 16):
    H, G, D, S = 4, 16, 128, 65536
    HQ = H * G
    N = (S - 32) // 16 + 1
    bf = dict(dtype=torch.bfloat16)
    r = lambda *s: torch.randn(*s, **bf)
    args = [r(B, 1, HQ, D), r(B, N, H, D), r(B, N, H, D), r(B, S, H, D), r(B, S, H, D), r(B, 512, H, D), r(B, 512, H, D),
            torch.rand(B, 1, HQ, 3, **bf)]
    pos = torch.full((1,), S - 1, dtype=torch.int64); win = torch.full((1,), S - 512, dtype=torch.int64)
    tdec.nsa_decode_triton(*args, pos0=pos, win_pos0=win, l=32, d=16, l_sel=64, n_sel=16, w=512, scale=D ** -0.5)
    print(B, "off:", dg._OFF)
for name, w, st, k in seen:
    if k is None: continue
    rr = br.ptxas_report(k.asm["ptx"], 90)
    print(name, w, st, rr["regs"], rr["spill_stores"], k.metadata.shared)
