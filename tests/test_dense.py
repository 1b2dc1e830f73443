"""The dense twin (model.attention=dense) and the dense-attention backends (nsa/ops/flash.py) on CPU.

flash-attn cannot run here: a stub `flash_attn.cute` / `flash_attn` module (the math reference behind
flash-attn's call signature) is injected into sys.modules and a GPU's compute capability is faked, which
exercises the detection, probe, choice, allow_flash switch and the branch hooks end to end."""
from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from nsa.config import ConfigError, resolve_config
from nsa.layers.dense import DenseAttention, DenseKVCache
from nsa.model import TinyLM
from nsa.train.checkpoint import AttentionKindError
from nsa.ops import flash
from nsa.ops.tuning import CPU, FlashBranchTuning
from nsa.ops.reference import causal_attention

pytestmark = pytest.mark.usefixtures("one_thread")


def _rand(*shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _rows_reference(q, k, v, causal, window, scale):
    """Loop over queries (bottom-right aligned): query i at position Tk-Tq+i sees keys in its range."""
    Tq, Tk, G = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    out = torch.zeros(*q.shape[:3], v.shape[3], dtype=torch.float64)
    for i in range(Tq):
        p = Tk - Tq + i
        hi = p + 1 if causal else Tk
        lo = max(0, p - window + 1) if window else 0
        kk = k[:, lo:hi].double().repeat_interleave(G, 2)
        vv = v[:, lo:hi].double().repeat_interleave(G, 2)
        s = torch.einsum("bhd,bkhd->bhk", q[:, i].double(), kk) * scale
        out[:, i] = torch.einsum("bhk,bkhd->bhd", s.softmax(-1), vv)
    return out


# ------------------------------------------------------------------------------------ the op
@pytest.mark.parametrize("backend", ["sdpa", "sdpa_math", "reference"])
@pytest.mark.parametrize("Tq, Tk, causal, window", [(24, 24, True, None), (1, 24, True, None), (5, 24, True, None),
                                                    (24, 24, True, 7), (6, 24, True, 4), (9, 24, False, None)])
def test_dense_attention_matches_the_row_loop(backend, Tq, Tk, causal, window):
    q, k, v = _rand(2, Tq, 6, 8, seed=1), _rand(2, Tk, 2, 8, seed=2), _rand(2, Tk, 2, 4, seed=3)
    o = flash.dense_attention(q, k, v, causal=causal, window=window, scale=0.3, backend=backend)
    torch.testing.assert_close(o, _rows_reference(q, k, v, causal, window, 0.3), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["sdpa", "sdpa_math"])
def test_dense_attention_gradients_match_the_oracle(backend):
    """Causal full attention: output and dq/dk/dv against nsa.ops.reference.causal_attention (fp64)."""
    x = [_rand(2, 20, 4, 8, seed=4), _rand(2, 20, 2, 8, seed=5), _rand(2, 20, 2, 8, seed=6)]
    do = _rand(2, 20, 4, 8, seed=7)
    a = [t.clone().requires_grad_() for t in x]
    b = [t.clone().requires_grad_() for t in x]
    oa = flash.dense_attention(*a, backend=backend)
    ob = causal_attention(*b)
    torch.testing.assert_close(oa, ob, rtol=1e-10, atol=1e-10)
    for ga, gb in zip(torch.autograd.grad(oa, a, do), torch.autograd.grad(ob, b, do)):
        torch.testing.assert_close(ga, gb, rtol=1e-9, atol=1e-10)


def test_dense_attention_rejects_bad_input_in_one_line():
    q, k = _rand(1, 8, 3, 8), _rand(1, 8, 2, 8)
    with pytest.raises(ValueError, match="q heads 3 must be a multiple of k/v heads 2"):
        flash.dense_attention(q, k, k)
    with pytest.raises(ValueError, match="backend='nope'"):
        flash.dense_attention(_rand(1, 8, 2, 8), k, k, backend="nope")
    with pytest.raises(ValueError, match="Tq=9 > Tk=8"):
        flash.dense_attention(_rand(1, 9, 2, 8), k, k)


def test_cpu_choice_is_sdpa_and_says_why():
    flash.reset_choices()
    name, why = flash.choose_dense_backend("cpu", torch.float32, 32, allow_flash=True)
    assert name == "sdpa" and "cpu" in why


# ------------------------------------------------------------------------------------ the layer / model
def test_dense_layer_equals_reference_causal_attention_fp64():
    torch.manual_seed(0)
    layer = DenseAttention(dim=48, n_heads=6, n_kv_groups=2, d_k=8, d_v=4).double()
    x = _rand(2, 17, 48, seed=8)
    q, k, v = layer.project(x)
    want = layer.o_proj(causal_attention(q, k, v).reshape(2, 17, 24))
    torch.testing.assert_close(layer(x), want, rtol=1e-10, atol=1e-12)
    # RoPE is applied (position-dependent): the same token at two positions gets different keys
    same = x[:, :1].expand(2, 2, 48).contiguous()
    kk = layer.project(same)[1]
    assert not torch.allclose(kk[:, 0], kk[:, 1])


def _tiny(attention: str, **kw) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(vocab=64, dim=32, n_layers=2, n_heads=4, n_kv_groups=2, d_k=8, d_v=8, l=8, d=4, l_sel=8,
                  n_sel=2, w=16, ffn_mult=2.0, attention=attention, **kw)


def test_dense_twin_shares_the_model_and_differs_only_in_attention():
    nsa, dense = _tiny("nsa"), _tiny("dense")
    assert dense.attention == "dense" and nsa.attention == "nsa"
    assert all(isinstance(b.attn, DenseAttention) for b in dense.blocks)
    # same embeddings/norms/MLP/head keys and shapes; q rows and o_proj of the same shape
    ns, ds = nsa.state_dict(), dense.state_dict()
    shared = [k for k in ds if ".attn." not in k]
    assert shared and all(ns[k].shape == ds[k].shape for k in shared)
    assert ds["blocks.0.attn.o_proj.weight"].shape == ns["blocks.0.attn.o_proj.weight"].shape
    assert ds["blocks.0.attn.qkv_proj.weight"].shape == (4 * 8 + 2 * 8 + 2 * 8, 32)
    with pytest.raises(ValueError, match="attention='sparse'"):
        _tiny("sparse")


def test_dense_generate_with_cache_equals_full_forward():
    model = _tiny("dense").double().eval()
    ids = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(1))
    full = model(ids)
    logits, caches = model.prefill(ids[:, :9], capacity=4)          # capacity 4: the cache must grow
    torch.testing.assert_close(logits, full[:, :9], rtol=1e-9, atol=1e-10)
    steps = [model.decode_step(ids[:, t:t + 1], caches) for t in range(9, 15)]
    steps.append(model.decode_step(ids[:, 15:21], caches))           # a chunk of 6 after the cache
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 9:], rtol=1e-9, atol=1e-10)
    out = model.generate(ids[:, :5], 8)
    ref = ids[:, :5]
    for _ in range(8):                                               # greedy without a cache
        ref = torch.cat([ref, model(ref)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="model.attention='dense'"):
        model.generate(ids[:, :5], 2, cuda_graph=True)


def test_dense_cache_refuses_another_batch():
    c = DenseKVCache(4)
    c.append(torch.zeros(2, 3, 1, 4), torch.zeros(2, 3, 1, 4))
    with pytest.raises(ValueError, match="batch 2"):
        c.append(torch.zeros(3, 1, 1, 4), torch.zeros(3, 1, 1, 4))


def test_dense_twin_trains_on_cpu():
    model = _tiny("dense")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(25):
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


# ------------------------------------------------------------------------------------ config / checkpoints
def test_config_field_and_override():
    cfg, src = resolve_config(overrides=["model.attention=dense"], env={})
    assert cfg.model.attention == "dense" and src["model.attention"] == "cli"
    assert resolve_config(env={})[0].model.attention == "nsa"
    with pytest.raises(ConfigError, match="model.attention='full'"):
        resolve_config(overrides=["model.attention=full"], env={})
    model = TinyLM.from_config(cfg.model, cfg.nsa)
    assert model.attention == "dense" and model.blocks[0].attn.allow_flash is True
    off, _ = resolve_config(overrides=["model.attention=dense"], env={"NSA_USE_FA2": "0"})
    assert off.nsa.allow_flash_attn is False
    assert TinyLM.from_config(off.model, off.nsa).blocks[0].attn.allow_flash is False


def _state(model: TinyLM, attention: str | None) -> dict:
    cfg = {"model": {"dim": 32}} if attention is None else {"model": {"dim": 32, "attention": attention}}
    return {"model": model.state_dict(), "config": cfg}


def test_checkpoint_kind_mismatch_is_one_clear_line():
    from nsa.train.checkpoint import CheckpointError, load_model_weights
    dense, nsa = _tiny("dense"), _tiny("nsa")
    with pytest.raises(AttentionKindError) as e:
        load_model_weights(nsa, _state(dense, "dense"))
    msg = str(e.value)
    assert "\n" not in msg and "model.attention='dense'" in msg and "model.attention='nsa'" in msg
    assert isinstance(e.value, CheckpointError)          # the entry points turn it into exit 2
    with pytest.raises(AttentionKindError, match="model.attention='nsa' model but this model is model.attention='dense'"):
        load_model_weights(dense, _state(nsa, None))       # no field recorded: an NSA checkpoint
    load_model_weights(_tiny("dense"), _state(dense, "dense"))
    load_model_weights(_tiny("nsa"), _state(nsa, None))


# ------------------------------------------------------------------------------------ flash-attn (stub)
class _Calls:
    n = 0


def _fake_fa4(wrong: bool = False):
    """flash_attn.cute.flash_attn_func with FA4's keywords, computed by the math reference."""
    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), return_lse=False,
                        **_):
        _Calls.n += 1
        left = window_size[0]
        o, lse = flash.reference_attention(q, k, v, causal, None if left is None else left + 1, softmax_scale)
        return (o * 0.5 if wrong else o), (lse if return_lse else None)
    return flash_attn_func


