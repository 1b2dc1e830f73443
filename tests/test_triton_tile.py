"""Query-tile selection kernels (nsa/ops/triton/select_tile.py) against the per-token kernels
(select.slc_fwd / slc_bwd), an fp64 oracle of the selection branch and nsa.ops.reference.

On the CPU through Triton's interpreter (tiny odd shapes); outputs are NaN-poisoned (conftest), so an
element a kernel leaves unwritten fails. The `gpu` tests compare tile and per-token kernels in bf16 at
8k and 64k (per-kernel timings of tiles against the per-token kernels: `bench/bench_profile.py kernels
--compare tile.m=1 tile.m=4 ...`).
"""
import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

triton = pytest.importorskip("triton")

from nsa.ops import route  # noqa: E402
from nsa.ops.reference import nsa_reference  # noqa: E402
from nsa.ops.triton import scores_unfused as tsu  # noqa: E402
from nsa.ops.triton import select as tsel  # noqa: E402
from nsa.ops.triton import select_tile as tt  # noqa: E402
from nsa.ops.triton.function import nsa_triton_apply  # noqa: E402
from nsa.ops.testing import INPUT_NAMES, make_inputs  # noqa: E402
from nsa.ops.tuning import TileLaunch, TileTuning, tuning_for  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("poison_allocations")   # unwritten outputs fail (conftest)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def tol(dtype) -> float:   # as tests/test_triton_kernels.py (gradients get twice this)
    if dtype == torch.float16:
        return 5e-3
    return 5e-3 if DEV == "cuda" else 1e-5


def make_block_idx(B, T, H, n_sel, l_sel, mode, gen, device=DEV):
    """Valid block_idx [B,T,H,n_sel] (ascending, -1 padded, forced blocks: own, 0, previous):
    random: independent scores per token (partly shared tiles); identical: one score per (b, h, block),
    so tokens of one block choose the same set; local: scores constant over runs of 32 tokens; own:
    n_sel = 1 (tiles spanning blocks select disjoint sets)."""
    nsb = triton.cdiv(T, l_sel)
    shape = {"random": (B, T, H, nsb), "identical": (B, 1, H, nsb), "own": (B, T, H, nsb),
             "local": (B, triton.cdiv(T, 32), H, nsb)}[mode]
    s = torch.rand(*shape, generator=gen, device=gen.device).to(device)
    if mode == "local":
        s = s.repeat_interleave(32, 1)[:, :T]
    t = torch.arange(T, device=device).view(1, T, 1, 1)
    j = torch.arange(nsb, device=device)
    cur = t // l_sel
    s = s + 40.0 * (j == cur) + 20.0 * (j == 0) + 10.0 * (j == cur - 1)   # forced, by priority
    s = torch.where(j <= cur, s.expand(B, T, H, nsb), -1.0)
    val, idx = s.topk(min(n_sel, nsb), -1)
    idx = torch.where(val >= 0, idx, nsb).sort(-1).values
    idx = torch.where(idx < nsb, idx, -1)
    if n_sel > nsb:
        idx = torch.cat([idx, idx.new_full((B, T, H, n_sel - nsb), -1)], -1)
    return idx


def tied_block_idx(B, T, H, n_sel, l_sel, gen, G=2, l=8, d=4):
    """block_idx from the real top-n kernel on scores with many exact ties (ties go to the lower index)."""
    nsb = triton.cdiv(T, l_sel)
    sc = torch.randint(0, 3, (B, H, T, nsb), generator=gen).float() / 7.0
    return tsu.select_topn(sc.to(DEV), G=G, l=l, d=d, l_sel=l_sel, n_sel=n_sel)


def oracle(q, k, v, bi, gate, do, l_sel, scale):
    """fp64 selection branch from its definition: row (t, hq) attends keys s <= t whose block s // l_sel
    is in block_idx[t, hq // G]. Returns o, lse and the gradients of sum(gate * dO * o)."""
    B, T, HQ, _ = q.shape
    G = HQ // k.shape[2]
    q, k, v = (x.detach().double().cpu().requires_grad_() for x in (q, k, v))
    bi = bi.cpu().repeat_interleave(G, 2)                                  # [B,T,HQ,S]
    blk = torch.arange(T) // l_sel
    sel = (blk.view(1, 1, 1, T, 1) == bi[:, :, :, None, :]).any(-1)        # [B,T,HQ,T]
    mask = sel & (torch.arange(T).view(1, T) <= torch.arange(T).view(T, 1)).view(1, T, 1, T)
    kk, vv = k.repeat_interleave(G, 2), v.repeat_interleave(G, 2)
    logits = torch.einsum("bthd,bshd->bths", q, kk) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(logits, -1)
    o = torch.einsum("bths,bshd->bthd", torch.softmax(logits, -1), vv)
    w = do.double().cpu() * (1.0 if gate is None else gate.double().cpu()[..., None])
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), w)
    return o, lse, dq, dk, dv


