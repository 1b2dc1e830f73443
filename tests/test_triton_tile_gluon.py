"""The Gluon tile forward (nsa/ops/triton/tile_gluon.py). Gluon has no interpreter, so on the CPU: which
calls it takes, its knob, and that it compiles for sm_90 (Triton's ptxas, no GPU) without spills in few
enough registers for three programs per SM; on a GPU (`gpu`): bitwise the Triton tile kernel's output."""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nsa.ops import route
from nsa.ops.triton import select_tile as tt
from nsa.ops.triton import tile_gluon as tg
from nsa.ops.triton import walk_gluon as wg
from nsa.ops.tuning import SelectTuning, TileLaunch, TileTuning, tuning_for

ROOT = Path(__file__).resolve().parents[1]
# the start of a compile-only snippet: every Triton launch compiles for sm_90 and returns (bench_regs.compile_only),
# into `seen`; the launchers see CUDA tensors so they make the GPU's choices
SM90_PREAMBLE = r"""
import torch
from test_pipeline_bench import load_bench
br = load_bench("bench_regs")
seen = br.compile_only(90)
torch.Tensor.is_cuda = property(lambda self: True)
"""


def sm90_reports(snippet: str) -> tuple[list[str] | None, str]:
    """(the REPORT lines a compile-only snippet prints, its stderr), run compiled in a subprocess from tests/; None
    for the lines when this Triton has no ptxas. Compiled, not interpreted: the suite's TRITON_INTERPRET would turn
    the kernels' helpers into Python (0, not unset: conftest, imported with load_bench, sets it only when absent)."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, "-c", SM90_PREAMBLE + snippet], cwd=ROOT / "tests", env=env,
                       capture_output=True, text=True, timeout=600)
    lines = [x for x in r.stdout.splitlines() if x.startswith("REPORT")]
    if not lines and ("ptxas" in r.stderr.lower() and "not found" in r.stderr.lower()):
        return None, r.stderr
    return lines, r.stderr


def test_rows_2d_views():
    from nsa.ops.plan import _rows_2d
    k = torch.zeros(2, 96, 4, 128, dtype=torch.bfloat16)
    assert _rows_2d(k)
    fused = torch.zeros(2, 96, 3, 4, 128, dtype=torch.bfloat16)      # a fused qkv projection's slice
    assert _rows_2d(fused[:, :, 1])
    assert not _rows_2d(k.transpose(1, 2).contiguous().transpose(1, 2))   # heads not adjacent rows
    assert not _rows_2d(k[..., :64])                                       # head stride != d


def test_gluon_fwd_not_taken_off_hopper_shapes():
    """The plan takes the Gluon tile kernels at the paper shape on sm90 (64 / 128 rows), not off it."""
    from nsa.ops.plan import select_plan, sample_inputs
    from nsa.ops.tuning import HOPPER
    paper = sample_inputs("sm90", "paper", 8192)
    eight = HOPPER.replace(tile=dataclasses.replace(HOPPER.tile, m=8, group=0))
    assert select_plan(paper, HOPPER).fwd == "tile_gluon" and select_plan(paper, eight).fwd == "tile_gluon"
    assert select_plan(sample_inputs("cpu", "paper", 8192), HOPPER).fwd == "tile"             # no CUDA
    assert select_plan(sample_inputs("sm80", "paper", 8192), HOPPER).fwd == "tile"            # no Gluon
    two = HOPPER.replace(tile=dataclasses.replace(HOPPER.tile, m=2, group=0))
    assert select_plan(paper, two).fwd == "tile"                                               # 32 rows
    assert select_plan(dataclasses.replace(paper, l_sel=32), HOPPER).fwd == "tile"            # l_sel != 64
    assert select_plan(dataclasses.replace(paper, refused=frozenset({"gluon_tile"})), HOPPER).fwd == "tile"


@pytest.mark.parametrize("bad", [1, -2])
@pytest.mark.parametrize("knob", ["gluon_fwd_stages", "gluon_dq_stages", "gluon_dq_short_stages", "gluon_walk_stages"])
def test_gluon_stages_knob_is_validated(bad, knob):
    cls = SelectTuning if knob == "gluon_walk_stages" else TileTuning
    with pytest.raises(ValueError, match=knob):
        cls(**{knob: bad})
    assert TileTuning(gluon_fwd_stages=3).gluon_fwd_stages == 3
    with pytest.raises(ValueError, match="gluon_dq_short_t"):
        TileTuning(gluon_dq_short_t=-1)


@pytest.mark.parametrize("T,short_t,want", [(130, 0, 2), (130, 131, 3), (130, 130, 2)])
def test_gluon_dq_slots_follow_the_call_length(T, short_t, want, monkeypatch):
    """Calls shorter than gluon_dq_short_t tokens get gluon_dq_short_stages ring slots, the others
    gluon_dq_stages: the plan's (sm90, paper shape) reach the launcher (stubbed to record them: no Gluon on the CPU)."""
    from nsa.ops.plan import select_plan, sample_inputs
    from nsa.ops.tuning import HOPPER
    gen = torch.Generator().manual_seed(4)
    B, HQ, H, d, m = 1, 8, 2, 16, 4
    q, k, v, do = (torch.randn(B, T, n, d, generator=gen) for n in (HQ, H, H, HQ))
    from test_triton_tile import make_block_idx
    bi = make_block_idx(B, T, H, 2, 16, "random", gen, device="cpu")
    un = tt.tile_unions(bi, m)
    lse = torch.zeros(B, T, HQ)
    seen = []
    monkeypatch.setattr(tt, "gtile_dq", lambda *a, stages, **kw: seen.append(stages))   # None: Triton runs
    tn = TileTuning(m=m, gluon_dq_stages=2, gluon_dq_short_t=short_t, gluon_dq_short_stages=3)
    plan = select_plan(sample_inputs("sm90", "paper", T), HOPPER.replace(tile=tn))
    tt.tile_dq(q, k, v, do, lse, lse, None, un, l_sel=16, scale=0.25, m=m, tuning=tn, gluon_stages=plan.dq_gluon)
    assert seen == [want]


