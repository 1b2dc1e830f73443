"""The kernel policy probes the Triton op once per (device, dtype, shape) and falls back to torch on
a compile / resource / launch error, with the reason in the policy and a counter (nsa/ops/probe.py).
On the CPU the Triton path is forced by faking `_triton_status`; failures are injected at the entry
point the probe calls (nsa.ops.triton.nsa_attention_triton)."""
from __future__ import annotations

import ast

import pytest
import torch

import nsa.ops as ops
import nsa.ops.triton as nsa_triton
from nsa.ops import route
from nsa.ops import dispatch, probe
from nsa.ops.dispatch import probe_model
from nsa.ops.probe import PROBE_COUNTER, ProbeShape, can_probe

SHAPE = ProbeShape(HQ=4, H=2, dk=16, dv=16, l=8, d=4, l_sel=8, n_sel=2, w=16)
MODEL = dict(vocab=61, dim=32, n_layers=2, n_heads=4, n_kv_groups=2, d_k=16, d_v=16, l=8, d=4,
             l_sel=8, n_sel=2, w=16)


def _compile_error() -> Exception:
    from triton.compiler.errors import CompilationError
    src = "acc = tl.dot(q, k)"
    return CompilationError(src, ast.parse(src).body[0], "sm_80: dot layout unsupported")


def _out_of_smem() -> Exception:
    from triton.runtime.errors import OutOfResources
    return OutOfResources(180224, 166912, "shared memory")


@pytest.fixture
def failing_triton(monkeypatch):
    """Triton 'usable' on this device, but its entry point raises what `make` returns; counts calls."""
    calls = []

    def install(make):
        def broken(*args, **kwargs):
            calls.append(kwargs.get("l"))
            raise make()
        monkeypatch.setattr(dispatch, "_triton_status", lambda dev: (True, "triton kernels available"))
        monkeypatch.setattr(nsa_triton, "nsa_attention_triton", broken)
        return calls

    probe.clear_probe_cache()
    dispatch._cache.clear()
    ops.reset_fallback_counts()
    yield install
    probe.clear_probe_cache()
    dispatch._cache.clear()
    ops.reset_fallback_counts()


@pytest.mark.parametrize("make,name", [(_compile_error, "CompilationError"), (_out_of_smem, "OutOfResources"),
                                       (lambda: RuntimeError("CUDA error: an illegal memory access"),
                                        "RuntimeError")])
@pytest.mark.parametrize("requested", ["auto", "triton"])
def test_probe_failure_falls_back_to_torch(failing_triton, make, name, requested):
    calls = failing_triton(make)
    pol = dispatch.cached_policy(requested, torch.device("cpu"), torch.float32, SHAPE)
    assert pol.backend == "torch" and set(pol.backends.values()) == {"torch"}
    assert "triton probe failed" in pol.reasons["cmp"] and name in pol.reasons["cmp"]
    assert pol.fallback == f"{requested}->torch"
    assert ops.fallback_counts() == {PROBE_COUNTER: 1}
    assert name in str(pol)
    # cached: the same (device, dtype, shape) neither probes nor counts again
    again = dispatch.cached_policy(requested, torch.device("cpu"), torch.float32, SHAPE)
    assert again is pol and len(calls) == 1 and ops.fallback_counts() == {PROBE_COUNTER: 1}
    # another shape key (e.g. a head dim in the big-tile family) is probed on its own
    big = ProbeShape(**{**SHAPE.__dict__, "dk": 192, "dv": 192})
    assert dispatch.cached_policy(requested, torch.device("cpu"), torch.float32, big).backend == "torch"
    assert len(calls) == 2 and ops.fallback_counts() == {PROBE_COUNTER: 2}


def test_compile_error_reason_keeps_the_message(failing_triton):
    failing_triton(_compile_error)
    res = probe.probe_triton("cpu", torch.bfloat16, SHAPE)
    assert not res.ok and res.reason.startswith("CompilationError") and "dot layout unsupported" in res.reason