def run_both(q, k, v, bi, do, gate, l_sel, scale, m, chunk, tuning=None):
    """(per-token, tile) results: each (o, lse, dq, dk, dv), with slc_bwd's delta convention."""
    out = []
    for tile in (False, True):
        if tile:
            o, lse = tt.slc_fwd_tile(q, k, v, bi, l_sel=l_sel, scale=scale, m=m, tuning=tuning)
        else:
            o, lse = tsel.slc_fwd(q, k, v, bi, l_sel=l_sel, scale=scale)
        delta = (do.float() * o.float()).sum(-1)                            # rowsum(dO * o), not gated
        kw = dict(l_sel=l_sel, scale=scale, chunk=chunk)
        if tile:
            g = tt.slc_bwd_tile(q, k, v, bi, do, lse, delta, gate, m=m, tuning=tuning, **kw)
        else:
            g = tsel.slc_bwd(q, k, v, bi, do, lse, delta, gate, **kw)
        out.append((o, lse) + tuple(g))
    return out


# B, T, HQ, H, dk, dv, l_sel, n_sel, m, mode, chunk, dtype
CASES = {
    "g2_m4_random": (1, 77, 4, 2, 16, 32, 16, 3, 4, "random", 1024, torch.float32),
    "g1_m8_disjoint": (1, 45, 2, 2, 32, 16, 4, 1, 8, "own", 1024, torch.float32),
    "g16_m2_identical": (1, 40, 16, 1, 16, 16, 8, 4, 2, "identical", 1024, torch.float32),
    "g2_m1_chunked": (2, 29, 4, 2, 16, 16, 8, 3, 1, "random", 4, torch.float32),
    "g3_m8_lsel24_chunked": (1, 61, 6, 2, 16, 16, 24, 3, 8, "random", 7, torch.float32),
    "g1_m16_long_local": (1, 151, 1, 1, 16, 16, 8, 5, 16, "local", 1024, torch.float32),
    "g2_m3_ties": (1, 53, 4, 2, 16, 16, 8, 4, 3, "ties", 1024, torch.float32),
    "g16_m8_random": (1, 41, 16, 1, 16, 16, 8, 3, 8, "random", 16, torch.float32),
    "fp16_g2_m4": (1, 45, 4, 2, 32, 32, 16, 3, 4, "random", 1024, torch.float16),
}

def case_inputs(case, seed):
    B, T, HQ, H, dk, dv, l_sel, n_sel, m, mode, chunk, dtype = CASES[case]
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen).to(DEV, dtype)

    q, k, v, do = r(B, T, HQ, dk), r(B, T, H, dk), r(B, T, H, dv), r(B, T, HQ, dv)
    gates = torch.rand(B, T, HQ, 3, generator=gen).to(DEV, dtype)
    bi = tied_block_idx(B, T, H, n_sel, l_sel, gen) if mode == "ties" else \
        make_block_idx(B, T, H, n_sel, l_sel, mode, gen)
    return q, k, v, do, gates[..., 1], bi, dk ** -0.5


