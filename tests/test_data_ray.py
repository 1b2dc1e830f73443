"""nsa.data.ray_data.build_datasets on a local Ray instance (marked `ray`)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from nsa.data.local_corpus import iter_local_corpus
from nsa.data.shards import write_shards

REPO = Path(__file__).resolve().parents[1]


def test_ray_data_module_does_not_import_ray():
    code = "import sys, nsa.data.ray_data, nsa.data; assert 'ray' not in sys.modules, 'ray imported'"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():  # a session-wide instance from elsewhere: reuse, do not stop it
        yield ray
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        mp.setenv("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            yield ray
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("ray_data") / "shards"
    docs = list(iter_local_corpus(max_docs=24))
    write_shards(iter(docs), out, docs_per_shard=10, val_docs=4)
    return out, docs


@pytest.mark.ray
def test_build_datasets_rows(ray_local, small_data):
    from nsa.data.ray_data import build_datasets

    out, docs = small_data
    seq_len = 127
    train_ds, val_ds = build_datasets(str(out), seq_len, "byte", shuffle_seed=0)
    assert val_ds is not None
    # Iterate the way the train loop does (numpy batches of rows).
    batches = list(train_ds.iter_batches(batch_size=4, batch_format="numpy"))
    assert all(b["input_ids"].shape[1:] == (seq_len + 1,) for b in batches)
    ids = np.concatenate([b["input_ids"] for b in batches])  # [n, seq_len+1]
    assert ids.dtype == np.int64 and ids.shape[1] == seq_len + 1
    train_bytes = sum(d["token_count"] + 1 for d in docs[4:])  # + one EOS per document
    # Each map batch drops < seq_len+1 tokens; there are at most a handful of batches.
    assert train_bytes // (seq_len + 1) - 8 <= ids.shape[0] <= train_bytes // (seq_len + 1)
    assert ids.min() >= 0 and ids.max() < 256 and (ids == 0).any()  # bytes with EOS marks
    # Rows are real text: decoding gives mostly printable characters.
    text = bytes(ids[0].astype(np.uint8)).decode("utf-8", errors="replace")
    assert sum(ch.isprintable() or ch in "\n\t\x00" for ch in text) > 0.9 * len(text)
    val_rows = val_ds.take_all()
    val_bytes = sum(d["token_count"] + 1 for d in docs[:4])
    assert len(val_rows) == val_bytes // (seq_len + 1)  # 4 docs fit in one map batch


@pytest.mark.ray
def test_build_datasets_accepts_config_object(ray_local, small_data):
    from nsa.data.ray_data import build_datasets

    out, _ = small_data
    # Building is lazy (nothing executes here); the rows test above covers execution.
    val_file = sorted(out.glob("val-*.parquet"))[0]
    cfg = SimpleNamespace(path=str(out), tokenizer="byte", val_path=str(val_file),
                          tiktoken_path=None, shuffle_seed=None)
    train_ds, val_ds = build_datasets(cfg, 63)
    assert isinstance(train_ds, ray_local.data.Dataset)
    assert isinstance(val_ds, ray_local.data.Dataset)
    with pytest.raises(FileNotFoundError, match="tiktoken_path"):
        build_datasets(SimpleNamespace(path=str(out), tokenizer="gpt2"), 63)
    with pytest.raises(FileNotFoundError, match="prepare_data.py"):
        build_datasets(str(out / "missing"), 63)
