"""data.path as a parquet URL (hf://datasets/..., file:///...): the hub route, tested offline.

A FineWeb-Edu-shaped parquet set (the hub's columns and file names) lies in a local folder; the tests
read it through `file://` URLs, which take the same code as `hf://` (URL -> fsspec filesystem ->
listing -> footer check -> read_parquet(filesystem=...) -> tokenize + pack -> streaming split).
Only the hf:// mapping itself is checked without the network (constructed, never listed).
"""
from __future__ import annotations

import socket
import sys
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from nsa.config import ConfigError, DataConfig
from nsa.data import sources
from nsa.data.docs import FINEWEB_COLUMNS, make_doc
from nsa.data.local_corpus import iter_local_corpus
from nsa.data.ray_data import build_datasets, iter_packed_batches
from nsa.data.shards import check_data_path, diagnose_data_error, find_val_shards, resolve_val_files

HUB = "hf://datasets/HuggingFaceFW/fineweb-edu/sample/10BT/*.parquet"


def _write_fineweb(folder: Path, names: list[str], docs: list[dict]) -> None:
    """Parquet files with FineWeb-Edu's columns and types, docs dealt round-robin, small row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([(n, getattr(pa, t)()) for n, t in FINEWEB_COLUMNS])
    for i, name in enumerate(names):
        rows = [{n: d[n] for n in schema.names} for d in docs[i::len(names)]]
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), folder / name, row_group_size=5)


@pytest.fixture(scope="module")
def hub_like(tmp_path_factory) -> tuple[Path, list[dict]]:
    """<tmp>/sample/10BT/{000_00000,000_00001,001_00000}.parquet like the hub's sample folder."""
    root = tmp_path_factory.mktemp("hub") / "fineweb-edu"
    # 30 real-text documents of 1-3 KB (the corpus's files cut into pieces keep the test small)
    texts = [t for d in iter_local_corpus(max_docs=8, shuffle_seed=0)
             for t in (d["text"][i:i + 1000 + 100 * (i // 1000 % 20)] for i in range(0, 24000, 3000))
             if len(t) > 500]
    docs = [make_doc(t, key=f"piece-{k}", url=f"https://example.org/{k}", file_path="s3://commoncrawl/x",
                     dump="CC-MAIN-2024-10") for k, t in enumerate(texts[:30])]
    assert len(docs) == 30 and all(len(d["text"]) > 500 for d in docs)
    _write_fineweb(root / "sample" / "10BT", ["000_00000.parquet", "000_00001.parquet", "001_00000.parquet"],
                   docs)
    return root / "sample" / "10BT", docs


def _one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert "\n" not in msg, msg
    return msg


# ------------------------------------------------------------------------------------ URL -> filesystem
def test_hf_url_maps_to_hffilesystem_without_network(monkeypatch):
    from huggingface_hub import HfFileSystem

    def no_network(*a, **k):
        raise AssertionError("the hf:// mapping opened a connection")
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    fs, path = sources.url_filesystem(HUB)
    assert isinstance(fs, HfFileSystem)
    assert path == "datasets/HuggingFaceFW/fineweb-edu/sample/10BT/*.parquet"
    paths, rfs = sources.read_parquet_args([HUB.replace("*", "000_00000")])
    assert rfs is fs and paths == ["datasets/HuggingFaceFW/fineweb-edu/sample/10BT/000_00000.parquet"]
    assert sources.read_parquet_args(["/a.parquet"]) == (["/a.parquet"], None)   # local: Ray's default fs


def test_missing_huggingface_hub_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)     # import fails as if not installed
    with pytest.raises(ImportError) as ei:
        sources.url_filesystem(HUB)
    msg = _one_line(ei.value)
    assert msg.startswith(f"{HUB!r} needs the huggingface_hub package: pip install huggingface_hub")
    assert "prepare_data.py" in msg


def test_hub_offline_mode_is_one_line(monkeypatch):
    """HF_HUB_OFFLINE=1 applies: listing the hub fails at once with the fix (stage with prepare_data)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)   # what HF_HUB_OFFLINE=1 sets
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: pytest.fail("went to the network"))
    with pytest.raises(ConnectionError) as ei:
        check_data_path(HUB)
    msg = _one_line(ei.value)
    assert msg.startswith(f"{HUB!r}: listing failed (OfflineModeIsEnabled")
    assert "HF_HUB_OFFLINE" in msg and "prepare_data.py" in msg


def test_url_listing_nothing_is_one_line(tmp_path):
    from conftest import local_cfg
    from nsa.launch.builder import UserError, validate_inputs

    (tmp_path / "notes.txt").write_text("no parquet here")
    for url in (tmp_path.as_uri(), f"{tmp_path.as_uri()}/*.parquet", f"{tmp_path.as_uri()}/missing",
                f"{tmp_path.as_uri()}/notes.txt"):
        with pytest.raises(FileNotFoundError) as ei:
            check_data_path(url)
        msg = _one_line(ei.value)
        assert msg.startswith(f"{url!r} lists no train parquet files") and "hf://datasets/" in msg
    cfg = local_cfg(tmp_path, tmp_path / "runs")
    cfg.data.path = tmp_path.as_uri()
    with pytest.raises(UserError) as ei:       # the launcher's line names the field
        validate_inputs(cfg)
    assert _one_line(ei.value).startswith(f"data.path: {tmp_path.as_uri()!r} lists no train parquet files")


def test_url_without_text_column_is_one_line(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a", "b"]}), tmp_path / "x.parquet")
    with pytest.raises(ValueError) as ei:
        check_data_path(tmp_path.as_uri())
    assert "no string 'text' column" in _one_line(ei.value) and "content" in str(ei.value)


# ------------------------------------------------------------------------------------ config validation
def test_config_accepts_url_schemes_and_names_the_forms():
    assert DataConfig(path=HUB).path == HUB
    assert DataConfig(path="file:///data/fineweb/*.parquet", val_path="hf://datasets/o/n/val").val_path
    bad = {"s3://bucket/fineweb": "unsupported scheme s3://",
           "hf://HuggingFaceFW/fineweb-edu": "names a dataset",
           "file://data/rel": "absolute path"}
    for path, why in bad.items():
        with pytest.raises(ConfigError) as ei:
            DataConfig(path=path)
        msg = _one_line(ei.value)
        assert msg.startswith(f"data.path={path!r}") and why in msg, msg
    with pytest.raises(ConfigError) as ei:
        DataConfig(val_path="gs://b/v")
    assert _one_line(ei.value).startswith("data.val_path='gs://b/v'") and "hf://datasets/" in str(ei.value)


# ------------------------------------------------------------------------------------ listing and checks
def test_folder_and_glob_list_the_same_files_without_manifest(hub_like, tmp_path):
    folder, docs = hub_like
    work = tmp_path / "10BT"      # a private copy: nothing may be written beside the files
    _write_fineweb(work, ["000_00000.parquet", "001_00000.parquet", "val-00000.parquet",
                          ".cache/000_00000.parquet"], docs)
    before = sorted(p.relative_to(work) for p in work.rglob("*"))
    by_folder = check_data_path(work.as_uri())
    by_glob = check_data_path(f"{work.as_uri()}/*.parquet")
    want = [f"file://{work}/000_00000.parquet", f"file://{work}/001_00000.parquet"]
    assert by_folder == by_glob == want            # val-* and hidden folders stay out of train
    assert find_val_shards(work.as_uri()) == [f"file://{work}/val-00000.parquet"]
    assert resolve_val_files(work.as_uri()) == find_val_shards(work.as_uri())
    # a val_path URL without val-named files: all its files are held out (as for a local directory)
    assert resolve_val_files(work.as_uri(), f"{folder.as_uri()}/001_*.parquet") == \
        [f"file://{folder}/001_00000.parquet"]
    single = f"file://{work}/001_00000.parquet"
    assert check_data_path(single) == [single] and find_val_shards(single) == []
    assert diagnose_data_error(work.as_uri()) is None          # never downloads a corpus to diagnose
    assert sorted(p.relative_to(work) for p in work.rglob("*")) == before   # no verdict cache written


def test_plain_iterator_reads_urls_like_paths(hub_like):
    """Same tokens and packing: the URL route and the local route give identical batches."""
    folder, _ = hub_like
    urls = check_data_path(f"{folder.as_uri()}/*.parquet")
    local = [u[len("file://"):] for u in urls]
    a = list(iter_packed_batches(urls, 63, "byte", batch_size=4, doc_batch=7))
    b = list(iter_packed_batches(local, 63, "byte", batch_size=4, doc_batch=7))
    assert len(a) >= 3 and all(x.shape == (4, 64) for x in a)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_training_on_a_url_matches_the_staged_path(tiny_data, tmp_path):
    """The launcher keeps a URL as given (not made a local absolute path), finds its val-* file, and a
    run on `file://<dir>` trains on the very rows the staged `<dir>` gives: identical losses."""
    import csv

    from conftest import local_cfg, run_local
    from nsa.launch.builder import val_rows, validate_inputs

    losses, evals = [], []
    for path in (str(tiny_data), tiny_data.as_uri()):
        cfg = local_cfg(tiny_data, tmp_path / str(len(losses)), train__steps=2, train__eval_every=2)
        cfg.data.path = path
        validate_inputs(cfg)
        assert cfg.data.path == path
        evals.append(val_rows(cfg))
        summary, run_dir = run_local(cfg)
        assert summary["status"] == "completed" and summary["step"] == 2
        with open(Path(run_dir) / "training.csv", newline="") as fh:
            losses.append([float(r["loss"]) for r in csv.DictReader(fh)])
    assert evals[0] is not None and np.array_equal(evals[0], evals[1])
    assert len(losses[1]) == 2 and losses[1] == pytest.approx(losses[0], rel=1e-6)


# ------------------------------------------------------------------------------------ Ray Data route
def _consume_split(ds, n: int) -> list[np.ndarray]:
    """What `DataConfig(datasets_to_split=["train"])` does for n Train workers: streaming_split(n,
    equal=True), each shard consumed concurrently (the coordinator serves them together)."""
    shards = ds.streaming_split(n, equal=True)
    out: list[list[np.ndarray]] = [[] for _ in range(n)]

    def take(i: int) -> None:
        for b in shards[i].iter_batches(batch_size=2, batch_format="numpy"):
            out[i].append(b["input_ids"])
    threads = [threading.Thread(target=take, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return [np.concatenate(o) if o else np.zeros((0, 0), np.int64) for o in out]


@pytest.mark.ray
def test_ray_hub_route_streams_splits_and_packs_like_staged(ray_session, hub_like, monkeypatch):
    """build_datasets on the URL, split for two workers as Ray Train splits it, holds the rows the staged
    route (the same folder as a local path) packs: same tokens, same packing, disjoint equal shares."""
    import ray.data

    folder, _ = hub_like
    opts = ray.data.DataContext.get_current().execution_options
    monkeypatch.setattr(opts, "preserve_order", True)         # as build_trainer's DataConfig runs it
    seq_len = 95
    url_ds, url_val = build_datasets(f"{folder.as_uri()}/*.parquet", seq_len, "byte", shuffle_seed=None,
                                     doc_batch=8)
    loc_ds, _ = build_datasets(str(folder), seq_len, "byte", shuffle_seed=None, doc_batch=8)
    assert url_val is None                          # the hub's sample folder has no held-out files
    staged = Counter(r["input_ids"].tobytes() for r in loc_ds.take_all())
    parts = _consume_split(url_ds, 2)
    assert parts[0].shape[1] == seq_len + 1 and parts[0].shape[0] == parts[1].shape[0] >= 8
    got = Counter(r.tobytes() for p in parts for r in p)
    # equal=True may hold back fewer rows than workers to keep the shares equal; nothing else differs
    assert not got - staged and sum((staged - got).values()) < 2
