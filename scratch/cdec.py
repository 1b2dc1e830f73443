import sys, torch
sys.path.insert(0, "bench")
import bench_regs as br
seen = br.compile_only(90)
torch.Tensor.is_cuda = property(lambda self: True)
from nsa.ops.triton import decode_gluon as dg
from nsa.ops.triton.decode_launch import decode_plan
from nsa.ops.tuning import HOPPER
B, H, G, D, S = int(sys.argv[1]) if len(sys.argv) > 1 else 16, 4, 16, 128, 65536
HQ = H * G
N = (S - 32) // 16 + 1
bf = dict(dtype=torch.bfloat16)
q = torch.randn(B, 1, HQ, D, **bf); kc = torch.randn(B, N, H, D, **bf); vc = torch.randn(B, N, H, D, **bf)
tn = HOPPER.decode.knobs(B * H)
pl = decode_plan(rows_h=B * H, n_cap=N, s_cap=S, l=32, d=16, l_sel=64, n_sel=16, w=512, sms=132, knobs=tn)
R = B
f32 = dict(dtype=torch.float32)
sp = torch.empty(R * HQ, pl["NBCAP"], **f32); ms = torch.empty(R * H, pl["NSUB"], 16, **f32)
nch = pl["NCH"]
cm = torch.empty(R, nch * dg.NC, HQ, **f32); cl = torch.empty_like(cm); co = torch.empty(R, nch * dg.NC, HQ, D, **f32)
pos = torch.full((1,), S - 1, dtype=torch.int64)
ok = dg.cmp_pass(q, kc, vc, pos, sp, ms, cm, cl, co, spos=0, pos_base=0, Tq=1, nch=nch, nsub=pl["NSUB"],
                 nbcap=pl["NBCAP"], subs=pl["SUBS"], scale_log2=0.1, l=32, d=16, l_sel=64, nbj=pl["NBJ"],
                 pos_ptr=True, pdl=True)
print("ok", ok, dg._OFF)
for name, w, st, k in seen:
    r = br.ptxas_report(k.asm["ptx"], 90)
    print(name, r["regs"], r["spill_stores"], r["spill_loads"], k.metadata.shared)