@pytest.mark.parametrize("case", list(CASES))
def test_tile_matches_per_token_and_oracle(case):
    B, T, HQ, H, dk, dv, l_sel, n_sel, m, mode, chunk, dtype = CASES[case]
    q, k, v, do, gate, bi, scale = case_inputs(case, seed=sum(map(ord, case)))
    assert (bi[:, 0] == -1).any() or n_sel == 1, "early tokens should have -1 padded rows"
    per_tok, tile = run_both(q, k, v, bi, do, gate, l_sel, scale, m, chunk, tuning=TileTuning())
    ref = oracle(q, k, v, bi, gate, do, l_sel, scale)
    for name, a, b, r in zip(("o", "lse", "dq", "dk", "dv"), tile, per_tok, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.isfinite(a).all(), f"non-finite {name}"
        f = 1 if name in ("o", "lse") else 2
        assert rel_err(a, b) <= tol(dtype) * f, f"{name} vs per-token: {rel_err(a, b):.2e}"
        assert rel_err(a, r) <= tol(dtype) * f, f"{name} vs oracle: {rel_err(a, r):.2e}"


def test_tile_matches_reference_op():
    """Selection branch alone (one-hot gates) of nsa.ops.reference, with its own block_idx."""
    B, T, HQ, H, dk, l, d, l_sel, n_sel, w = 1, 61, 4, 2, 16, 8, 4, 16, 3, 16
    gen = torch.Generator().manual_seed(3)
    N = (T - l) // d + 1
    x = [torch.randn(*s, generator=gen, dtype=torch.float64).requires_grad_() for s in
         ((B, T, HQ, dk), (B, N, H, dk), (B, N, H, dk), (B, T, H, dk), (B, T, H, dk), (B, T, H, dk), (B, T, H, dk))]
    gates = torch.zeros(B, T, HQ, 3, dtype=torch.float64)
    gates[..., 1] = 1.0
    ro, rbi = nsa_reference(*x, gates, l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w)
    do = torch.randn(ro.shape, generator=gen, dtype=torch.float64)
    rdq, rdk, rdv = torch.autograd.grad(ro, (x[0], x[3], x[4]), do)
    q, k, v = (a.detach().float().to(DEV) for a in (x[0], x[3], x[4]))
    bi, do32, g = rbi.to(DEV), do.float().to(DEV), gates[..., 1].float().to(DEV)
    for m in (2, 4):
        o, lse = tt.slc_fwd_tile(q, k, v, bi, l_sel=l_sel, scale=dk ** -0.5, m=m)
        delta = (do32 * o).sum(-1)
        dq, dk_, dv = tt.slc_bwd_tile(q, k, v, bi, do32, lse, delta, g, l_sel=l_sel, scale=dk ** -0.5, m=m)
        assert rel_err(o, ro) <= tol(torch.float32)
        for name, a, b in (("dq", dq, rdq), ("dk", dk_, rdk), ("dv", dv, rdv)):
            assert rel_err(a, b) <= 2 * tol(torch.float32), f"m={m} {name}: {rel_err(a, b):.2e}"


def test_sub_block_keys_and_multi_tile_steps():
    """Key tiles smaller than a block (l_sel=24 in 16-key steps, the last partly past the block) in fwd
    and dq, at m=8 and m=2 (dK/dV: select.py's token walk, chunk 7)."""
    case = "g3_m8_lsel24_chunked"
    q, k, v, do, gate, bi, scale = case_inputs(case, seed=11)
    ref = oracle(q, k, v, bi, gate, do, 24, scale)
    small = (TileLaunch(16, 4, 2), TileLaunch(16, 4, 2))
    for m in (8, 2):
        tn = TileTuning(fwd=small, dq=small)
        o, lse = tt.slc_fwd_tile(q, k, v, bi, l_sel=24, scale=scale, m=m, tuning=tn)
        delta = (do * o).sum(-1)
        grads = tt.slc_bwd_tile(q, k, v, bi, do, lse, delta, gate, l_sel=24, scale=scale, m=m, chunk=7,
                                tuning=tn)
        for name, a, r in zip(("o", "lse", "dq", "dk", "dv"), (o, lse) + grads, ref):
            f = 1 if name in ("o", "lse") else 2
            assert rel_err(a, r) <= tol(torch.float32) * f, f"m={m} {name}: {rel_err(a, r):.2e}"


@pytest.mark.parametrize("chunk", [1024, 5])
def test_op_with_tile_m4_matches_per_token(chunk, monkeypatch):
    """The whole op (nsa_triton_apply) with KernelTuning.tile.m=4 against m=1 (the per-token kernels)
    and the fp64 reference: same block_idx, o and every gradient, at test_triton_kernels' tolerances."""
    from nsa.ops.triton import function as fn
    calls = []

    def spy(name):
        real = getattr(fn, name)
        return lambda *a, **k: calls.append(name) or real(*a, **k)

    for name in ("slc_fwd", "slc_bwd", "slc_fwd_tile", "slc_bwd_tile"):   # which selection kernels run
        monkeypatch.setattr(fn, name, spy(name))
    B, T, HQ, H, dk, dv = 1, 45, 4, 2, 16, 16
    hp = dict(l=8, d=4, l_sel=8, n_sel=3, w=8)
    args = [a.requires_grad_() for a in make_inputs(B, T, HQ, H, dk, dv, l=hp["l"], d=hp["d"],
                                                     dtype=torch.float32, device=DEV, seed=21)]
    ref_args = [a.detach().double().cpu().requires_grad_() for a in args]
    ro, rbi = nsa_reference(*ref_args, **hp)
    do = torch.randn(ro.shape, generator=torch.Generator().manual_seed(7)).to(DEV)
    rgrads = torch.autograd.grad(ro, ref_args, do.double().cpu())
    base = tuning_for(DEV)
    runs = {}
    for m in (1, 4):
        tn = base.replace(tile=TileTuning(m=m))
        o, bi = nsa_triton_apply(*args, **hp, scale=dk ** -0.5, dkdv_chunk=chunk, tuning=tn)
        runs[m] = (o,) + torch.autograd.grad(o, args, do)
        assert torch.equal(bi.cpu(), rbi), f"m={m}: selected blocks differ from the reference"
        want = ["slc_fwd", "slc_bwd"] if m == 1 else ["slc_fwd_tile", "slc_bwd_tile"]
        assert calls == want, f"m={m}: ran {calls}"
        calls.clear()
    for name, a, b, r in zip(["o"] + [f"d{n}" for n in INPUT_NAMES], runs[4], runs[1], (ro,) + rgrads):
        f = 1 if name == "o" else 2
        assert torch.isfinite(a).all(), f"non-finite {name}"
        assert rel_err(a, b) <= tol(torch.float32) * f, f"{name} m=4 vs m=1: {rel_err(a, b):.2e}"
        assert rel_err(a, r) <= tol(torch.float32) * f, f"{name} m=4 vs reference: {rel_err(a, r):.2e}"


def test_dq_accumulates_into_dq_in():
    q, k, v, do, gate, bi, scale = case_inputs("g2_m4_random", seed=5)
    o, lse = tt.slc_fwd_tile(q, k, v, bi, l_sel=16, scale=scale, m=4)
    delta = (do * o).sum(-1)
    dq0, _, _ = tt.slc_bwd_tile(q, k, v, bi, do, lse, delta, gate, l_sel=16, scale=scale, m=4)
    acc = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(DEV)
    want = acc + dq0
    dq, _, _ = tt.slc_bwd_tile(q, k, v, bi, do, lse, delta, gate, l_sel=16, scale=scale, m=4,
                               dq_in=acc.clone(), dq_dtype=torch.float32)
    assert rel_err(dq, want) <= tol(torch.float32)
    dq2, _, _ = tt.slc_bwd_tile(q, k, v, bi, do, lse, delta, None, l_sel=16, scale=scale, m=4)
    ref = oracle(q, k, v, bi, None, do, 16, scale)
    assert rel_err(dq2, ref[2]) <= 2 * tol(torch.float32)


def brute_union(bi: torch.Tensor, m: int):
    """Python sets: per (b, h, tile) the ascending union and, per block, the bit mask of its tokens."""
    B, T, H, S = bi.shape
    out = {}
    for b in range(B):
        for h in range(H):
            for n in range(triton.cdiv(T, m)):
                bits = {}
                for i in range(m):
                    if n * m + i < T:
                        for j in bi[b, n * m + i, h].tolist():
                            if j >= 0:
                                bits[j] = bits.get(j, 0) | (1 << i)
                out[b, h, n] = sorted(bits.items())
    return out


def check_union(bi: torch.Tensor, m: int, un: "tt.TileUnion") -> None:
    B, T, H, _ = bi.shape
    nt, width = triton.cdiv(T, m), m * bi.shape[3]
    assert un.blocks.shape == un.bits.shape == (B, H, nt, width) and un.size.shape == (B, H, nt)
    assert un.blocks.dtype == un.bits.dtype == un.size.dtype == torch.int32
    want = brute_union(bi.cpu(), m)
    blocks, bits, size = un.blocks.cpu(), un.bits.cpu(), un.size.cpu()
    for (b, h, n), items in want.items():
        k = len(items)
        assert size[b, h, n] == k
        assert blocks[b, h, n, :k].tolist() == [j for j, _ in items]
        assert (blocks[b, h, n, k:] == -1).all() and (bits[b, h, n, k:] == 0).all()
        got_bits = [x & 0xFFFFFFFF for x in bits[b, h, n, :k].tolist()]   # bit 31 is int32's sign
        assert got_bits == [x for _, x in items], (b, h, n)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 32])
