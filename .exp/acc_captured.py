import dataclasses, json, sys
from pathlib import Path
import torch
from nsa.ops.triton.function import nsa_triton_apply
from nsa.ops.tuning import tuning_for
from nsa.ops.testing import rel_rms
C = Path("bench/captured")
meta = json.loads((C / "meta.json").read_text())
base = tuning_for("cuda")
names = ("o", "dq", "dk_cmp", "dv_cmp", "dk_slc", "dv_slc", "dk_win", "dv_win", "dgates")
def run(xs, do, hp, sel, dtype):
    x = [a.detach().to(dtype).clone().requires_grad_() for a in xs]
    o, bi = nsa_triton_apply(*x, **hp, tuning=dataclasses.replace(base, select=sel))
    g = torch.autograd.grad(o, x, do.to(dtype))
    return bi, [t.float() for t in (o, *g)]
for e in meta["captures"]:
    if e["T"] not in (8192, 65536): continue
    s = torch.load(C / e["file"], map_location="cuda", weights_only=True)
    xs = [s[n].contiguous() for n in ("q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates")]
    hp = {k: e["op"][k] for k in ("l", "d", "l_sel", "n_sel", "w")} | dict(scale=xs[0].shape[-1] ** -0.5)
    do = torch.randn(xs[0].shape[:3] + (xs[6].shape[-1],), device="cuda", dtype=xs[0].dtype, generator=torch.Generator("cuda").manual_seed(1))
    tok = dataclasses.replace(base.select, loop="token")
    bi32, ref = run(xs, do, hp, tok, torch.float32)
    res = {}
    for label, sel in [("token", tok), ("block-input", dataclasses.replace(base.select, loop="block", pair_dtype="input")),
                       ("block-fp32", dataclasses.replace(base.select, loop="block", pair_dtype="fp32", dq_pair_dtype="fp32")),
                       ("block-preset", dataclasses.replace(base.select, loop="block"))]:
        bi, out = run(xs, do, hp, sel, torch.bfloat16)
        res[label] = out
        same = (bi == bi32).all(-1).float().mean().item()
        print(f"T={e['T']} L{e['layer']} {label:12s} vs fp32: bi rows equal {same:.5f} " + " ".join(f"{n} {rel_rms(a, b):.2e}" for n, a, b in zip(names, out, ref)), flush=True)
    for lab in ("block-input", "block-preset"):
        print(f"T={e['T']} L{e['layer']} {lab} vs token: " + " ".join(f"{n} {rel_rms(a, b):.2e}" for n, a, b in zip(names, res[lab], res["token"])), flush=True)
