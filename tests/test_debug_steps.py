"""The loop's debug steps (issue 48 item 4): the module trace (logging.trace_steps), the CUDA memory snapshot
(logging.memory_snapshot_steps, refused off CUDA; its CUDA part in a `gpu` test) and the dense twin's explicit
kernel (model.dense_backend). The trace is tested on a tiny model directly, then once through the loop."""
from __future__ import annotations

import csv
import json
import math

import pytest
import torch

from nsa.config import ConfigError, resolve_config
from nsa.config import RunConfig
from nsa.model import TinyLM
from nsa.telemetry.memsnap import MemorySnapshot, unavailable
from nsa.telemetry.trace import ModuleTrace, traced_modules
from nsa.train.precision import precision_from_config
from nsa.train.step import train_step

SHAPE = dict(vocab=64, dim=32, n_layers=2, n_heads=2, n_kv_groups=1, d_k=16, d_v=16, l=8, d=4, l_sel=8, n_sel=2, w=16)


def _tiny(**kw):
    torch.manual_seed(0)
    m = TinyLM(**SHAPE, **kw)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    return m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def _traced_steps(model, opt, sched, steps, grad_clip):
    prec = precision_from_config(RunConfig().runtime, torch.device("cpu"))
    tr = ModuleTrace(model, opt, torch.device("cpu"))
    results = []
    for step in range(1, steps + 1):
        batch = torch.randint(0, SHAPE["vocab"], (2, 33), generator=torch.Generator().manual_seed(step))
        tr.begin(step)
        results.append(train_step(model, [batch], opt, sched, prec, grad_clip=grad_clip))
        tr.end(step, results[-1].grad_norm)
    tr.close()
    return tr, results


def test_trace_times_every_module_and_its_grad_norms(tmp_path):
    model, opt, sched = _tiny()
    names = set(traced_modules(model))
    assert {"embed", "blocks.0", "blocks.0.attn", "blocks.1.mlp", "norm", "lm_head"} <= names
    assert "blocks" not in names and not any(n.count(".") > 2 for n in names)   # containers and deep leaves out
    tr, res = _traced_steps(model, opt, sched, 2, grad_clip=0.01)      # clipping active: norm ~1 >> 0.01
    assert tr.steps == [1, 2] and len(tr.rows) == 2 * len(names)
    rows = {(r["step"], r["module"]): r for r in tr.rows}
    for (step, name), r in rows.items():
        assert r["fwd_calls"] == 1 and r["fwd_ms"] > 0, (step, name)
        if name == "embed":   # token ids need no gradient: its backward is not timed
            assert r["bwd_calls"] == 0
        else:
            assert r["bwd_calls"] == 1 and r["bwd_ms"] > 0, (step, name)
    # a block's time holds its children's
    assert rows[(2, "blocks.0")]["fwd_ms"] >= rows[(2, "blocks.0.attn")]["fwd_ms"]
    # grad_norm_update is what the optimizer used (after clipping); grad_norm undoes the clip with the step's
    # pre-clip total, so the modules' pre-clip norms add up (in squares) to StepResult.grad_norm over all params
    lm = rows[(1, "lm_head")]
    assert lm["grad_norm"] / lm["grad_norm_update"] == pytest.approx(float(res[0].grad_norm) / 0.01, rel=1e-3)
    top = [r for (s, n), r in rows.items() if s == 1 and n in ("embed", "blocks.0", "blocks.1", "norm", "lm_head")]
    assert math.sqrt(sum(r["grad_norm"] ** 2 for r in top)) == pytest.approx(float(res[0].grad_norm), rel=1e-4)
    jpath, cpath = tr.write(tmp_path / "trace")
    doc = json.loads(jpath.read_text())
    assert doc["steps"] == [1, 2] and len(doc["rows"]) == len(tr.rows)
    with cpath.open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(tr.rows) and float(table[0]["fwd_ms"]) > 0


def test_trace_hooks_go_away_and_checkpointing_recomputes():
    model, opt, sched = _tiny(grad_checkpointing=True)
    tr, _ = _traced_steps(model, opt, sched, 1, grad_clip=1.0)
    rows = {r["module"]: r for r in tr.rows}
    assert rows["blocks.0.attn"]["fwd_calls"] == 2      # the forward again in backward: recompute shows
    assert rows["embed"]["fwd_calls"] == 1
    assert not any(m._forward_hooks or m._backward_hooks for m in model.modules())   # close() removed them
    assert not opt._optimizer_step_pre_hooks


def test_memory_snapshot_is_refused_off_cuda():
    why = unavailable("cpu")
    assert "logging.memory_snapshot_steps" in why and "runtime.use_gpu=true" in why
    with pytest.raises(ValueError, match=r"logging.memory_snapshot_steps records the CUDA caching allocator"):
        MemorySnapshot("cpu")
    # the config refuses it on a CPU profile before any worker starts; on a GPU profile it resolves
    with pytest.raises(ConfigError, match=r"logging.memory_snapshot_steps records CUDA memory: it needs "
                                          r"runtime.use_gpu=true"):
        resolve_config(None, ["logging.memory_snapshot_steps=3"], env={})
    cfg, _ = resolve_config(None, ["logging.memory_snapshot_steps=3", "runtime.use_gpu=true"], env={})
    assert cfg.logging.memory_snapshot_steps == 3
    with pytest.raises(ConfigError, match=r"logging.trace_steps=-1 must be >= 0"):
        resolve_config(None, ["logging.trace_steps=-1"], env={})


def test_dense_backend_field_reaches_the_dense_layers():
    with pytest.raises(ConfigError, match=r"model.dense_backend='flash' is not one of"):
        resolve_config(None, ["model.dense_backend=flash"], env={})
    cfg, _ = resolve_config(None, ["model.attention=dense", "model.dense_backend=sdpa_math"], env={})
    model = TinyLM.from_config(cfg.model, cfg.nsa)
    assert {blk.attn.backend for blk in model.blocks} == {"sdpa_math"}
    cfg.nsa.allow_flash_attn = False
    cfg.model.dense_backend = "fa2"     # an explicit flash-attn kernel would silently override the switch
    with pytest.raises(ValueError, match=r"model.dense_backend.*nsa.allow_flash_attn=false"):
        TinyLM.from_config(cfg.model, cfg.nsa)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_snapshot_records_cuda_steps(tmp_path):
    snap = MemorySnapshot("cuda:0")
    snap.start()
    x = torch.randn(1024, 1024, device="cuda")
    (x @ x).sum().item()
    paths = snap.dump(tmp_path, "rank0_memory_snapshot")
    assert [p.name for p in paths] == ["rank0_memory_snapshot.pickle", "rank0_memory_snapshot_trace.html",
                                       "rank0_memory_snapshot_segments.html"]
    import pickle
    data = pickle.loads(paths[0].read_bytes())
    traces = [e for t in data["device_traces"] for e in t]
    assert any(e["action"] == "alloc" and e["size"] >= 4 * 1024 * 1024 for e in traces)   # x's 4 MiB
    assert "<html" in paths[1].read_text().lower()
    assert not snap.recording