@pytest.mark.parametrize("mode", ["random", "identical", "own", "ties"])
def test_tile_unions_match_bruteforce(m, mode):
    gen = torch.Generator().manual_seed(m * 7 + len(mode))
    B, T, H, S, l_sel = 2, 75, 2, 4, 4
    bi = tied_block_idx(B, T, H, S, l_sel, gen) if mode == "ties" else \
        make_block_idx(B, T, H, 1 if mode == "own" else S, l_sel, mode, gen)
    check_union(bi, m, tt.tile_unions(bi, m))
    nt = triton.cdiv(T, m)
    total = int(tt.tile_unions(bi, m).size.sum())
    frac = tt.tile_union_fraction(bi, m)
    assert frac.dim() == 0 and frac.device == bi.device
    assert abs(frac.item() - total / (B * H * nt * m * bi.shape[3])) < 1e-6
    assert torch.equal(tt.tile_union_sizes(bi, m), tt.tile_unions(bi, m).size)


@pytest.mark.parametrize("m,mode", [(1, "random"), (3, "ties"), (8, "identical"), (32, "random")])
def test_union_kernel_matches_bruteforce(m, mode):
    """The Triton union kernel (what CUDA runs; tile_unions takes torch ops on the CPU), interpreted."""
    gen = torch.Generator().manual_seed(m)
    B, T, H, S, l_sel = 1, 37 if m < 8 else 70, 1, 4, 4
    bi = tied_block_idx(B, T, H, S, l_sel, gen) if mode == "ties" else make_block_idx(B, T, H, S, l_sel, mode, gen)
    blocks, bits, size = tt._run_union(bi, m, size_only=False)
    check_union(bi, m, tt.TileUnion(blocks, bits, size))
    assert torch.equal(tt._run_union(bi, m, size_only=True)[2], size)