def test_probe_passes_keeps_triton(monkeypatch, failing_triton):
    """A probe that runs forward and backward cleanly keeps the triton choice and says so."""
    failing_triton(_compile_error)
    seen = []

    def fine(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, **kw):
        seen.append((tuple(q.shape), kw["l_sel"], kw["w"], kw["tuning"].name))
        rest = sum(t.sum() for t in (k_cmp, v_cmp, k_slc, v_slc, k_win, v_win))
        return q * gates[..., :1] + rest * 0, None
    monkeypatch.setattr(nsa_triton, "nsa_attention_triton", fine)
    with torch.inference_mode():   # a first call from generate still probes the backward
        pol = dispatch.cached_policy("auto", torch.device("cpu"), torch.float32, SHAPE)
    assert pol.backend == "triton" and "probed fwd+bwd" in pol.reasons["slc"] and pol.fallback is None
    assert seen == [((1, SHAPE.probe_len(), 4, 16), 8, 16, "cpu")] and ops.fallback_counts() == {}


def test_uncovered_shape_keeps_the_per_call_fallback(failing_triton):
    """NotImplementedError (shape/dtype outside the kernels) is the op's own per-call fallback, not a
    device fault: the policy stays triton and the op counts triton_unsupported->torch as before."""
    failing_triton(lambda: NotImplementedError("d_k=192 not supported"))
    pol = dispatch.cached_policy("triton", torch.device("cpu"), torch.float32, SHAPE)
    assert pol.backend == "triton" and "not covered" in pol.reasons["cmp"] and ops.fallback_counts() == {}


def test_probe_catches_missing_gradients(monkeypatch, failing_triton):
    """A backward that silently drops a gradient is a failed probe (named inputs)."""
    failing_triton(_compile_error)
    monkeypatch.setattr(nsa_triton, "nsa_attention_triton", lambda q, *a, **kw: (q * 2, None))
    res = probe.probe_triton("cpu", torch.float32, SHAPE)
    assert not res.ok and "no gradient for k_cmp" in res.reason


def test_no_probe_inside_cuda_graph_capture(monkeypatch, failing_triton):
    """During a capture the unprobed policy is used and nothing is cached under the shape key."""
    calls = failing_triton(_compile_error)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    dev = torch.device("cuda")
    assert not can_probe(dev) and can_probe(torch.device("cpu"))
    assert probe.probe_triton(dev, torch.bfloat16, SHAPE) is None
    pol = dispatch.cached_policy("auto", dev, torch.bfloat16, SHAPE)
    assert pol.backend == "triton" and calls == [] and ops.fallback_counts() == {}
    assert ("auto", str(dev), torch.bfloat16, SHAPE) not in dispatch._cache


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_model_under_compile_failure_trains_a_step(failing_triton, backend):
    """Model build probes its layers' shape once; the step then runs on torch, counted, and learns."""
    from nsa.model import TinyLM
    from nsa.train import loop
    calls = failing_triton(_compile_error)
    torch.manual_seed(0)
    model = TinyLM(**{**MODEL, "backend": backend})
    policies = probe_model(model, "cpu", torch.float32)
    assert [p.backend for p in policies] == ["torch"] and len(calls) == 1   # two layers, one shape
    assert "CompilationError" in policies[0].reasons["win"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, MODEL["vocab"], (2, 48))
    before = [p.detach().clone() for p in model.parameters()]
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    assert torch.isfinite(loss) and len(calls) == 1          # the step itself never called triton
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    counts = loop._fallbacks()                               # what the heartbeats record
    assert counts[PROBE_COUNTER] == 1 and counts[f"{backend}->torch"] == MODEL["n_layers"]


