"""Triton NSA on a GPU at long context: bf16 kernels vs the fp32 "torch" backend (itself tested
against the reference), forward and every gradient, plus determinism of the backward.

Run on a CUDA machine: ``pytest -m gpu tests/test_triton_gpu.py``. Skipped without CUDA.
"""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from nsa.ops import route  # noqa: E402
from nsa.ops import nsa_attention  # noqa: E402
from nsa.ops.common import num_cmp_tokens  # noqa: E402
from nsa.ops.plan import plan_call  # noqa: E402
from nsa.ops.testing import INPUT_NAMES as NAMES, rel_rms  # noqa: E402
from nsa.ops.triton import nsa_attention_triton, triton_available  # noqa: E402
from nsa.ops.tuning import CmpDenseTuning, FlashBranchTuning, tuning_for  # noqa: E402

HP = dict(l=32, d=16, l_sel=64, n_sel=16, w=512)


def with_cmp_dense(mode: str):
    """The GPU's preset with the compressed branch forced to `mode` (tuning.CmpDenseTuning)."""
    return tuning_for("cuda").replace(cmp_dense=CmpDenseTuning(mode))


def inputs(B, T, HQ, H, dk, dv, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    N = num_cmp_tokens(T, HP["l"], HP["d"])

    def r(*s):
        return torch.randn(*s, generator=g, device="cuda", dtype=torch.float32).bfloat16()

    x = dict(q=r(B, T, HQ, dk), k_cmp=r(B, N, H, dk), v_cmp=r(B, N, H, dv), k_slc=r(B, T, H, dk),
             v_slc=r(B, T, H, dv), k_win=r(B, T, H, dk), v_win=r(B, T, H, dv),
             gates=torch.rand(B, T, HQ, 3, generator=g, device="cuda").bfloat16())
    return x


def run(x, backend, dtype, do, tuning=None):
    args = [x[n].detach().to(dtype).requires_grad_() for n in NAMES]
    if backend == "triton":
        o, bi = nsa_attention_triton(*args, **HP, tuning=tuning)
    else:
        o, bi = nsa_attention(*args, **HP, backend=backend)
    grads = torch.autograd.grad(o, args, do.to(dtype), allow_unused=True)   # k_cmp unused when T < l
    grads = [torch.zeros_like(a) if g is None else g for a, g in zip(args, grads)]
    return o, bi, grads


@pytest.mark.parametrize("T,HQ,H,dk,dv", [(8192, 16, 2, 128, 64), (8192, 4, 4, 64, 64),
                                          (65536, 16, 1, 64, 64)])
def test_bf16_matches_fp32_torch(T, HQ, H, dk, dv):
    _check_vs_fp32_torch(T, HQ, H, dk, dv)


def plan_of(q, kc, tuning=None, H=None):
    """The op's plan (nsa/ops/plan.py) for q [B,T,HQ,d] and k_cmp = v_cmp [B,N,H,d] (k/v of the selection
    zeros like q's first H heads) under tuning (None: the device preset)."""
    ks = torch.zeros_like(q[:, :, :H or kc.shape[2]])
    return plan_call(q, kc, kc, ks, ks, **HP, tuning=tuning)


def test_paper_shape_on_query_tiles_matches_fp32_torch():
    """The paper's shape with the preset's selection (on Hopper: query tiles, the Gluon forward and dq)."""
    t = tuning_for("cuda")
    q = torch.zeros(1, 8192, 64, 128, device="cuda", dtype=torch.bfloat16)
    plan = plan_of(q, torch.zeros(1, 8, 4, 128, device="cuda", dtype=torch.bfloat16), t)
    assert (plan.fwd in ("tile", "tile_gluon")) == (route.m_for(t.tile, 16) > 1)
    _check_vs_fp32_torch(8192, 64, 4, 128, 128, tuning=t)


@pytest.mark.parametrize("backend", ["cudnn", "flash"])
def test_dense_cmp_branch_matches_fp32_torch(backend):
    """The compressed branch on a dense SDPA kernel (residue split, cmp_dense.py) inside the full op."""
    from nsa.ops.triton import cmp_dense
    be, why = cmp_dense.probe("cuda:0", torch.bfloat16, 128, 64, backends=(backend,))
    if be is None:   # e.g. flash refuses d_k != d_v
        pytest.skip(f"{backend} not usable here: {why}")
    _check_vs_fp32_torch(8192, 16, 2, 128, 64, tuning=with_cmp_dense(backend))


@pytest.mark.parametrize("modes", [dict(win="fa4"), dict(cmp="fa4"), dict(win="fa4", cmp="fa4"),
                                   dict(win="fa4", cmp="fa4", win_split_min_t=0)],
                         ids=["win", "cmp", "win+cmp", "win_split"])
@pytest.mark.parametrize("T,HQ,H,d", [(8192, 12, 2, 64), (65536, 12, 2, 64), (8192, 16, 2, 128)])
def test_flash_branches_match_fp32_torch(modes, T, HQ, H, d):
    """The window / compressed branch on FlashAttention-4 inside the full op: output and every
    gradient within the bf16 bound of the fp32 torch op, blocks identical (up to near-ties)."""
    from nsa.ops import flash
    x = torch.zeros(1, T, HQ, d, device="cuda", dtype=torch.bfloat16)
    tuning = tuning_for("cuda").replace(flash=FlashBranchTuning(**modes))
    for b in ("win", "cmp"):
        if b not in modes:
            continue
        be, why = flash.branch_flash_backend(b, tuning.flash, x, d)
        if be is None:
            pytest.skip(f"fa4 not usable for the {b} branch here: {why}")
    _check_vs_fp32_torch(T, HQ, H, d, d, tuning=tuning)
    assert plan_of(x, x[:, :8, :H], tuning).win == ("fa4" if "win" in modes else "triton")


def test_dense_cmp_policy():
    """auto (the GPU preset's cmp_dense): dense only from min_t tokens on (with or without autograd),
    never under torch.use_deterministic_algorithms."""
    from nsa.ops.triton import cmp_dense
    from nsa.ops import flash
    min_t = tuning_for("cuda").cmp_dense.min_t
    assert tuning_for("cuda").cmp_dense.mode == "auto"
    if cmp_dense.probe("cuda:0", torch.bfloat16, 64, 64)[0] is None:
        pytest.skip("no dense backend here")
    mk = lambda T: torch.zeros(1, T, 4, 64, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    kc = torch.zeros(1, 8, 2, 64, device="cuda", dtype=torch.bfloat16)
    sdpa = tuning_for("cuda").replace(flash=FlashBranchTuning())   # the SDPA rule alone (no branch on flash-attn)
    assert plan_of(mk(min_t), kc, sdpa).cmp in cmp_dense.BACKENDS
    assert plan_of(mk(min_t - 1), kc, sdpa).cmp == "triton"
    assert plan_of(mk(min_t).float(), kc.float(), sdpa).cmp == "triton"
    with torch.no_grad():   # the same choice as with autograd: the same blocks either way
        assert plan_of(mk(min_t), kc, sdpa).cmp in cmp_dense.BACKENDS
    # the preset's tuning.flash: FA4 from its min_t when the dense choice here is flash-attn
    fl = tuning_for("cuda").flash
    fa = flash.choose_dense_backend("cuda:0", torch.bfloat16, 64, True)[0]
    if fl.cmp != "off" and fa in flash.FLASH_BACKENDS:
        assert plan_of(mk(max(fl.min_t, min_t)), kc).cmp == fa
    torch.use_deterministic_algorithms(True)
    try:
        assert plan_of(mk(min_t), kc).cmp == "triton"
        assert plan_of(mk(max(fl.min_t, min_t)), kc).cmp == "triton"
    finally:
        torch.use_deterministic_algorithms(False)


def _check_vs_fp32_torch(T, HQ, H, dk, dv, tuning=None):
    assert triton_available()
    x = inputs(1, T, HQ, H, dk, dv, seed=T + HQ)
    g = torch.Generator(device="cuda").manual_seed(7 * T + HQ)
    do = torch.randn(1, T, HQ, dv, device="cuda", generator=g).bfloat16()
    # Selection is discrete: a near-tie can pick another block in bf16 than in fp32 (allowed: "identical
    # or equal-score ties", bounded by same_rows below). The numeric bound is measured under identical
    # selection: queries whose (token, kv head) row differs get a zero output gradient in BOTH runs.
    with torch.no_grad():
        _, bi0 = nsa_attention_triton(*[x[n] for n in NAMES], **HP, tuning=tuning)
        _, rbi0 = nsa_attention(*[x[n].float() for n in NAMES], **HP, backend="torch")
    same = (bi0 == rbi0).all(-1)                                   # [B, T, H]
    keep = same.repeat_interleave(HQ // H, dim=2)[..., None]      # [B, T, HQ, 1]
    do = do * keep
    o, bi, grads = run(x, "triton", torch.bfloat16, do, tuning)
    ro, rbi, rgrads = run(x, "torch", torch.float32, do)
    assert torch.equal(bi, bi0) and torch.equal(rbi, rbi0)
    same_rows = same.float().mean().item()
    errs = {"o": rel_rms(o * keep, ro * keep)}
    errs.update({f"d{n}": rel_rms(a, b) for n, a, b in zip(NAMES, grads, rgrads)})
    print(f"T={T} HQ={HQ} H={H} dk={dk} dv={dv}: block_idx rows equal {same_rows:.6f}; "
          + " ".join(f"{k}={v:.2e}" for k, v in errs.items()))
    assert same_rows >= 0.999, same_rows
    assert all(torch.isfinite(g).all() for g in grads)
    for k, v in errs.items():
        assert v <= 5e-3, (k, v)


def test_backward_is_deterministic():
    """Our kernels (the dense compressed branch is cuDNN's and the flash-attn branches FA4's, whose
    backwards need not repeat bitwise; both are off under torch.use_deterministic_algorithms, see
    test_dense_cmp_policy)."""
    off = with_cmp_dense("off").replace(flash=FlashBranchTuning())
    x = inputs(1, 8192, 16, 2, 128, 128, seed=1)
    do = torch.randn(1, 8192, 16, 128, device="cuda").bfloat16()
    o1, bi1, g1 = run(x, "triton", torch.bfloat16, do, off)
    o2, bi2, g2 = run(x, "triton", torch.bfloat16, do, off)
    assert torch.equal(o1, o2) and torch.equal(bi1, bi2)
    for n, a, b in zip(NAMES, g1, g2):
        assert torch.equal(a, b), n


def test_fp16_and_small_t_no_nan():
    for T in (1, 31, 32, 100):
        x = inputs(2, T, 8, 2, 64, 32, seed=T)
        x = {k: v.half() for k, v in x.items()}
        do = torch.randn(2, T, 8, 32, device="cuda").half()
        o, bi, grads = run(x, "triton", torch.float16, do)
        ro, rbi, _ = run(x, "torch", torch.float32, do)
        assert torch.isfinite(o).all() and all(torch.isfinite(g).all() for g in grads)
        assert torch.equal(bi, rbi)
        assert rel_rms(o, ro) <= 5e-3