def test_a_failing_gluon_kernel_falls_back_to_triton_once(monkeypatch):
    """Gluon is experimental: a build / launch failure warns once, is counted, and the Triton kernels take
    that call and every later one on the device (the interpreter runs them here): the failure is refused in the
    one registry (nsa/ops/fallbacks.py), which the plan reads (`slots` stands in for it: no Gluon plan on the CPU)."""
    from nsa.ops import fallbacks
    from nsa.ops.fallbacks import fallback_counts
    from test_triton_tile import make_block_idx
    gen = torch.Generator().manual_seed(3)
    B, T, HQ, H, d, m = 1, 130, 8, 2, 16, 4
    q, k, v, do = (torch.randn(B, T, n, d, generator=gen) for n in (HQ, H, H, HQ))
    bi = make_block_idx(B, T, H, 2, 16, "random", gen, device="cpu")
    un = tt.tile_unions(bi, m)
    plain = TileTuning(m=m)
    want = tt.slc_fwd_tile(q, k, v, bi, l_sel=16, scale=0.25, m=m, union=un, tuning=plain)
    dq_want = tt.tile_dq(q, k, v, do, want[1], want[1], None, un, l_sel=16, scale=0.25, m=m, tuning=plain)
    calls = []

    def broken(*a, **kw):
        calls.append(1)
        raise RuntimeError("async_copy_global_to_shared has been removed")

    def slots() -> int:
        return 0 if fallbacks.refused("gluon_tile", ("cpu",)) else 2

    monkeypatch.setattr(tg, "_fwd", broken)
    monkeypatch.setattr(tg, "_dq", broken)
    fallbacks.reset_refusals()
    before = fallback_counts().get("tile_gluon->triton", 0)
    gl = TileTuning(m=m, gluon_fwd_stages=2, gluon_dq_stages=2)
    try:
        with pytest.warns(RuntimeWarning, match="Gluon tile forward failed.*using the Triton kernels"):
            got = tt.slc_fwd_tile(q, k, v, bi, l_sel=16, scale=0.25, m=m, union=un, tuning=gl, gluon_stages=slots())
        dq = tt.tile_dq(q, k, v, do, got[1], got[1], None, un, l_sel=16, scale=0.25, m=m, tuning=gl,
                        gluon_stages=slots())
        assert all(torch.equal(a, b) for a, b in zip(got, want)) and torch.equal(dq, dq_want)
        assert len(calls) == 1 and fallback_counts()["tile_gluon->triton"] == before + 1   # not retried
        assert "removed" in fallbacks.refused("gluon_tile", ("cpu",))
    finally:
        fallbacks.reset_refusals()


