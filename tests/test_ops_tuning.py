"""Kernel launch parameters as typed configs (nsa/ops/tuning.py): presets, policy, pass-through."""
import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from nsa.ops import route
from nsa.ops import KernelPolicy, nsa_attention, nsa_decode
from nsa.ops.batched import nsa_torch
from nsa.ops.common import NSAParams
from nsa.ops.testing import decode_views, make_inputs
from nsa.ops.tuning import (AMPERE, CPU, HOPPER, PRESETS, TILE_MAX_M, CmpDenseTuning, DecodeTuning,
                            KernelTuning, TileTuning, TorchTuning, tuning_for)

HP = dict(l=8, d=4, l_sel=8, n_sel=3, w=6)


def test_presets_are_frozen_and_named():
    assert set(PRESETS) == {"hopper", "ampere", "cpu"} and PRESETS["cpu"] is CPU
    with pytest.raises(dataclasses.FrozenInstanceError):
        HOPPER.attn.fwd.rows = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        HOPPER.cmp_dense = CmpDenseTuning("off")
    assert AMPERE.attn == HOPPER.attn and AMPERE.name == "ampere"
    # the CPU preset differs only where the interpreter / the CPU torch path want it to
    assert CPU.scores.tile.map_small == CPU.scores.tile.map_big == 0 and CPU.torch.dense_factor == 8.0
    assert HOPPER.torch.dense_factor == 4.0 and CPU.attn == HOPPER.attn and CPU.decode == HOPPER.decode
    # query tiles: only Hopper, only for G >= 16 (the paper shape, per-token programs of 16 rows); at G <= 8 they stopped paying against the block-order kernels (both measured);
    # the launches are shared
    assert CPU.tile == AMPERE.tile == TileTuning() and route.m_for(CPU.tile, 16) == 1
    assert HOPPER.tile.fwd == CPU.tile.fwd and HOPPER.tile.dq == CPU.tile.dq
    assert route.m_for(HOPPER.tile, 16) == 4 and route.m_for(HOPPER.tile, 6) == route.m_for(HOPPER.tile, 8) == 1
    # selection forward and dq block by block on Hopper for the production model's G=6, dq alone for the
    # paper's G=16 (both measured), per token on the other presets (not measured block by block)
    assert route.by_block(HOPPER.select, 6) and not route.by_block(HOPPER.select, 16) and HOPPER.select.pair_dtype == "fp16"
    assert route.dq_by_block(HOPPER.select, 16) and not route.dq_by_block(HOPPER.select, 32)
    assert HOPPER.select.dq_pair_dtype == "input" and HOPPER.select.pair_max_regs == 128
    assert not route.by_block(AMPERE.select, 6) and not route.by_block(CPU.select, 1)
    assert not route.dq_by_block(AMPERE.select, 6) and AMPERE.select.pair_max_regs is None
    # where dq comes from the walk's pair partials, the walk takes 64 rows per step with its token ids
    # prefetched at G=6 (pipelined at G=16, below), and at G=6 the score tiles 128 rows (all measured); the
    # other presets keep theirs
    assert route.dkdv_rows_for(HOPPER.select, 6) == route.dkdv_rows_for(HOPPER.select, 16) == 64
    assert route.dkdv_rows_for(HOPPER.select, 32) == HOPPER.select.dkdv_rows == 32
    assert route.prefetch_for(HOPPER.select, 6) and not route.prefetch_for(HOPPER.select, 32)
    assert not route.prefetch_for(AMPERE.select, 6) and not route.prefetch_for(CPU.select, 1)
    # the walk without dq (query tiles) runs its step loop pipelined on Hopper; the walk with dq pair
    # partials only at the paper's G=16 (the production shape's G=6 keeps its token-id prefetch: slower
    # pipelined), and nothing compiled for Ampere or the interpreter changes
    assert route.loop_stages_for(HOPPER.select, False, 16) == 3 and route.loop_stages_for(HOPPER.select, True, 16) == 2
    assert route.loop_stages_for(HOPPER.select, True, 6) == 0
    assert not route.prefetch_for(HOPPER.select, 16)
    assert route.loop_stages_for(AMPERE.select, False, 16) == route.loop_stages_for(CPU.select, True, 16) == 0
    assert HOPPER.select.ids_in_regs and not AMPERE.select.ids_in_regs and not CPU.select.ids_in_regs
    assert HOPPER.select.pair_chunk == 128 and AMPERE.select.pair_chunk == 0
    assert HOPPER.select.pack_heads and not AMPERE.select.pack_heads and not CPU.select.pack_heads
    assert route.dkdv_rows_for(AMPERE.select, 6) == route.dkdv_rows_for(CPU.select, 6) == 32
    assert HOPPER.scores.tile_for(False) is HOPPER.scores.tile and HOPPER.scores.tile.rows == 256
    assert HOPPER.scores.relayout and not AMPERE.scores.relayout and not CPU.scores.relayout
    assert HOPPER.scores.tile_for(True) is HOPPER.scores.big and AMPERE.scores.tile_for(False) is AMPERE.scores.tile
    with pytest.raises(dataclasses.FrozenInstanceError):
        HOPPER.tile.m = 4