@pytest.mark.slow
def test_real_kernels_pass_the_probe(monkeypatch):
    """The real Triton op (interpreter on CPU) passes its own probe: the probe does not misfire."""
    if not ops.triton_module() or not __import__("os").environ.get("TRITON_INTERPRET"):
        pytest.skip("needs the Triton interpreter")
    probe.clear_probe_cache()
    res = probe.probe_triton("cpu", torch.float32, ProbeShape(4, 2, 32, 32, 16, 8, 32, 4, 64),
                             ops.tuning_for("cpu"))
    probe.clear_probe_cache()
    assert res.ok, res.reason


# ---------------------------------------------------------------- shared memory of the presets' tiles
# Per-block shared memory the Triton launches may claim (opt-in maximum): sm_80 (A100) 163 KB,
# sm_90 (H100/H200) 227 KB.
SMEM_LIMIT = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}
ELT = 2          # bf16 / fp16 bytes
MAX_GROUP = 16   # query heads per KV head the estimate allows for (rows of the selection kernels)


def smem_bytes(held_rows: int, held_width: int, stages: int, step_rows: int, step_width: int) -> int:
    """Upper estimate of a flash-style kernel's shared memory: the tile it holds for the whole loop
    (held_rows x held_width) plus `stages` pipeline buffers of the tile it streams per step
    (step_rows x step_width), at 2 bytes each. A 1-stage loop still needs its one buffer.
    E.g. the forward: rows x dk + stages x keys x (dk + dv), times 2 bytes."""
    return (held_rows * held_width + max(stages, 1) * step_rows * step_width) * ELT


def _next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def preset_smem(tn, d: int) -> dict[str, int]:
    """Estimated bytes of every prefill launch of preset `tn` at head dim d (dk = dv = d, padded to a
    power of two; heads above 128 use the `big_*` tiles, as nsa/ops/triton/attn.py picks them)."""
    dp = max(16, _next_pow2(d))
    big = dp > 128
    fwd, dq, dkdv = tn.attn.tiles(big)
    st = tn.select
    g = MAX_GROUP
    scores = {tn.scores.tile_for(big)}
    return {
        # attention: Q held, K|V streamed; dq: Q|dO held, K|V streamed; dK/dV: K|V held, Q|dO streamed
        "attn.fwd": smem_bytes(fwd.rows, dp, fwd.stages, fwd.keys, 2 * dp),
        "attn.dq": smem_bytes(dq.rows, 2 * dp, dq.stages, dq.keys, 2 * dp),
        "attn.dkdv": smem_bytes(dkdv.keys, 2 * dp, dkdv.stages, dkdv.rows, 2 * dp),
        # selection: a token's query heads held, selected key rows streamed (keys per stage capped
        # by *_keys); dK/dV: a block's K|V held (<= fwd_keys rows), query rows streamed
        "select.fwd": smem_bytes(g, dp, st.fwd_stages, st.fwd_keys, 2 * dp),
        "select.dq": smem_bytes(g, 2 * dp, st.dq_stages, st.dq_keys, 2 * dp),
        "select.dkdv": smem_bytes(st.fwd_keys, 2 * dp, st.dkdv_stages,
                                  max(route.dkdv_rows_for(st, gg, big) for gg in (1, g)), 2 * dp),
        # block scores: query rows held, compressed keys streamed (K only)
        "scores": max(smem_bytes(sc.rows, dp, sc.stages, sc.min_keys, dp) for sc in scores),
    }


def test_smem_estimate_formula():
    # the forward's documented case: 128 rows x 128 + 3 x 64 keys x (128 + 128), bf16 = 128 KB
    assert smem_bytes(128, 128, 3, 64, 256) == 128 * 1024
    assert smem_bytes(16, 32, 0, 32, 64) == smem_bytes(16, 32, 1, 32, 64)