COMPILE = r"""
from nsa.ops.triton.select_tile import _tile_unions_torch
from nsa.ops.triton.tile_gluon import gtile_dq, gtile_fwd
from nsa.ops.triton.walk_gluon import gwalk_dkdv
T, HQ, H, D = 1024, 64, 4, 128
q = torch.randn(1, T, HQ, D).bfloat16()
k, v = torch.randn(1, T, H, D).bfloat16(), torch.randn(1, T, H, D).bfloat16()
un = _tile_unions_torch(br.selection(T, H, T // 64, 16, 64).to(torch.int32), 4)
o, lse = torch.empty_like(q), torch.empty(1, T, HQ)
gtile_fwd(q, k, v, un, o, lse, m=4, scale=D ** -0.5, stages=2)
from nsa.ops.triton.cmp_dense import _maps
from nsa.ops.triton.gates import Combine
gates = torch.rand(1, T, HQ, 3).bfloat16()
maps = _maps(T, (T - 32) // 16 + 1, HQ, H, 32, 16, "cpu", True)
for oc, rows in ((torch.randn_like(q), None), (torch.randn(1, maps.slot_src.numel(), D).bfloat16(), maps)):
    gtile_fwd(q, k, v, un, o, lse, m=4, scale=D ** -0.5, stages=2, combine=Combine.of(oc, o, gates, rows))
dq = torch.empty(1, T, HQ, D)
gtile_dq(q, k, v, torch.randn_like(q), lse, lse, lse, un, dq, dq, 1, m=4, scale=D ** -0.5, stages=2, has_gate=True)
from nsa.ops.triton.qsum import QAdd   # dq in q's dtype with the flash branches' gradients of q added (dq_fold)
add = QAdd(torch.randn(1, maps.slot_src.numel(), D).bfloat16(), maps.row_slot, torch.randn_like(q))
gtile_dq(q, k, v, torch.randn_like(q), lse, lse, lse, un, q.clone(), None, 1, m=4, scale=D ** -0.5, stages=2,
         has_gate=True, add=add)
from nsa.ops.fa4_accum import to_accum   # ... or as FA4's fp32 dq accumulators (fa4_accum.py)
acc = QAdd(None, maps.row_slot, None, to_accum(torch.randn(1, maps.slot_src.numel() // (16 * HQ), 16 * HQ, D), 0.1, 1),
           to_accum(torch.randn(1, T, HQ, D), 0.1, 1))
gtile_dq(q, k, v, torch.randn_like(q), lse, lse, lse, un, q.clone(), None, 1, m=4, scale=D ** -0.5, stages=2,
         has_gate=True, add=acc)
inv = {n: torch.zeros(16, dtype=torch.int64) for n in ("toks", "segoff", "wseg", "wchunk", "xoff")}
inv.update(w_max=8, nsb=T // 64, nseg=H * T // 64)
dk32 = torch.empty(1, T, H, D)
for dqp in (None, torch.empty(16 * T * HQ, D).bfloat16()):
    gwalk_dkdv(q, k, v, torch.randn_like(q), lse, lse, lse, 1, inv, dk32, dk32, dk32, dk32, chunk=1024,
               scale=D ** -0.5, stages=2, has_gate=True, dq_pairs=dqp)
from nsa.ops.triton.tile_group import group_tokens   # tiles of regrouped tokens: rows through TileUnion.perm
unp = un._replace(perm=group_tokens(br.selection(T, H, T // 64, 16, 64).to(torch.int32), 4, 16))
gtile_fwd(q, k, v, unp, o, lse, m=4, scale=D ** -0.5, stages=2, combine=Combine.of(oc, o, gates, rows))
gtile_dq(q, k, v, torch.randn_like(q), lse, lse, lse, unp, q.clone(), None, 1, m=4, scale=D ** -0.5, stages=2,
         has_gate=True, add=acc)
for _, _, _, kern in seen:
    rep = br.ptxas_report(kern.asm["ptx"], 90)
    print("REPORT", rep["regs"], rep["spill_stores"], kern.metadata.shared)
"""