def test_tuning_for_device():
    assert tuning_for("cpu") is CPU and tuning_for(torch.device("cpu")) is CPU
    if torch.cuda.is_available():
        major = torch.cuda.get_device_capability()[0]
        assert tuning_for("cuda") is (AMPERE if major == 8 else HOPPER)


def test_cmp_dense_mode_is_checked():
    with pytest.raises(ValueError, match="CmpDenseTuning.mode"):
        CmpDenseTuning("fast")


def test_select_chunk_is_checked():
    from nsa.ops.tuning import SelectTuning
    with pytest.raises(ValueError, match="select.chunk must be >= 1"):
        SelectTuning(chunk=0)
    assert SelectTuning().chunk == HOPPER.select.chunk == 1024


def test_tile_tuning_is_checked():
    for bad in (0, TILE_MAX_M + 1):
        with pytest.raises(ValueError, match="TileTuning.m"):
            TileTuning(m=bad)
    with pytest.raises(ValueError, match="TileTuning.min_g must be >= 1"):
        TileTuning(min_g=0)
    assert route.m_for(TileTuning(m=8, min_g=16), 32) == 8 and route.m_for(TileTuning(m=8), 1) == 8
    on = HOPPER.replace(tile=dataclasses.replace(HOPPER.tile, m=8))
    assert on.tile.m == 8 and on.tile.fwd == HOPPER.tile.fwd and on.select == HOPPER.select
    tn = TileTuning()
    assert tn.launch(tn.fwd, 64) is tn.fwd[0] and tn.launch(tn.fwd, 128) is tn.fwd[1]


def test_dkdv_chunk_halves_for_calls_with_few_pairs():
    """select.chunk_for: the chunk halves (down to 16) while the call's pairs fill fewer than
    chunk_min_items full chunks; the Hopper preset: 512 for the production shape at 8k (2 KV heads x
    16 blocks x 8192 tokens), 1024 from 16k and for the paper shape at 8k."""
    from nsa.ops.tuning import SelectTuning
    tn = SelectTuning(chunk=1024, chunk_min_items=512)
    assert route.chunk_for(tn, 512 * 1024) == 1024 and route.chunk_for(tn, 512 * 1024 - 1) == 512
    assert route.chunk_for(tn, 512 * 512 - 1) == 256 and route.chunk_for(tn, 1) == 16
    assert route.chunk_for(SelectTuning(), 1) == 1024
    hs = HOPPER.select
    assert route.chunk_for(hs, 8192 * 2 * 16) == 512 and route.chunk_for(hs, 16384 * 2 * 16) == 1024
    assert route.chunk_for(hs, 8192 * 4 * 16) == 1024 and route.chunk_for(CPU.select, 1) == CPU.select.chunk
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="select.chunk_min_items"):
            SelectTuning(chunk_min_items=bad)


