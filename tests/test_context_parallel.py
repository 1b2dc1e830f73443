"""Context parallelism (nsa/dist/context_parallel.py) against the single-process op and layer.

Each distributed test spawns 4 CPU processes once (gloo over loopback, FileStore rendezvous) and runs
its cases at CP=4 (all ranks) and CP=2 (ranks {0,1} and {2,3} as two groups), with lengths that are
not multiples of 2*CP (padding, an empty last chunk) and chunks that split compression and
selection blocks. Every rank recomputes the single-process result itself and compares its rows.
"""
from __future__ import annotations

import copy
import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nsa.config import apply_process_env
from nsa.dist import (check_cp_length, chunk_len, context_parallel, cp_nsa_attention, cp_nsa_layer,
                      gather_outputs, local_positions, shard_sequence, unshard_sequence)
from nsa.layers.attention import NSAAttention
from nsa.model.tinylm import TinyLM
from nsa.ops import nsa_attention
from nsa.ops.testing import INPUT_NAMES, clone_inputs, grads, make_inputs, rel_rms

WORLD = 4
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}   # fp32: the torch-vs-reference op tests' bound
# (B, T, HQ, H, dk, dv, l, d, l_sel, n_sel, w, backend, dtype, tile). CP=4 / CP=2 chunk lengths:
# T=40 -> 5 / 10 (every chunk boundary inside a block); T=35 -> 5 / 9 (padding; at CP=4 the last
# chunk is empty, rank 0 holds a tail of padding only); T=21 -> 3 / 6 on the fp64 oracle.
OP_CASES = {
    "even_torch": (2, 40, 4, 2, 8, 6, 8, 4, 8, 3, 12, "torch", torch.float32, None),
    "ragged_tiles_torch": (1, 35, 3, 1, 8, 8, 8, 4, 16, 2, 5, "torch", torch.float32, 3),
    "ragged_reference": (1, 21, 2, 1, 4, 4, 4, 2, 4, 2, 3, "reference", torch.float64, None),
}
# (T, compression, backend, dtype) for a layer dim=16, HQ=4, H=2, d_k=8, d_v=6, l=8, d=4, l_sel=8, n_sel=3, w=12
LAYER_CASES = {
    "even_mlp": (40, "mlp", "torch", torch.float32),
    "ragged_linear": (35, "linear", "torch", torch.float32),
    "ragged_reference": (21, "mlp", "reference", torch.float64),
}


# ------------------------------------------------------------------------------ no processes
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("T", [4, 7, 8, 35, 40])
def test_sharding_rule_round_trips_and_balances(world, T):
    x = torch.arange(T).view(1, T, 1) + 100
    c = chunk_len(T, world)
    parts = torch.stack([shard_sequence(x, r, world, pad_value=-1) for r in range(world)])
    assert parts.shape == (world, 1, 2 * c, 1)
    assert torch.equal(unshard_sequence(parts, T), x)
    for r in range(world):
        pos = local_positions(T, r, world)
        want = torch.where(pos < T, pos + 100, torch.full_like(pos, -1))
        assert torch.equal(parts[r, 0, :, 0], want)
        assert pos[0] == r * c and pos[c] == (2 * world - 1 - r) * c      # head chunk r, tail chunk 2N-1-r
        assert (pos < T).any()                                            # nobody holds padding only
    y = torch.randn(2, 3, T)   # the sequence in another dim, counted from the end
    parts = torch.stack([shard_sequence(y, r, world, dim=-1) for r in range(world)])
    assert parts.shape == (world, 2, 3, 2 * c) and torch.equal(unshard_sequence(parts, T, dim=-1), y)


def test_too_short_sequence_is_refused_naming_the_fields():
    with pytest.raises(ValueError, match=r"seq_len=3 is too short for context_parallel=4"):
        check_cp_length(3, 4)
    with pytest.raises(ValueError, match="context_parallel must be a positive int"):
        check_cp_length(8, 0)
    with pytest.raises(ValueError, match="seq_len=3 is too short"):
        shard_sequence(torch.zeros(1, 3), 0, 4)
    shard_sequence(torch.zeros(1, 4), 3, 4)   # T = N: one real position on the last rank is enough


def test_dense_model_is_refused_by_context_parallel():
    model = TinyLM(vocab=8, dim=16, n_layers=1, n_heads=2, n_kv_groups=1, d_k=8, d_v=8, attention="dense")
    with pytest.raises(ValueError, match="dense attention layers .* use model.attention=nsa"):
        with context_parallel(model, seq_len=16):
            pass