@pytest.mark.skipif(not tg.gluon_available(), reason="this Triton has no Gluon for Hopper")
def test_gluon_kernels_compile_for_sm90_without_spills():
    lines, err = sm90_reports(COMPILE)
    if lines is None:
        pytest.skip("no ptxas in this Triton")
    assert len(lines) == 11, err[-2000:]
    (fregs, fspills, fshared), *combined, (dregs, dspills, dshared), folded, facc, (wregs, wspills, wshared), \
        (_, qspills, _), group, pfwd, pdq = ([int(x) for x in ln.split()[1:]] for ln in lines)
    assert group[1] == 0, group   # tile_group's greedy kernel (compiled on the way: its first launch)
    # rows through a token permutation (TileTuning.group): the combining forward and the accumulator-reading dq
    assert pfwd[0] <= 168 and pfwd[1] == 0 and pdq[0] <= 255 and pdq[1] == 0, (pfwd, pdq)
    # the forward that also writes the op's output (o's rows through a K/V slot, no more shared memory):
    # still three programs per SM, no spill, with o_cmp in q's rows and in the dense problem's
    for cregs, cspills, cshared in combined:
        assert cregs <= 168 and cspills == 0 and cshared <= 2 * 32 * 1024 + 1024, (cregs, cspills, cshared)
    # the walk writing dq partials holds a third accumulator (in halves): a few spilled words at most
    assert qspills <= 64, qspills
    # forward: three 4-warp programs per SM, <= 168 registers (65536 / 384); dq (q, dO and dq held): two,
    # <= 255 (also adding the flash branches' gradients of q: `folded`, from FA4's accumulators: `facc`); both
    # with two 32 KB K/V slots plus
    # barriers. The walk (dK and dV held): two programs per SM,
    # K / V, two q / dO slots and the P / dS operands within half an SM's 228 KB. None spills.
    assert fregs <= 168 and dregs <= 255 and folded[0] <= 255 and facc[0] <= 255 and wregs <= 255, \
        (fregs, dregs, folded, facc, wregs)
    assert fspills == dspills == folded[1] == facc[1] == wspills == 0, (fspills, dspills, folded, facc, wspills)
    assert max(fshared, dshared) <= 2 * 32 * 1024 + 1024 and wshared <= 228 * 1024 // 2 - 1024, \
        (fshared, dshared, wshared)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B,T,dtype", [(1, 8192, torch.bfloat16), (1, 65536, torch.bfloat16),
                                       (2, 4000, torch.bfloat16), (2, 4000, torch.float16)])