def _fake_fa2():
    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        return_attn_probs=False, **_):
        _Calls.n += 1
        left = window_size[0]
        o, lse = flash.reference_attention(q, k, v, causal, None if left < 0 else left + 1, softmax_scale)
        return (o, lse, None) if return_attn_probs else o
    return flash_attn_func


@pytest.fixture()
def fake_flash(monkeypatch):
    """Install stub flash-attn modules and pretend to be a GPU of the given compute capability."""
    def install(fa4=None, fa2=None, cap=(9, 0)):
        pkg = types.ModuleType("flash_attn")
        pkg.__path__ = []
        if fa2 is not None:
            pkg.flash_attn_func = fa2
        monkeypatch.setitem(sys.modules, "flash_attn", pkg)
        if fa4 is not None:
            cute = types.ModuleType("flash_attn.cute")
            cute.flash_attn_func = fa4
            pkg.cute = cute
            monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
        else:
            monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
        monkeypatch.setattr(flash, "device_capability", lambda dev: cap)
        flash.reset_choices()
        _Calls.n = 0
    yield install
    flash.reset_choices()


def test_policy_chooses_fa4_when_present_and_allowed(fake_flash):
    from nsa.ops import KernelPolicy
    fake_flash(fa4=_fake_fa4())
    name, why = flash.choose_dense_backend("cpu", torch.bfloat16, 16, allow_flash=True)
    assert name == "fa4" and "probe rel err" in why and _Calls.n > 0
    pol = KernelPolicy.resolve("cpu", torch.bfloat16, "torch", allow_flash=True, head_dim=16)
    assert pol.backends["dense"] == "fa4" and "dense=fa4" in str(pol)
    assert "fa4 available, not used for the win branch (tuning.flash.win=off)" in pol.reasons["win"]
    # the dense twin uses it: its layer output equals the layer on the math backend
    layer = DenseAttention(32, 4, 2, 16, 16).to(torch.bfloat16)
    x = _rand(1, 12, 32, dtype=torch.bfloat16)
    before = _Calls.n
    assert layer.kernel(x) == "fa4"
    y = layer(x)
    assert _Calls.n == before + 1
    layer.backend = "reference"
    torch.testing.assert_close(y, layer(x), rtol=0, atol=0)