@pytest.mark.parametrize("d", [32, 64, 96, 128, 160, 192, 256])
@pytest.mark.parametrize("name,arch", [("ampere", "sm_80"), ("hopper", "sm_90"), ("hopper", "sm_80")])
def test_preset_tiles_fit_shared_memory(name, arch, d):
    """Every prefill launch of the AMPERE and HOPPER presets fits sm_80's 163 KB (and so Hopper's
    227 KB) for head dims up to 256: an A100 can run the tiles tuned on Hopper."""
    from nsa.ops.tuning import PRESETS
    est = preset_smem(PRESETS[name], d)
    over = {k: v for k, v in est.items() if v > SMEM_LIMIT[arch]}
    assert not over, f"{name} at d={d} exceeds {arch}'s {SMEM_LIMIT[arch]} B: {over}"


def test_smem_check_catches_an_oversized_tile():
    """The check fails for a tile that would not fit an A100 (4 stages of 128 keys at d=128)."""
    import dataclasses
    from nsa.ops.tuning import AMPERE, Tile
    fat = AMPERE.replace(attn=dataclasses.replace(AMPERE.attn, fwd=Tile(128, 128, 8, 4)))
    est = preset_smem(fat, 128)
    assert est["attn.fwd"] > SMEM_LIMIT["sm_80"] and est["attn.fwd"] < SMEM_LIMIT["sm_90"] * 2


def test_training_run_under_compile_failure_completes_and_heartbeats_count_it(failing_triton, tiny_data,
                                                                             tmp_path):
    """The worker loop (no Ray) with backend=triton whose kernels fail to compile: the model build
    probes once, the run completes on torch, and every step's heartbeat carries the counters."""
    import os
    from conftest import TINY_PROFILE, tiny_overrides
    from nsa.config import resolve_config
    from nsa.telemetry import read_heartbeat
    from nsa.train.local_env import LocalEnv
    from nsa.train.loop import run_training
    calls = failing_triton(_compile_error)
    over = {"model__n_layers": 1, "model__dim": 64, "train__steps": 2, "train__save_every": 0,
            "train__eval_every": 0, "logging__name": "probe", "nsa__backend": "triton"}
    cfg, _ = resolve_config(TINY_PROFILE, tiny_overrides(tiny_data, tmp_path, **over))
    run_dir = os.path.join(cfg.logging.root, cfg.logging.name)
    summary = run_training(cfg, run_dir, LocalEnv(cfg, run_dir))
    assert summary["status"] == "completed" and len(calls) == 1
    ends = [r for r in read_heartbeat(os.path.join(run_dir, "heartbeat_rank0.jsonl")) if r["kind"] == "step_end"]
    assert ends and all(r["fallbacks"].get(PROBE_COUNTER) == 1 for r in ends)
    assert ends[-1]["fallbacks"]["triton->torch"] >= 2          # counted per op call of the fallen-back policy


def test_first_call_inside_a_checkpointed_block_probes_without_breaking_recompute(monkeypatch, failing_triton):
    """The op's first call may come from the forward of a gradient-checkpointed block: the probe's own
    saved tensors must not count as the block's, or the recomputation (cache hit, no probe) saves fewer
    tensors and backward fails (seen on an H100 with the 125M model before the fix)."""
    from torch.utils.checkpoint import checkpoint
    failing_triton(_compile_error)

    def fine(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, **kw):
        rest = sum(t.sum() for t in (k_cmp, v_cmp, k_slc, v_slc, k_win, v_win))
        return q * gates[..., :1] + rest * 0, None
    monkeypatch.setattr(nsa_triton, "nsa_attention_triton", fine)
    x = {k: v.requires_grad_() for k, v in probe._inputs(SHAPE, torch.device("cpu"), torch.float32).items()}

    def block(*args):
        o, _ = ops.nsa_attention(*args, l=SHAPE.l, d=SHAPE.d, l_sel=SHAPE.l_sel, n_sel=SHAPE.n_sel, w=SHAPE.w,
                                 backend="auto")
        return o.square().sum()
    names = ("q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates")
    loss = checkpoint(block, *(x[n] for n in names), use_reentrant=False)
    loss.backward()
    assert x["q"].grad is not None and torch.isfinite(x["q"].grad).all()
    assert probe.probe_results() and all(r.ok for r in probe.probe_results().values())