@pytest.mark.parametrize("m", [4, 8])   # one warpgroup (64 rows) or two (128 rows)
@pytest.mark.parametrize("group", [0, 16])   # tiles of consecutive tokens, or of regrouped ones (TileTuning.group)
def test_gpu_gluon_tile_kernels_are_bitwise_the_triton_ones(B, T, dtype, m, group):
    from test_triton_tile import make_block_idx
    if not tg.gluon_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs Gluon on a Hopper GPU")
    if group and T > 8192:
        pytest.skip("regrouped tiles: 4k and 8k cover them")
    gen = torch.Generator(device="cuda").manual_seed(T)
    HQ, H, d = 64, 4, 128
    qkv = torch.randn(B, T, HQ + 2 * H, d, generator=gen, device="cuda").to(dtype)   # k / v as strided views
    q, k, v = qkv[:, :, :HQ], qkv[:, :, HQ:HQ + H], qkv[:, :, HQ + H:]
    from nsa.ops.plan import plan_call
    tn = tuning_for("cuda")
    tn = tn.replace(tile=dataclasses.replace(tn.tile, m=m, min_g=1))
    nc = (T - 32) // 16 + 1
    kc = torch.zeros(B, nc, H, d, device="cuda", dtype=dtype)
    assert plan_call(q, kc, kc, k, v, l=32, d=16, l_sel=64, n_sel=16, w=512, tuning=tn).fwd == "tile_gluon"
    # the Triton kernels on whole 64-key blocks, as the Gluon ones (the preset splits blocks at 128 rows)
    same = dict(fwd=(TileLaunch(64, 4, 3), TileLaunch(64, 8, 3)), dq=(TileLaunch(64, 4, 2), TileLaunch(64, 8, 2)))
    for mode in ("random", "local"):
        bi = make_block_idx(B, T, H, 16, 64, mode, gen, device="cuda").to(torch.int32)
        un = tt.tile_unions(bi, m, group=group)
        # ring slots (0: the Triton kernel)
        run = {s: tt.slc_fwd_tile(q, k, v, bi, l_sel=64, scale=d ** -0.5, m=m, union=un,
                                  tuning=TileTuning(m=m, gluon_fwd_stages=s, **same), gluon_stages=s)
               for s in (0, 2, 3)}
        if group:   # every row attends its own blocks in the same order: bitwise the consecutive tiles'
            plain = tt.slc_fwd_tile(q, k, v, bi, l_sel=64, scale=d ** -0.5, m=m, tuning=TileTuning(m=m, **same))
            assert all(torch.equal(a, b) for a, b in zip(run[0], plain)), f"{mode}: regrouped tiles differ"
        for key in (2, 3):
            for name, a, b in zip(("o", "lse"), run[key], run[0]):
                assert torch.equal(a, b), f"{mode} stages={key}: {name} differs from the Triton kernel"
        # dq: with the branch gate and an fp32 dq_in to accumulate, and without either
        do = torch.randn(B, T, HQ, d, generator=gen, device="cuda").to(dtype)
        lse, delta = run[0][1], torch.randn(B, T, HQ, generator=gen, device="cuda")
        gate = torch.rand(B, T, HQ, 3, generator=gen, device="cuda").to(dtype)[..., 1]
        dq_in = torch.randn(B, T, HQ, d, generator=gen, device="cuda")
        for g, acc in ((gate, dq_in), (None, None)):
            want, *got = (tt.tile_dq(q, k, v, do, lse, delta, g, un, l_sel=64, scale=d ** -0.5, m=m,
                                     dq_in=None if acc is None else acc.clone(), dq_dtype=torch.float32,
                                     tuning=TileTuning(m=m, gluon_dq_stages=s, **same),
                                     gluon_stages=s)
                          for s in (0, 2))
            for x in got:
                assert torch.equal(x, want), f"{mode} gate={g is not None}: Gluon dq differs"
        # the op's output written by the forward's epilogue (TileTuning.gluon_combine), o_cmp in q's rows and
        # in the dense compressed problem's: bitwise the combine kernel's
        from nsa.ops.triton.cmp_dense import _maps
        from nsa.ops.triton.gates import Combine, combine
        gates = torch.rand(B, T, HQ, 3, generator=gen, device="cuda").to(dtype)
        o_win = torch.randn(B, T, HQ, d, generator=gen, device="cuda").to(dtype)
        maps = _maps(T, (T - 32) // 16 + 1, HQ, H, 32, 16, "cuda", True)
        for o_cmp, rows in ((torch.randn(B, T, HQ, d, generator=gen, device="cuda").to(dtype), None),
                            (torch.randn(B, maps.slot_src.numel(), d, generator=gen, device="cuda").to(dtype), maps)):
            cb = Combine.of(o_cmp, o_win, gates, rows)
            o_s, lse_s = tt.slc_fwd_tile(q, k, v, bi, l_sel=64, scale=d ** -0.5, m=m, union=un, combine=cb,
                                         tuning=TileTuning(m=m, gluon_fwd_stages=2, gluon_combine=True), gluon_stages=2)
            assert torch.equal(o_s, run[0][0]) and torch.equal(lse_s, run[0][1])
            want = combine(o_cmp, run[0][0], o_win, gates, rows)
            assert torch.equal(cb.out, want), f"{mode} rows={rows is not None}: fused combine differs"


def walk_inputs(B, T, HQ, H, d, gen):
    """bf16 q, k, v, dO, the rows' fp32 lse (log-sum-exps about 8 above the scores) and delta, and the
    selection branch's gate: a dK/dV walk's operands on the GPU."""
    def r(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").bfloat16()

    q, k, v, do = r(B, T, HQ, d), r(B, T, H, d), r(B, T, H, d), r(B, T, HQ, d)
    lse = torch.randn(B, T, HQ, generator=gen, device="cuda") + 8.0
    delta = torch.randn(B, T, HQ, generator=gen, device="cuda")
    gate = torch.rand(B, T, HQ, 3, generator=gen, device="cuda").bfloat16()[..., 1]
    return q, k, v, do, lse, delta, gate


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T,chunk", [(8192, 1024), (8192, 256), (65536, 1024)])
def test_gpu_gluon_walk_is_bitwise_the_triton_walk(T, chunk):
    """dK / dV of the walk without dq partials (several chunks per block at chunk=256: the fp32 partials
    and their reduction), on the Gluon kernel and on the Triton one under the Hopper preset's walk knobs."""
    import dataclasses
    from test_triton_tile import make_block_idx
    from nsa.ops.triton import select as tsel
    if not tg.gluon_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs Gluon on a Hopper GPU")
    gen = torch.Generator(device="cuda").manual_seed(T + chunk)
    B, HQ, H, d = 1, 64, 4, 128
    q, k, v, do, lse, delta, gate = walk_inputs(B, T, HQ, H, d, gen)
    from nsa.ops.plan import sample_inputs, select_plan
    from nsa.ops.route import walk_plan
    base = tuning_for("cuda").select
    assert select_plan(sample_inputs("sm90", "paper", T), tuning_for("cuda")).walk.gluon   # the plan takes it here
    for mode in ("random", "local"):
        bi = make_block_idx(B, T, H, 16, 64, mode, gen, device="cuda")
        walks = {s: walk_plan(dataclasses.replace(base, gluon_walk_stages=s), HQ // H, False, False, lambda r: True)
                 for s in (2, 0)}
        got, want = (tsel.slc_dkdv(q, k, v, bi, do, lse, delta, gate, l_sel=64, scale=d ** -0.5, chunk=chunk,
                                   tuning=base, walk=walks[s]) for s in (2, 0))
        for name, a, b in zip(("dk", "dv"), got, want):
            assert torch.isfinite(a).all() and torch.equal(a, b), f"{mode}: Gluon {name} differs from the Triton walk"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [8192, 65536])
def test_gpu_gluon_walk_with_dq_pairs_is_bitwise_the_triton_walk(T):
    """The walk that also writes each (token, block) pair's dq partial (select.gluon_dq_walk_stages, on in
    the Hopper preset): dK, dV and every partial bitwise the Triton walk's."""
    import dataclasses
    from test_triton_tile import make_block_idx
    from nsa.ops.triton import select as tsel
    from nsa.ops.route import walk_plan
    from nsa.ops.triton.select_block import pair_buffer
    if not tg.gluon_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs Gluon on a Hopper GPU")
    gen = torch.Generator(device="cuda").manual_seed(T + 1)
    B, HQ, H, d = 1, 64, 4, 128
    q, k, v, do, lse, delta, gate = walk_inputs(B, T, HQ, H, d, gen)
    base = tuning_for("cuda").select
    bi = make_block_idx(B, T, H, 16, 64, "random", gen, device="cuda")
    inv = tsel.invert_selection(bi, 64, 1024, ranks=True)
    runs = []
    for s in (2, 0):
        tn = dataclasses.replace(base, gluon_dq_walk_stages=s)
        dqp = pair_buffer(q, 16, H, d, route.pair_plan(tn, 1), dq=True).zero_()
        dk, dv = tsel.slc_dkdv(q, k, v, bi, do, lse, delta, gate, l_sel=64, scale=d ** -0.5, chunk=1024,
                               tuning=tn, inv=inv, dq_pairs=dqp, walk=walk_plan(tn, HQ // H, False, True, lambda r: True))
        runs.append((dk, dv, dqp[:inv["n_pairs"] * (HQ // H)]))
    for name, a, b in zip(("dk", "dv", "dq pairs"), *runs):
        assert torch.isfinite(a).all() and torch.equal(a, b), f"T={T}: Gluon {name} differs from the Triton walk"


@pytest.mark.skipif(not tg.gluon_available(), reason="this Triton has no Gluon for Hopper")
def test_walk_row_prefetch_reaches_the_walk_kernel(monkeypatch):
    """The Gluon walk's ROW_PF is on without dq partials (no GPU: the walk is a stand-in that records its
    constexprs and returns), and never with them, where the prefetch spills."""
    from nsa.ops.triton import select as tsel
    from test_triton_tile import make_block_idx
    seen = []

    class Walk:   # kernel[grid](*args, **constexprs)
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append((kw["ROW_PF"], kw["DQ_PAIRS"]))

    monkeypatch.setattr(wg, "_walk_kernel", lambda: Walk())
    from nsa.ops.route import walk_plan
    T, HQ, H, D = 128, 64, 4, 128
    g = torch.Generator().manual_seed(3)
    q, do = (torch.randn(1, T, HQ, D, generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(1, T, H, D, generator=g).bfloat16() for _ in range(2))
    lse = torch.zeros(1, T, HQ)
    bi = make_block_idx(1, T, H, 2, 64, "random", torch.Generator().manual_seed(1), device="cpu")
    tn = SelectTuning(gluon_walk_stages=2, gluon_dq_walk_stages=2)
    tsel.slc_dkdv(q, k, v, bi, do, lse, lse, None, l_sel=64, scale=0.1, tuning=tn,
                  walk=walk_plan(tn, HQ // H, False, False, lambda r: True))
    inv = tsel.invert_selection(bi, 64, 1024, ranks=True)
    tsel.slc_dkdv(q, k, v, bi, do, lse, lse, None, l_sel=64, scale=0.1, tuning=tn, inv=inv,
                  dq_pairs=torch.empty(inv["toks"].numel() * (HQ // H), D).bfloat16(),
                  walk=walk_plan(tn, HQ // H, False, True, lambda r: True))
    assert seen == [(True, False), (False, True)]