def test_allow_flash_false_never_uses_flash(fake_flash):
    from nsa.ops import KernelPolicy
    fake_flash(fa4=_fake_fa4(), fa2=_fake_fa2())
    name, why = flash.choose_dense_backend("cpu", torch.bfloat16, 16, allow_flash=False)
    assert name not in flash.FLASH_BACKENDS and "nsa.allow_flash_attn=false" in why
    pol = KernelPolicy.resolve("cpu", torch.bfloat16, "torch", allow_flash=False, head_dim=16)
    assert pol.backends["dense"] not in flash.FLASH_BACKENDS
    cfg, _ = resolve_config(overrides=["model.attention=dense", "model.d_k=16", "model.d_v=16"],
                            env={"NSA_USE_FA2": "0"})
    layer = TinyLM.from_config(cfg.model, cfg.nsa).blocks[0].attn.to(torch.bfloat16)
    layer(_rand(1, 12, cfg.model.dim, dtype=torch.bfloat16))
    assert _Calls.n == 0
    on = FlashBranchTuning(win="fa4", cmp="fa4")
    pol = KernelPolicy.resolve("cpu", torch.bfloat16, "torch", allow_flash=False, head_dim=16)
    assert "nsa.allow_flash_attn=false" in pol.reasons["win"]
    pol = KernelPolicy.resolve("cpu", torch.bfloat16, "torch", allow_flash=True, head_dim=16,
                               tuning=CPU.replace(flash=on))
    assert "win branch on fa4" in pol.reasons["win"] and "cmp branch on fa4" in pol.reasons["cmp"]