def test_union_fraction_extremes():
    """Identical selections in a tile: fraction 1/m for full tiles; disjoint ones: 1."""
    gen = torch.Generator().manual_seed(0)
    bi = make_block_idx(1, 64, 1, 1, 8, "own", gen)                       # n_sel=1, block = t // 8
    assert tt.tile_union_fraction(bi, 8).item() == pytest.approx(1 / 8)
    bi = make_block_idx(1, 64, 1, 1, 1, "own", gen)                       # l_sel=1: all different
    assert tt.tile_union_fraction(bi, 4).item() == pytest.approx(1.0)


def test_bad_tile_size_and_union():
    q, k, v, do, gate, bi, scale = case_inputs("g2_m4_random", seed=1)
    with pytest.raises(ValueError, match="tile size m"):
        tt.slc_fwd_tile(q, k, v, bi, l_sel=16, scale=scale, m=0)
    with pytest.raises(ValueError, match="tile size m"):
        tt.tile_unions(bi, tt.MAX_M + 1)
    with pytest.raises(ValueError, match="TileTuning.m"):
        TileTuning(m=tt.MAX_M + 1)
    with pytest.raises(ValueError, match="union"):
        tt.slc_fwd_tile(q, k, v, bi, l_sel=16, scale=scale, m=4, union=tt.tile_unions(bi, 2))


