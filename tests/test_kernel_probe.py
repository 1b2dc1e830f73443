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
from nsa.ops import dispatch, probe
from nsa.ops.probe import PROBE_COUNTER, ProbeShape, can_probe, probe_model

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
    pol = dispatch.cached_policy("auto", torch.device("cpu"), torch.float32, SHAPE)
    assert pol.backend == "triton" and "probed fwd+bwd" in pol.reasons["slc"] and pol.fallback is None
    assert seen == [((1, SHAPE.probe_len(), 4, 16), 8, 16, "cpu")] and ops.fallback_counts() == {}


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