# ----------------------------------------------------------------------------- process plumbing
def _entry(rank: int, world: int, store: str, fn) -> None:
    if os.path.exists("/sys/class/net/lo"):
        apply_process_env({"GLOO_SOCKET_IFNAME": "lo"}, override=True)   # gloo's pairs on loopback only
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        for group, cp_rank, cp_world in ((None, rank, world), (pairs[rank // 2], rank % 2, 2)):
            fn(rank, group, cp_rank, cp_world)
    finally:
        dist.destroy_process_group()


def _spawn(fn) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(WORLD, os.path.join(tmp, "store"), fn), nprocs=WORLD, join=True)


def _close(a: torch.Tensor, b: torch.Tensor, tol: float, what: str) -> None:
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err = rel_rms(a, b)
    assert err <= tol, f"{what}: rel rms {err:.3g} > {tol}"


def _summed(g: torch.Tensor, group) -> torch.Tensor:
    g = g.clone()
    dist.all_reduce(g, group=group)
    return g


def _close_param_grads(ref: torch.nn.Module, cp: torch.nn.Module, group, tol: float, tag: str) -> None:
    """Every parameter of `cp` got a gradient on this rank (DDP needs that), and their sum over the
    group equals `ref`'s gradient. A gradient that is zero up to rounding (phi_k's output bias shifts
    every compressed key, which softmax ignores) is compared at the scale of the whole gradient."""
    total = torch.cat([p.grad.flatten() for p in ref.parameters()]).double().norm()
    for (name, p), cp_p in zip(ref.named_parameters(), cp.parameters()):
        assert cp_p.grad is not None, (tag, name)
        g_cp = _summed(cp_p.grad, group)
        if p.grad.double().norm() > tol * total:
            _close(g_cp, p.grad, tol, f"{tag} d{name}")
        else:
            assert (g_cp - p.grad).double().norm() <= tol * total, f"{tag} d{name}"


# --------------------------------------------------------------------------------------- the op
def _op_cases(rank: int, group, cp_rank: int, cp_world: int) -> None:
    for name, (B, T, HQ, H, dk, dv, l, d, l_sel, n_sel, w, backend, dtype, tile) in OP_CASES.items():
        hp = dict(l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w, backend=backend, tile=tile)
        xs = make_inputs(B, T, HQ, H, dk, dv, l=l, d=d, dtype=dtype, seed=T, q_scale=2.0)
        go = torch.randn(B, T, HQ, dv, generator=torch.Generator().manual_seed(1), dtype=dtype)
        full = clone_inputs(xs)
        o, idx = nsa_attention(*full, **hp)
        o.backward(go)

        def shard(x, pad=0):
            return shard_sequence(x.detach(), cp_rank, cp_world, pad_value=pad)
        loc = clone_inputs([x if n in ("k_cmp", "v_cmp") else shard(x) for n, x in zip(INPUT_NAMES, xs)])
        o_l, idx_l = cp_nsa_attention(*loc, seq_len=T, group=group, **hp)
        o_l.backward(shard(go))
        tag = f"{name} CP={cp_world} rank={cp_rank}"
        real = local_positions(T, cp_rank, cp_world) < T
        assert torch.equal(idx_l, shard(idx, pad=-1)), tag
        assert torch.equal(o_l[:, ~real], torch.zeros_like(o_l[:, ~real])), tag   # padding rows exactly 0
        _close(o_l, shard(o), TOL[dtype], f"{tag} o")
        for n, g_l, g in zip(INPUT_NAMES, grads(loc), grads(full)):
            if n in ("k_cmp", "v_cmp"):   # replicated input: the ranks' shares sum to the gradient
                _close(_summed(g_l, group), g, TOL[dtype], f"{tag} d{n}")
            else:
                _close(g_l, shard(g), TOL[dtype], f"{tag} d{n}")
        _close(gather_outputs(o_l.detach(), T, group), o, TOL[dtype], f"{tag} gathered o")
    if cp_world == WORLD:   # bad shards are refused before any collective, on every rank alike
        B, T, HQ, H, dk, dv, l, d, *_ = OP_CASES["even_torch"]
        xs = make_inputs(B, T, HQ, H, dk, dv, l=l, d=d)
        loc = [x if n in ("k_cmp", "v_cmp") else shard_sequence(x, cp_rank, cp_world)
               for n, x in zip(INPUT_NAMES, xs)]
        with pytest.raises(ValueError, match=r"q must hold 2\*chunk_len = 10 local positions"):
            cp_nsa_attention(xs[0], *loc[1:], seq_len=T, group=group, l=l, d=d)
        with pytest.raises(ValueError, match=r"k_cmp must hold the whole sequence's N = .* = 9"):
            cp_nsa_attention(loc[0], loc[1][:, :4], *loc[2:], seq_len=T, group=group, l=l, d=d)


def test_cp_op_forward_and_every_gradient_equal_single_process():
    _spawn(_op_cases)


# ------------------------------------------------------------------------------------ the layer
def _layer_cases(rank: int, group, cp_rank: int, cp_world: int) -> None:
    for name, (T, compression, backend, dtype) in LAYER_CASES.items():
        torch.manual_seed(0)   # the same weights and inputs on every rank
        layer = NSAAttention(16, 4, 2, 8, 6, l=8, d=4, l_sel=8, n_sel=3, w=12, compression=compression,
                             backend=backend).to(dtype)
        with torch.no_grad():   # gates away from 1/2 and q away from 0, so every branch matters
            layer.gate_mlp[2].bias.uniform_(-2.0, 2.0)
            layer.qkv_proj.weight.mul_(20.0)
        cp_layer = copy.deepcopy(layer)
        x = torch.randn(2, T, 16, dtype=dtype, requires_grad=True)
        r = torch.randn(2, T, 16, dtype=dtype)
        y = layer(x)
        (y * r).sum().backward()

        def shard(t):
            return shard_sequence(t.detach(), cp_rank, cp_world)
        x_l = shard(x).requires_grad_()
        y_l = cp_nsa_layer(cp_layer, x_l, seq_len=T, group=group)
        (y_l * shard(r)).sum().backward()
        tag = f"layer {name} CP={cp_world} rank={cp_rank}"
        _close(y_l, shard(y), TOL[dtype], f"{tag} y")
        _close(x_l.grad, shard(x.grad), TOL[dtype], f"{tag} dx")
        _close_param_grads(layer, cp_layer, group, TOL[dtype], tag)


def _model_cases(rank: int, group, cp_rank: int, cp_world: int) -> None:
    """TinyLM under context_parallel: local logits and the summed gradients of a token-summed
    cross-entropy equal the single-process model's, with and without block checkpointing."""
    T, V = 35, 32
    gen = torch.Generator().manual_seed(5)
    ids, labels = torch.randint(0, V, (2, T), generator=gen), torch.randint(0, V, (2, T), generator=gen)
    for ckpt in (False, True):
        torch.manual_seed(1)
        model = TinyLM(vocab=V, dim=16, n_layers=2, n_heads=4, n_kv_groups=2, d_k=8, d_v=6, l=8, d=4,
                       l_sel=8, n_sel=3, w=12, backend="torch", grad_checkpointing=ckpt)
        cp_model = copy.deepcopy(model)
        logits = model(ids)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").backward()
        with context_parallel(cp_model, seq_len=T, group=group):
            logits_l = cp_model(shard_sequence(ids, cp_rank, cp_world))
            lab_l = shard_sequence(labels, cp_rank, cp_world, pad_value=-100)
            torch.nn.functional.cross_entropy(logits_l.flatten(0, 1), lab_l.flatten(), reduction="sum",
                                              ignore_index=-100).backward()
        assert all(type(m).forward is m.forward.__func__ for m in cp_model.nsa_layers())   # restored
        tag = f"model ckpt={ckpt} CP={cp_world} rank={cp_rank}"
        real = local_positions(T, cp_rank, cp_world) < T
        _close(logits_l[:, real], shard_sequence(logits.detach(), cp_rank, cp_world)[:, real], 1e-5, f"{tag} logits")
        _close_param_grads(model, cp_model, group, 1e-5, tag)


def _layer_and_model_cases(rank: int, group, cp_rank: int, cp_world: int) -> None:
    _layer_cases(rank, group, cp_rank, cp_world)
    _model_cases(rank, group, cp_rank, cp_world)


def test_cp_layer_and_model_outputs_and_parameter_gradients_equal_single_process():
    _spawn(_layer_and_model_cases)