# ----------------------------------------------------------------------------------------------
# GPU: tile vs per-token kernels in bf16 at long context


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [8192, 65536])
@pytest.mark.parametrize("HQ,H,d", [(64, 4, 128), (12, 2, 64)])
@pytest.mark.parametrize("mode", ["random", "local"])
def test_gpu_tile_matches_per_token(T, HQ, H, d, mode):
    gen = torch.Generator(device="cuda").manual_seed(T + HQ)
    l_sel, n_sel, B = 64, 16, 1

    def r(*s):
        return torch.randn(*s, generator=gen, device="cuda").bfloat16()

    q, k, v, do = r(B, T, HQ, d), r(B, T, H, d), r(B, T, H, d), r(B, T, HQ, d)
    gate = torch.rand(B, T, HQ, 3, generator=gen, device="cuda").bfloat16()[..., 1]
    bi = make_block_idx(B, T, H, n_sel, l_sel, mode, gen, device="cuda")
    for m in (2, 4, 8, 10):   # 10*G fills 64/128 rows at G=6
        tn = TileTuning()
        un, ref_un = tt.tile_unions(bi, m), tt._tile_unions_torch(bi, m)   # kernel vs torch ops
        assert un.perm is None and ref_un.perm is None   # consecutive tiles: no token permutation
        assert all(torch.equal(a, b) for a, b in zip(un[:3], ref_un[:3])), f"m={m}: union kernel differs"
        per_tok, tile = run_both(q, k, v, bi, do, gate, l_sel, d ** -0.5, m, 1024, tuning=tn)
        for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), tile, per_tok):
            assert torch.isfinite(a).all(), f"m={m}: non-finite {name}"
            assert rel_rms(a, b) <= 5e-3, f"m={m} {name}: {rel_rms(a, b):.2e}"
        again = run_both(q, k, v, bi, do, gate, l_sel, d ** -0.5, m, 1024, tuning=tn)[1]
        for name, a, b in zip(("dq", "dk", "dv"), tile[2:], again[2:]):
            assert torch.equal(a, b), f"m={m}: {name} not bitwise repeatable"
        del per_tok, tile, again


def captured_dir(env: str, name: str) -> Path:
    """A capture folder of bench/capture_inputs.py: $env, else bench/<name> of this checkout."""
    return Path(os.environ.get(env, Path(__file__).resolve().parents[1] / "bench" / name))


def captures_at(folder: Path, T: int) -> list[dict]:
    """meta.json's capture entries at T in folder ([] when there is none)."""
    meta = folder / "meta.json"
    if not meta.is_file():
        return []
    return [e for e in json.loads(meta.read_text())["captures"] if e["T"] == T]


CAPTURED_PAPER = captured_dir("NSA_CAPTURED_PAPER", "captured_paper")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [8192, 65536])
def test_gpu_preset_tiles_on_captured_paper_inputs(T):
    """The paper shape's captures (`bash bench/gpu.sh capture-paper 8192 65536`; NSA_CAPTURED_PAPER
    points elsewhere): the device preset, which runs query tiles on these local selections, against the
    per-token op (m=1): block_idx identical, o and every gradient within 0.5% relative RMS, also with the
    other grouping (consecutive tokens where the preset regroups them, else TileTuning.group=16)."""
    entries = captures_at(CAPTURED_PAPER, T)
    if not entries:
        pytest.skip(f"no captured inputs at T={T} under {CAPTURED_PAPER} (bash bench/gpu.sh capture-paper)")
    base = tuning_for("cuda")
    names = ("o", "dq", "dk_cmp", "dv_cmp", "dk_slc", "dv_slc", "dk_win", "dv_win", "dgates")
    for e in entries:
        saved = torch.load(CAPTURED_PAPER / e["file"], map_location="cuda", weights_only=True)
        xs = [saved[n].contiguous() for n in INPUT_NAMES]
        G = xs[0].shape[2] // xs[3].shape[2]
        if route.m_for(base.tile, G) == 1:
            pytest.skip(f"this device's preset runs no query tiles at G={G}")
        hp = {k: e["op"][k] for k in ("l", "d", "l_sel", "n_sel", "w")} | dict(scale=xs[0].shape[-1] ** -0.5)
        do = torch.randn(xs[0].shape[:3] + (xs[6].shape[-1],), device="cuda", dtype=xs[0].dtype,
                         generator=torch.Generator("cuda").manual_seed(T + e["layer"]))
        res = []
        other = dataclasses.replace(base.tile, group=0 if base.tile.group else 16)
        for tile in (TileTuning(), base.tile, other):
            x = [a.detach().clone().requires_grad_() for a in xs]
            o, bi = nsa_triton_apply(*x, **hp, tuning=base.replace(tile=tile))
            res.append((bi, o, *torch.autograd.grad(o, x, do)))
        where = f"T={T} layer {e['layer']}"
        assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][0], res[2][0]), f"{where}: block_idx differs"
        for tiled, how in ((res[1], "preset tiles"), (res[2], f"tiles with group={other.group}")):
            for name, a, b in zip(names, tiled[1:], res[0][1:]):
                assert torch.isfinite(a).all(), f"{where} {how}: non-finite {name}"
                assert rel_rms(a, b) <= 5e-3, f"{where} {how} {name}: {rel_rms(a, b):.2e}"
