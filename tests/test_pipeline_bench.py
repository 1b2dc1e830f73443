"""bench/: every script's --help works on a CPU-only machine; bench_train.py --tiny runs the bare loop and
writes its JSON (a crash test, no timing asserted); the Ray row is computed from a pipeline run's heartbeats
(tests/test_pipeline_e2e.py feeds it a real run)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from types import ModuleType

import pytest

from conftest import REPO

BENCH = REPO / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if p.name != "common.py")


def load_bench(name: str) -> ModuleType:
    """Import bench/<name>.py as the module `name`, with bench/common.py as `common` (what running the
    script from bench/ gives), without putting bench/ on sys.path."""
    for mod in ("common", name):
        if mod not in sys.modules:
            spec = importlib.util.spec_from_file_location(mod, BENCH / f"{mod}.py")
            m = importlib.util.module_from_spec(spec)
            sys.modules[mod] = m
            spec.loader.exec_module(m)
    return sys.modules[name]


def test_bench_is_a_small_toolkit():
    """Under ten files: one driver per question, the shared module, one shell driver."""
    assert len(SCRIPTS) + 1 + len(list(BENCH.glob("*.sh"))) < 10
    assert sorted(p.name for p in BENCH.glob("*.sh")) == ["gpu.sh"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_runs_without_a_gpu(script):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout


def test_gpu_driver_help():
    out = subprocess.run(["bash", str(BENCH / "gpu.sh"), "--help"], capture_output=True, text=True, cwd=REPO,
                         timeout=60)
    assert out.returncode == 0 and "decode" in out.stdout and "attention" in out.stdout and "prod [T" in out.stdout
    bad = subprocess.run(["bash", str(BENCH / "gpu.sh"), "nope"], capture_output=True, text=True, cwd=REPO,
                         timeout=60)
    assert bad.returncode == 2 and "unknown command" in bad.stderr


def test_gpu_driver_env_prints_one_export_line(tmp_path):
    """`eval "$(bash bench/gpu.sh env)"`: stdout is exactly one export of PYTHONPATH that keeps the caller's
    entries and adds the working directory (the repository root on a GPU machine; here an empty folder: no
    carried wheels, no GPU), so eval leaves nothing else behind."""
    env = dict(os.environ, PYTHONPATH="/some/where")
    out = subprocess.run(["bash", str(BENCH / "gpu.sh"), "env"], capture_output=True, text=True, cwd=tmp_path,
                         env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('export PYTHONPATH="'), out.stdout
    parts = lines[0].split('"')[1].split(":")
    assert str(tmp_path) in parts and "/some/where" in parts


def test_write_result_saves_and_copies(tmp_path, monkeypatch):
    """bench/out by default, --save into bench/results/<name>.json, --copy-to as <name>.json; metadata."""
    common = load_bench("common")
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "results")
    ap = __import__("argparse").ArgumentParser()
    common.result_args(ap)
    a = ap.parse_args(["--out", str(tmp_path / "out"), "--save", "--copy-to", str(tmp_path / "dev")])
    path = common.write_result({"x": 1}, "thing", a)
    assert path.parent == tmp_path / "out" and path.name.startswith("thing_")
    for p in (path, tmp_path / "results" / "thing.json", tmp_path / "dev" / "thing.json"):
        rep = json.loads(p.read_text())
        assert rep["x"] == 1 and {"device", "date", "command", "torch"} <= set(rep)


def test_tuning_variant_replaces_nested_fields():
    """The sweep helper rebuilds frozen configs level by level and leaves the base untouched."""
    import dataclasses
    common = load_bench("common")

    @dataclasses.dataclass(frozen=True)
    class Inner:
        a: int = 1
        b: int = 2

    @dataclasses.dataclass(frozen=True)
    class Outer:
        inner: Inner = Inner()
        c: int = 3

    base = Outer()
    v = common.tuning_variant(base, {"inner.b": 5, "c": 7})
    assert v == Outer(Inner(1, 5), 7) and base == Outer()


def test_tile_m_variant_sets_only_the_tile_size():
    """bench_attention --tile-m M runs the op with KernelTuning.tile.m = M at every G (min_g 1, whatever
    the preset's), M=0 the preset itself; nothing else changes."""
    import dataclasses
    from nsa.ops import route
    from nsa.ops.tuning import HOPPER
    common = load_bench("common")
    base = common.base_tuning("cpu")
    v = common.tile_m_variant(base, 4)
    assert v.tile.m == 4 and base.tile.m == 1 and v.replace(tile=base.tile) == base
    h = common.tile_m_variant(HOPPER, 8)
    assert route.m_for(h.tile, 6) == 8
    assert h.replace(tile=dataclasses.replace(h.tile, m=HOPPER.tile.m, min_g=HOPPER.tile.min_g)) == HOPPER
    assert route.m_for(common.tile_m_variant(HOPPER, 1).tile, 16) == 1
    assert common.tile_m_variant(HOPPER, 0) is HOPPER


def test_vs_dense_nsa_tuning_run_changes_only_its_models_preset(monkeypatch):
    """bench_train --nsa-tuning: the extra NSA run's models resolve the device preset with the changes
    (values parsed as bench_profile's --tuning), the plain NSA run and the dense twin the preset itself."""
    import torch
    from nsa.config import resolve_config
    from nsa.ops import dispatch
    bench_train = load_bench("bench_train")
    seen = []

    def fake_bare(cfg, steps, warmup):
        pol = dispatch.KernelPolicy.resolve("cpu", torch.float32, "torch")
        seen.append((cfg.model.attention, pol.tuning.tile.m, pol.tuning.select.pair_chunk))
        return {"model": None, "toks_per_s": 1.0, "step_ms_p50": 1.0, "step_mode": "eager"}

    monkeypatch.setattr(bench_train, "run_bare", fake_bare)
    cfg, _ = resolve_config(str(REPO / "pipelines" / "configs" / "tiny_cpu.yaml"), [])
    rows = bench_train.run_vs_dense(cfg, [64], 1, 0, ("preset",), ("tile.m=4", "select.pair_chunk=32"))
    assert seen == [("nsa", 1, 0), ("nsa", 4, 32), ("dense", 1, 0)]
    assert [r["attention"] for r in rows] == ["nsa", "nsa[tile.m=4 select.pair_chunk=32]", "dense"]
    assert dispatch.KernelPolicy.resolve("cpu", torch.float32, "torch").tuning.tile.m == 1   # restored
    assert bench_train.common.parse_changes(["select.loop=block", "tile.m=8"]) == {"select.loop": "block",
                                                                                   "tile.m": 8}


def test_bench_train_tiny_bare(tiny_data, tmp_path, monkeypatch, capsys):
    bench_train = load_bench("bench_train")
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setattr(sys, "argv", ["bench_train.py", "--tiny", "--skip-ray", "--steps", "3", "--warmup", "1",
                                      "--out", str(tmp_path / "bench"), f"data.path={tiny_data}"])
    assert bench_train.main() == 0
    out = capsys.readouterr().out
    assert "bare" in out and "MFU" in out
    rep = json.loads((tmp_path / "out" / "train.json").read_text())
    assert [r["mode"] for r in rep["rows"]] == ["bare"]
    assert rep["rows"][0]["toks_per_s"] > 0 and rep["rows"][0]["step_ms_p50"] > 0
    f = rep["flops_per_token"]
    # the analytic count and torch's FlopCounterMode (torch backend) agree within 15%
    assert f["counted_train_per_token_torch_backend"] == pytest.approx(f["train_per_token"], rel=0.15)
    assert list((tmp_path / "bench").glob("train_*.json"))


def test_attention_flops_match_a_direct_count():
    """The per-sequence attention count: compressed blocks visible + selected + window keys, per head."""
    bench_train = load_bench("bench_train")
    from nsa.config import RunConfig
    cfg = RunConfig()
    cfg.train.seq_len, cfg.nsa.l, cfg.nsa.d, cfg.nsa.l_sel, cfg.nsa.n_sel, cfg.nsa.w = 64, 16, 8, 16, 2, 32
    keys = sum(max(0, (t + 1 - 16) // 8 + 1) + min(32, t + 1) + min(32, t + 1) for t in range(64))
    per_key = 2 * (cfg.model.d_k + cfg.model.d_v)
    assert bench_train.attention_flops_per_seq(cfg) == per_key * keys * cfg.model.n_heads