def test_branch_summary_names_the_flash_branches(fake_flash):
    """The env.json / log phrase: which NSA branches run on flash-attn, or why none."""
    fake_flash(fa4=_fake_fa4())
    on = FlashBranchTuning(win="auto", min_t=4096)
    assert flash.branch_summary("cpu", torch.bfloat16, 16, False, on).endswith("(nsa.allow_flash_attn=false)")
    assert flash.branch_summary("cpu", torch.bfloat16, 16, True, FlashBranchTuning()).endswith("(tuning.flash off)")
    line = flash.branch_summary("cpu", torch.bfloat16, 16, True, on)
    assert "win branch on fa4 from T >= 4096 (tuning.flash.win=auto)" in line
    assert "not used for the cmp branch" in line


def test_fa2_on_ampere_and_a_wrong_kernel_is_refused(fake_flash):
    fake_flash(fa4=_fake_fa4(), fa2=_fake_fa2(), cap=(8, 6))
    name, why = flash.choose_dense_backend("cpu", torch.float16, 16, allow_flash=True)
    assert name == "fa2" and "fa4: needs SM90+" in why
    fake_flash(fa4=_fake_fa4(wrong=True), cap=(9, 0))
    name, why = flash.choose_dense_backend("cpu", torch.bfloat16, 16, allow_flash=True)
    assert name != "fa4" and "fa4: mismatch vs reference" in why
    assert name in flash.SDPA_BACKENDS                   # the next kernel that works here


def test_flash_branch_choice_follows_the_tuning(fake_flash):
    """branch_flash_backend: off / auto (the dense choice when it is flash-attn) / forced, and the
    cases that keep a branch on the own kernels (short T, d_k != d_v, deterministic algorithms);
    flash_sdpa_lse = cmp_dense._sdpa_lse (math)."""
    from nsa.ops.triton.cmp_dense import _sdpa_lse
    fake_flash(fa4=_fake_fa4())
    q = _rand(1, 20, 4, 16, dtype=torch.bfloat16)
    assert flash.branch_flash_backend("win", FlashBranchTuning(), q, 16) == (None, "tuning.flash.win=off")
    auto = FlashBranchTuning(win="auto", cmp="auto", min_t=16)
    assert flash.branch_flash_backend("win", auto, q, 16)[0] == "fa4"
    assert flash.branch_flash_backend("cmp", auto, q, 16)[0] == "fa4"
    assert "min_t" in flash.branch_flash_backend("win", dataclasses.replace(auto, min_t=21), q, 16)[1]
    assert "d_k=16 != d_v=32" in flash.branch_flash_backend("win", auto, q, 32)[1]
    assert flash.branch_flash_backend("win", FlashBranchTuning(win="fa2"), q, 16)[0] is None   # not installed
    torch.use_deterministic_algorithms(True)
    try:
        assert "deterministic" in flash.branch_flash_backend("win", auto, q, 16)[1]
    finally:
        torch.use_deterministic_algorithms(False)
    with pytest.raises(ValueError, match="unknown branch"):
        flash.branch_flash_backend("slc", auto, q, 16)
    with pytest.raises(ValueError, match="FlashBranchTuning.win"):
        FlashBranchTuning(win="fast")
    q, k, v = _rand(1, 20, 4, 16, seed=9), _rand(1, 20, 2, 16, seed=10), _rand(1, 20, 2, 16, seed=11)
    # _sdpa_lse's math path computes in fp32: compare fp32 inputs at fp32 rounding
    qh, kh, vh = (t.float().transpose(1, 2) for t in (q, k, v))
    o1, l1 = flash.flash_sdpa_lse(qh, kh, vh, 0.25, "fa4")
    o2, l2 = _sdpa_lse(qh, kh, vh, 0.25, "math")
    torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-6)


