"""nsa/telemetry/step_split.py (bench_profile.py split) charges a training step's time to what computes it: on a
tiny CPU model every category gets time, backward work reaches its forward module through the autograd node's
sequence number, and little is left unlabelled."""
from __future__ import annotations

import pytest

from nsa.telemetry.step_split import CATS

TINY = ("model.dim=64 model.n_layers=2 model.n_heads=4 model.n_kv_groups=2 model.d_k=16 model.d_v=16 nsa.l=16 "
        "nsa.d=8 nsa.l_sel=16 nsa.n_sel=4 nsa.w=32 train.batch_size=1 runtime.precision=fp32 train.seq_len=128 "
        "model.grad_checkpointing=false nsa.backend=torch").split()


@pytest.fixture(scope="module")
def bench_profile():
    from test_pipeline_bench import load_bench   # bench/ modules as the scripts see them, no sys.path edit
    return load_bench("bench_profile")


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_step_split_labels_every_part_of_the_step(attention, bench_profile):
    row = bench_profile.split_row([f"model.attention={attention}"] + TINY, steps=1, warmup=1)
    ms = row["ms"]
    assert set(ms) == set(CATS)
    nsa_only = ("attn_cmp", "attn_gate")
    for cat in ("op", "attn_proj", "attn_rest", "mlp", "norms", "embed_head", "optimizer") + nsa_only:
        if attention == "dense" and cat in nsa_only:
            assert ms[cat] == 0, (cat, ms)   # the dense layer has no compression or gates
        else:
            assert ms[cat] > 0, (cat, ms)
    # backward is about 1/3 of the CPU-timed ops on a quiet machine (16% seen beside the Ray tests on 2 cores); a
    # broken backward attribution gives 0
    assert row["backward_labelled_ms"] > 0.1 * row["busy_ms"], row
    assert ms["other"] < 0.3 * row["busy_ms"], ms