def test_register_caps_are_checked():
    """ScoreTile.max_regs and select.pair_max_regs: None or an int in [24, 255]; GPU launch options
    only, so the interpreter's selection under a capped tile equals the uncapped one."""
    from nsa.ops.triton.scores import select_blocks
    from nsa.ops.tuning import CPU, ScoreTile, SelectTuning
    for bad in (True, 23, 256, 80.0):
        with pytest.raises(ValueError, match="ScoreTile.max_regs"):
            ScoreTile(128, 64, 8, 2, 2, 2, max_regs=bad)
    assert HOPPER.scores.tile.max_regs == 128 and HOPPER.scores.big.max_regs is None
    g = torch.Generator().manual_seed(0)
    q, kc = torch.randn(1, 200, 4, 16, generator=g), torch.randn(1, 12, 2, 16, generator=g)
    lse = torch.randn(1, 200, 4, generator=g).abs() + 2.0
    kw = dict(l=32, d=16, l_sel=32, n_sel=3, scale=0.25)
    capped = dataclasses.replace(CPU.scores, tile=dataclasses.replace(CPU.scores.tile, max_regs=64))
    plain = select_blocks(q, kc, lse, **kw, tuning=CPU.scores)
    assert torch.equal(select_blocks(q, kc, lse, **kw, tuning=capped), plain)
    for bad in (False, 8, 300, "96"):
        with pytest.raises(ValueError, match="select.pair_max_regs"):
            SelectTuning(pair_max_regs=bad)
    assert SelectTuning(pair_max_regs=128).pair_max_regs == 128
    from nsa.ops.triton._utils import reg_cap   # what the launchers pass: the cap on CUDA only
    assert reg_cap(80, True) == {"maxnreg": 80} and reg_cap(80, False) == reg_cap(None, True) == {}


def test_decode_regimes_and_overrides():
    dt = DecodeTuning()
    assert dt.knobs(dt.large_rows - 1) is dt.small and dt.knobs(dt.large_rows) is dt.large
    assert dt.small.pdl and not dt.large.pdl and dt.large.score_warps == "auto"
    pinned = dt.with_knobs(cmp_tile=16, pdl=False)
    assert pinned.small.cmp_tile == pinned.large.cmp_tile == 16 and not pinned.small.pdl
    assert pinned.large.slc_warps == dt.large.slc_warps   # other fields keep their regime's value


def test_policy_carries_the_device_preset():
    pol = KernelPolicy.resolve("cpu", torch.float32, "torch")
    assert pol.tuning is CPU and "tuning=cpu" in str(pol)
    custom = KernelPolicy("torch", "cpu", "float32", {}, {}, None, HOPPER)
    assert custom.tuning is HOPPER


def test_nsa_attention_passes_tuning_to_the_torch_path():
    """An explicit tuning reaches the kernels: dense_factor 0 forces the per-query gather path, which
    equals nsa_torch called with that factor directly (and the default run, up to rounding)."""
    xs = make_inputs(1, 40, 4, 2, 8, 8, l=HP["l"], d=HP["d"], seed=3)
    gather = KernelTuning("test", torch=TorchTuning(dense_factor=0.0, cpu_tile=16))
    o, bi = nsa_attention(*xs, **HP, backend="torch", tuning=gather)
    o_ref, bi_ref = nsa_torch(*xs, p=NSAParams(**HP), scale=8 ** -0.5, tile=16, dense_factor=0.0)
    assert torch.equal(o, o_ref) and torch.equal(bi, bi_ref)
    o_def, bi_def = nsa_attention(*xs, **HP, backend="torch")
    assert torch.equal(bi, bi_def) and torch.allclose(o, o_def, atol=1e-6)


def test_nsa_decode_accepts_tuning():
    xs = make_inputs(1, 30, 4, 2, 8, 8, l=HP["l"], d=HP["d"], seed=4)
    views, pos0, win_pos0 = decode_views(xs, 29, 1, HP["w"], HP["l"], HP["d"])
    gather = KernelTuning("test", torch=TorchTuning(dense_factor=0.0))
    o, bi = nsa_decode(*views, pos0=pos0, win_pos0=win_pos0, **HP, backend="torch", tuning=gather)
    o_ref, bi_ref = nsa_torch(*views, p=NSAParams(**HP), scale=8 ** -0.5, pos0=pos0, win_pos0=win_pos0,
                              dense_factor=0.0)
    assert torch.equal(o, o_ref) and torch.equal(bi, bi_ref)


def test_no_public_mutable_module_state_in_ops():
    """Tuning is passed, never patched: no module of nsa/ops binds a public name to a dict, list or
    set at module level (private caches such as learnt capabilities stay underscored)."""
    root = Path(__file__).resolve().parents[1] / "nsa" / "ops"
    bad = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            targets, value = ([], None)
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp)) or (
                isinstance(value, ast.Call) and getattr(value.func, "id", "") in ("dict", "list", "set"))
            for t in targets:
                if mutable and isinstance(t, ast.Name) and not t.id.startswith("_") and t.id != "__all__":
                    bad.append(f"{path.relative_to(root)}:{t.id}")
    assert bad == [], bad