def test_runbook_profiles():
    """smoke_3090: the runbook's 3090 smoke; long_32k: prod_50k's model at 32k, for NSA vs dense."""
    from pathlib import Path
    configs = Path(__file__).resolve().parents[1] / "pipelines" / "configs"
    smoke, _ = resolve_config(str(configs / "smoke_3090.yaml"), env={})
    assert (smoke.runtime.precision, smoke.runtime.use_gpu, smoke.train.seq_len, smoke.train.accumulate,
            smoke.model.grad_checkpointing) == ("fp16", True, 1024, 8, False)
    assert smoke.runtime.scaler_init_scale == 65536.0 and smoke.runtime.num_workers == 1
    prod, _ = resolve_config(str(configs / "prod_50k.yaml"), env={})
    long, _ = resolve_config(str(configs / "long_32k.yaml"), overrides=["model.attention=dense"], env={})
    assert long.train.seq_len == 32768 and long.model.grad_checkpointing and long.train.batch_size == 1
    shape = ("vocab", "dim", "n_layers", "n_heads", "n_kv_groups", "d_k", "d_v", "ffn_mult")
    for p in (smoke, long):
        assert [getattr(p.model, f) for f in shape] == [getattr(prod.model, f) for f in shape]
    assert long.model.attention == "dense"


def test_flash_refusing_a_shape_falls_back_once_and_is_counted(fake_flash):
    """An "auto" flash choice that fails on a shape its probe did not cover (here T > 100) falls back to
    the best non-flash kernel, counts it, and is not tried again; an explicit backend="fa4" raises."""
    from nsa.ops import fallback_counts
    good = _fake_fa4()

    def picky(q, k, v, **kw):
        assert q.shape[1] <= 100, "seqlen too long for this build"
        return good(q, k, v, **kw)

    fake_flash(fa4=picky)
    layer = DenseAttention(32, 4, 2, 16, 16).to(torch.bfloat16)
    x = _rand(1, 120, 32, dtype=torch.bfloat16)
    assert layer.kernel(x) == "fa4"
    before = dict(fallback_counts())
    with pytest.warns(RuntimeWarning, match="fa4 failed at Tq=120"):
        y = layer(x)
    after = fallback_counts()
    key = next(k for k in after if k.startswith("dense:fa4->"))
    assert after[key] == before.get(key, 0) + 1
    name, why = flash.choose_dense_backend("cpu", torch.bfloat16, 16, allow_flash=True)
    assert name not in flash.FLASH_BACKENDS and "fa4 failed" in why
    layer.backend = "reference"
    torch.testing.assert_close(y, layer(x), rtol=2e-2, atol=2e-2)   # bf16 kernels vs the fp32 formula
    q = _rand(1, 120, 4, 16, dtype=torch.bfloat16)
    kv = _rand(1, 120, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="seqlen too long"):
        flash.dense_attention(q, kv, kv, backend="fa4")


def test_dense_blocks_compile_without_graph_breaks():
    """model.compile on the dense twin: the kernel choice is a traceable dict lookup (no lock, no break)."""
    import torch._dynamo.utils as dynamo_utils
    model = _tiny("dense")
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(3))
    ref = model(ids)
    model.compile_blocks("aot_eager")
    dynamo_utils.counters.clear()
    torch.testing.assert_close(model(ids), ref, rtol=1e-6, atol=1e-6)
    assert dict(dynamo_utils.counters["graph_break"]) == {}


def test_flash_branches_field_reaches_the_op(monkeypatch):
    """nsa.flash_branches: validated in the config (one line naming the field), parsed into the
    tuning's FlashBranchTuning, and handed by every NSA layer to the op with allow_flash."""
    import nsa.ops as nsa_ops
    with pytest.raises(ConfigError, match="nsa.flash_branches"):
        resolve_config(overrides=["nsa.flash_branches=all"], env={})
    assert FlashBranchTuning.parse("preset") is None and FlashBranchTuning.parse("off") == FlashBranchTuning()
    assert FlashBranchTuning.parse("win+cmp") == FlashBranchTuning(win="auto", cmp="auto")
    for bad in ("", "win+win", "slc"):
        with pytest.raises(ValueError, match="choose preset, off, win, cmp or win\\+cmp"):
            FlashBranchTuning.parse(bad)
    cfg, _ = resolve_config(overrides=["nsa.flash_branches=win", "nsa.allow_flash_attn=false"], env={})
    model = TinyLM.from_config(cfg.model, cfg.nsa)
    seen = []
    real = nsa_ops.nsa_attention
    monkeypatch.setattr(nsa_ops, "nsa_attention", lambda *a, **k: seen.append(k) or real(*a, **k))
    model(torch.randint(0, cfg.model.vocab, (1, 40)))
    assert seen and all(k["flash_branches"] == "win" and k["allow_flash"] is False for k in seen)
