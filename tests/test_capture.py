"""bench/capture_inputs.py: a tiny trained model's op inputs are captured faithfully (re-running the op on
them gives the layer's attention output and the same block indices), bench/common.py's locality table
gives the exact fractions on hand-made selections, and bench_attention's captured and random paths
produce their rows (timers stubbed: they need CUDA)."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY_PROFILE
from test_pipeline_bench import load_bench

pytestmark = pytest.mark.usefixtures("one_thread")


def selections(T: int, fn) -> torch.Tensor:
    """block_idx [1, T, 1, n_sel] with token t's blocks fn(t) (ascending, -1 = unused slot)."""
    return torch.tensor([fn(t) for t in range(T)], dtype=torch.int64).view(1, T, 1, -1)


def test_locality_identical_disjoint_partial():
    common = load_bench("common")
    T, n_sel = 64, 4
    same = selections(T, lambda t: [0, 3, 5, 9])
    assert common.locality(same) == {m: pytest.approx(1 / m) for m in common.LOCALITY_M}
    apart = selections(T, lambda t: [t * n_sel + j for j in range(n_sel)])
    assert common.locality(apart) == {m: pytest.approx(1.0) for m in common.LOCALITY_M}
    # one block shared by every token plus one of its own: a tile of m tokens needs 1 + m of 2m blocks
    shared = selections(T, lambda t: [0, t + 1])
    assert common.locality(shared) == {m: pytest.approx((1 + m) / (2 * m)) for m in common.LOCALITY_M}
    # unused slots count in the denominator (the per-token kernel's m x n_sel), not in the union
    padded = selections(T, lambda t: [7, -1])
    assert common.locality(padded, ms=(1, 4)) == {1: pytest.approx(0.5), 4: pytest.approx(1 / 8)}
    # only the second half counts: disjoint first half, identical second half
    half = selections(T, lambda t: [t * 2, t * 2 + 1] if t < T // 2 else [0, 1])
    assert common.locality(half) == {m: pytest.approx(1 / m) for m in common.LOCALITY_M}
    assert common.locality(half, ms=(2,), start=0) == {2: pytest.approx(0.75)}   # 1.0 then 0.5
    # mean over KV heads and layers
    two_heads = torch.cat([same, apart], 2)
    assert common.locality(two_heads, ms=(4,)) == {4: pytest.approx((1 / 4 + 1) / 2)}
    assert common.mean_locality([{2: 0.5}, {2: 1.0}]) == {2: 0.75}
    with pytest.raises(ValueError, match="m=16"):
        common.locality(same[:, :20])


def test_group_locality_regroups_tiles_within_windows():
    """group_locality: tokens alternate between two disjoint block sets, so 4 consecutive tokens need both
    (union 8 of 16 slots) while 4 of a window of 8 or more share one (4 of 16); W = m is the plain locality."""
    common = load_bench("common")
    T = 128
    alt = selections(T, lambda t: [0, 1, 2, 3] if t % 2 else [8, 9, 10, 11])
    got = common.group_locality(alt)
    assert got == {4: 0.5, 8: 0.25, 16: 0.25, 32: 0.25, 64: 0.25}
    assert got[4] == common.locality(alt, ms=(4,))[4]
    with pytest.raises(ValueError, match="window of 64"):
        common.group_locality(alt[:, :20])


def test_key_locality_counts_tiles_of_consecutive_blocks():
    """key_locality: distinct (token, tile of kb blocks) per (token, block) pair, second half only."""
    common = load_bench("common")
    T = 64
    # each token picks blocks 4..7: one tile of 4 (or 8), two tiles of 2
    run = selections(T, lambda t: [4, 5, 6, 7])
    assert common.key_locality(run) == {1: 1.0, 2: 0.5, 4: 0.25, 8: 0.25}
    # blocks 8 apart never share a tile below kb=16; unused slots count nowhere
    far = selections(T, lambda t: [0, 8, 16, -1])
    assert common.key_locality(far) == {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}
    assert common.key_locality(far, kbs=(16, 32)) == {16: pytest.approx(2 / 3), 32: pytest.approx(1 / 3)}
    # only tokens from start count: scattered first half, one tile of 2 in the second
    half = selections(T, lambda t: [t * 4, t * 4 + 2] if t < T // 2 else [2, 3])
    assert common.key_locality(half, kbs=(2,)) == {2: 0.5}
    assert common.key_locality(half, kbs=(2,), start=0) == {2: 0.75}
    with pytest.raises(ValueError, match="no selected block"):
        common.key_locality(selections(T, lambda t: [-1, -1]))


@pytest.fixture(scope="module")
def captured(tiny_data, tmp_path_factory):
    """A 2-layer tiny model trained 2 steps at seq 128, captured at T=128 and 96 (layers 0 and 1); the
    attention layers' outputs y are recorded by forward hooks during the capture run."""
    common = load_bench("common")
    load_bench("bench_train")
    cap = load_bench("capture_inputs")
    cfg, full = cap.build_config(TINY_PROFILE, cap.TINY + [f"data.path={tiny_data}"], seq=128, steps=2)
    model, recipe = cap.train_model(cfg, 2, TINY_PROFILE, full)
    out = tmp_path_factory.mktemp("captured")
    ys: dict[tuple[int, int], torch.Tensor] = {}
    hooks = [a.register_forward_hook(lambda mod, inp, y, i=i: ys.__setitem__((inp[0].shape[1], i), y.detach()))
             for i, a in enumerate(model.nsa_layers())]
    ids = cap.long_text(cfg, 128)
    res = cap.run_captures(model, cfg, ids, [128, 96], [0, 1], out)
    for h in hooks:
        h.remove()
    cap.write_meta(out, recipe, cfg, [128, 96], [0, 1], res)
    return common, cap, model, recipe, res, out, ys, ids


def test_capture_has_the_op_shapes_and_recipe(captured):
    common, cap, model, recipe, res, out, ys, ids = captured
    from nsa.ops.common import num_cmp_tokens
    assert ids.shape == (1, 128) and ids.dtype == torch.int64
    assert recipe["steps"] == 2 and recipe["seq"] == 128 and recipe["tokens"] == 2 * 128
    assert recipe["profile"].endswith("tiny_cpu.yaml") and "train.seq_len=128" in recipe["overrides"]
    assert [(e["T"], e["layer"]) for e in res["captures"]] == [(128, 0), (128, 1), (96, 0), (96, 1)]
    a = model.nsa_layers()[0]
    HQ, H, dk, dv, S = a.n_heads, a.n_kv_groups, a.d_k, a.d_v, a.n_sel
    for e in res["captures"]:
        T, N = e["T"], num_cmp_tokens(e["T"], a.l, a.d)
        x, bi = common.load_capture(out, e, device="cpu", grad=False)
        want = [(1, T, HQ, dk), (1, N, H, dk), (1, N, H, dv), (1, T, H, dk), (1, T, H, dv), (1, T, H, dk),
                (1, T, H, dv), (1, T, HQ, 3)]
        assert [tuple(t.shape) for t in x] == want
        assert all(t.dtype == torch.float32 for t in x) and bi.dtype == torch.int64 and bi.shape == (1, T, H, S)
        assert e["shapes"]["q"] == list(want[0]) and e["dtypes"]["block_idx"] == "int64"
    for T in (128, 96):
        for table in ("locality", "key_locality"):
            loc = res[table][T]
            assert set(loc["layers"]) == {0, 1} and loc["mean"][1] == pytest.approx(1.0)
            assert all(0 < v <= 1 for v in loc["mean"].values())


def test_rerunning_the_op_on_captures_gives_the_layer_output(captured):
    """The op on the saved tensors returns the saved block indices and o, and o through the layer's output
    projection is what the layer returned during the capture run."""
    common, cap, model, recipe, res, out, ys, ids = captured
    from nsa.ops import nsa_attention
    for e in res["captures"]:
        x, bi = common.load_capture(out, e, device="cpu", grad=False)
        saved = torch.load(out / e["file"], weights_only=True)
        o, bi2 = nsa_attention(*x, **e["op"])
        assert torch.equal(bi2, bi) and torch.equal(o, saved["o"])
        layer = model.nsa_layers()[e["layer"]]
        with torch.no_grad():
            y = layer.o_proj(o.reshape(1, e["T"], -1))
        torch.testing.assert_close(y, ys[(e["T"], e["layer"])], rtol=0, atol=0)


def test_meta_json_written_by_the_script(tiny_data, tmp_path, monkeypatch):
    """The command line end to end (train 1 step, capture one layer) writes meta.json with the recipe."""
    load_bench("bench_train")
    cap = load_bench("capture_inputs")
    monkeypatch.setattr("sys.argv", ["capture_inputs.py", "--tiny", "--seq", "64", "--steps", "1", "--T", "64",
                                     "--layers", "1", "--out", str(tmp_path), f"data.path={tiny_data}"])
    monkeypatch.delenv("OUT", raising=False)
    assert cap.main() == 0
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["recipe"]["steps"] == 1 and meta["recipe"]["seq"] == 64 and meta["layers"] == [1]
    assert [c["file"] for c in meta["captures"]] == ["T64_L1.pt"] and (tmp_path / "T64_L1.pt").is_file()
    assert (tmp_path / "model" / "model.pt").is_file()
    # --load reuses the trained model without training
    monkeypatch.setattr("sys.argv", ["capture_inputs.py", "--load", str(tmp_path / "model"), "--T", "64",
                                     "--layers", "0", "--out", str(tmp_path / "again"), f"data.path={tiny_data}"])
    assert cap.main() == 0
    again = json.loads((tmp_path / "again" / "meta.json").read_text())
    assert again["recipe"]["loaded_from"] == str(tmp_path / "model") and again["recipe"]["steps"] == 1


def test_bench_attention_runs_on_captures(captured, monkeypatch):
    """bench_attention's captured path end to end on the CPU (timers and the dense bar stubbed: they need
    CUDA): one row per (capture, tile m), the op's block indices equal the captured ones, locality rows."""
    common, cap, model, recipe, res, out, ys, ids = captured
    ba = load_bench("bench_attention")
    calls = []
    monkeypatch.setattr(common, "gpu_time", lambda fn, warmup, iters: (calls.append(fn()), 2.0)[1])
    monkeypatch.setattr(common, "peak_mem_gib", lambda fn: 0.5)
    monkeypatch.setattr(common, "print_dense_available", lambda: {})
    dense = {"fwd_ms": 1.0, "fwd_bwd_ms": 3.0, "fwd_backend": "d", "fwd_bwd_backend": "d", "fwd_bwd_mem_gib": 0.1}
    monkeypatch.setattr(common, "time_dense", lambda *a, **k: dense)
    a = __import__("argparse").Namespace(inputs=f"captured:{out}", T=[128], tile_m=[1, 2], warmup=0,
                                         iters=1, dense=None, no_peers=True, breakdown=[], sweep=[])
    r = ba.run_op(a, (1, 64, 4, 128, 128))
    assert [(x["layer"], x["m"]) for x in r["rows"]] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert all(x["block_idx_rows_equal_capture"] == 1.0 and x["speedup_fwd_bwd"] == 1.5 for x in r["rows"])
    assert r["shape"] == {"B": 1, "HQ": 4, "H": 2, "dk": 32, "dv": 32} and r["hparams"]["l_sel"] == 16
    assert set(r["locality"]) == set(r["key_locality"]) == set(r["group_locality"]) == {"T=128 layer 0",
                                                                                          "T=128 layer 1"}
    assert len(calls) == 8 and all(t[4] == r["locality"][k][4] for k, t in r["group_locality"].items())
    with pytest.raises(SystemExit, match="no capture at"):
        ba.run_op(__import__("argparse").Namespace(**{**vars(a), "T": [4096]}), (1, 64, 4, 128, 128))
    # --sweep T on captures: the sweep's variants on each capture's own inputs (op fwd and fwd+bwd each)
    monkeypatch.setattr(ba, "sweep_space", lambda: {"tile.g16": [{"tile.m": 2}], "other": [{"tile.m": 3}]})
    calls.clear()
    r = ba.run_op(__import__("argparse").Namespace(**{**vars(a), "tile_m": [0], "sweep": [128],
                                                      "sweep_only": "tile."}), (1, 64, 4, 128, 128))
    assert set(r["sweep"]) == {"T=128 layer 0", "T=128 layer 1"} and len(calls) == 2 * (2 + 2 * 2)   # per layer: the op, the defaults, one variant
    assert set(r["sweep"]["T=128 layer 1"]) == {"defaults", "tile.m=2"}
    assert [x["m"] for x in r["rows"]] == [0, 0]


def test_bench_profile_takes_a_captured_layer(captured):
    """bench_profile kernels --inputs captured:DIR --layer L: that capture's inputs, shapes and
    hyperparameters at each T; a layer or T not captured is one clear error naming what was."""
    common, cap, model, recipe, res, out, ys, ids = captured
    bp = load_bench("bench_profile")
    a = __import__("argparse").Namespace(inputs=f"captured:{out}", layer=1)
    x, hp, shape = bp.op_inputs(a, 128)
    saved = torch.load(out / "T128_L1.pt", weights_only=True)
    assert torch.equal(x[0].detach(), saved["q"]) and len(x) == 8 and x[0].requires_grad
    assert shape == (1, 4, 2, 32, 32) and hp["l_sel"] == 16
    with pytest.raises(SystemExit, match=r"no capture of layer 5 at T=128 \(captured: \[\(96, 0\), \(96, 1\), \(128, 0\)"):
        bp.op_inputs(__import__("argparse").Namespace(inputs=f"captured:{out}", layer=5), 128)


def test_bench_attention_random_inputs_rows_per_tile_m(monkeypatch):
    """The random-input path keeps its per-T layout (nsa = the first --tile-m) and adds one row per m and
    the locality of the op's own selection (op on the CPU's torch backend; timers and dense stubbed)."""
    common = load_bench("common")
    ba = load_bench("bench_attention")

    def cpu_inputs(B, T, HQ, H, dk, dv):   # common.nsa_inputs' shapes (paper l=32, d=16) on the CPU
        N = (T - 32) // 16 + 1
        shapes = [(B, T, HQ, dk), (B, N, H, dk), (B, N, H, dv)] + [(B, T, H, dk), (B, T, H, dv)] * 2
        return [torch.randn(*s).requires_grad_() for s in shapes] + [torch.rand(B, T, HQ, 3).requires_grad_()]

    monkeypatch.setattr(common, "nsa_inputs", cpu_inputs)
    monkeypatch.setattr(common, "gpu_time", lambda fn, warmup, iters: (fn(), 2.0)[1])
    monkeypatch.setattr(common, "peak_mem_gib", lambda fn: 0.5)
    monkeypatch.setattr(common, "print_dense_available", lambda: {})
    dense = {"fwd_ms": 1.0, "fwd_bwd_ms": 3.0, "fwd_backend": "d", "fwd_bwd_backend": "d", "fwd_bwd_mem_gib": 0.1}
    monkeypatch.setattr(common, "time_dense", lambda *a, **k: dense)
    a = __import__("argparse").Namespace(inputs="random", T=[256], tile_m=[2, 1], warmup=0, iters=1,
                                         dense=None, no_peers=True, breakdown=[], sweep=[])
    r = ba.run_op(a, (1, 4, 2, 16, 16))
    assert [x["m"] for x in r["rows"]] == [2, 1] and set(r["T"][256]["nsa_tile_m"]) == {2, 1}
    assert r["T"][256]["nsa"] is r["T"][256]["nsa_tile_m"][2] and r["T"][256]["speedup_fwd_bwd"] == 1.5
    loc = r["locality"]["T=256 random"]
    assert r["key_locality"]["T=256 random"][1] == pytest.approx(1.0)
    assert loc[1] == pytest.approx((3 + 4) / 2 / 16)   # tokens 128..255 see 3 or 4 blocks of 64, n_sel=16
    assert all(0 < v <= loc[1] for v in loc.values())


def test_bench_profile_compare_adds_kernels_of_one_cut_name():
    """--compare's per-kernel column: two kernels whose names agree in the first 60 characters (FA4's
    window and compressed launches) are summed, not the later one kept."""
    bp = load_bench("bench_profile")
    fa4 = "kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_object_at_"
    rows = [{"kernel": fa4 + "a", "ms_per_iter": 1.5}, {"kernel": "_slc_fwd_kernel", "ms_per_iter": 0.25},
            {"kernel": fa4 + "b", "ms_per_iter": 2.0}]
    assert bp.kernel_ms(rows) == {fa4[:60]: 3.5, "_slc_fwd_kernel": 0.25}


def test_bench_profile_fwd_times_the_forward_alone():
    """kernels --fwd: the NSA step returns the op's output, still recorded for autograd (the forward as training
    runs it) and computes no gradient; without it the step returns one gradient per input."""
    bp = load_bench("bench_profile")
    common = load_bench("common")
    T, N = 64, (64 - 32) // 16 + 1
    shapes = [(1, T, 4, 16), (1, N, 2, 16), (1, N, 2, 16)] + [(1, T, 2, 16)] * 4
    x = [torch.randn(*s).requires_grad_() for s in shapes] + [torch.rand(1, T, 4, 3).requires_grad_()]
    do = torch.randn(1, T, 4, 16)
    tuning = common.base_tuning("cpu")
    o = bp.fwd_bwd(x, do, tuning, None, fwd_only=True)()
    assert o.shape == (1, T, 4, 16) and o.grad_fn is not None and all(t.grad is None for t in x)
    grads = bp.fwd_bwd(x, do, tuning, None)()
    assert len(grads) == 8 and all(g.shape == t.shape for g, t in zip(grads, x))
    ns = __import__("argparse").Namespace
    assert bp._pass(ns(fwd=True)) == "fwd" and bp._pass(ns(fwd=False)) == "fwd+bwd"


def test_inputs_flag_is_checked_once_for_both_benchmarks():
    """bench_attention's and bench_profile's --inputs: random or captured:DIR, else one clear exit."""
    common = load_bench("common")
    common.check_inputs("random")
    common.check_inputs("captured:bench/captured_paper")
    for bad in ("captured:", "captured", "trained:x"):
        with pytest.raises(SystemExit, match="use random or captured:DIR"):
            common.check_inputs(bad)


def test_every_sweep_variant_names_real_tuning_fields():
    """bench_attention's sweep groups and --branch select variants all build from the device presets
    (a variant naming a field that was renamed or removed fails here, not on a GPU machine)."""
    common = load_bench("common")
    ba = load_bench("bench_attention")
    from nsa.ops.tuning import PRESETS
    for base in PRESETS.values():
        for group, variants in ba.sweep_space().items():
            for changes in variants:
                common.tuning_variant(base, changes)
    assert len(ba.select_variants()) > 2
