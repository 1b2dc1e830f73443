"""nsa.data without Ray: tokenizers, packing, local corpus, sources, shards, prepare_data CLI."""
from __future__ import annotations

import base64
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nsa.data.docs import COLUMN_NAMES, limit_docs
from nsa.data.local_corpus import iter_local_corpus
from nsa.data.packing import (StreamPacker, concat_with_eos, pack_documents, stream_to_rows,
                              tokenize_and_pack)
from nsa.data.ray_data import iter_packed_batches
from nsa.data.shards import check_data_path, find_val_shards, read_manifest, write_shards
from nsa.data.sources import iter_hub_fineweb, iter_jsonl, iter_txt
from nsa.data.tokenizers import (ByteTokenizer, _data_gym_byte_map, get_tokenizer,
                                 load_gpt2_tokenizer)

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------- tokenizers

@pytest.mark.parametrize("text", ["hello world", "naïve café — ∑ 🚀", "", "line\nbreak\ttab"])
def test_byte_tokenizer_roundtrip(text):
    tok = get_tokenizer("byte")
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 < i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert (tok.vocab_size, tok.eos_id) == (256, 0)


def test_byte_tokenizer_drops_nul_and_streams_with_eos():
    tok = ByteTokenizer()
    assert tok.encode("a\x00b") == [97, 98]
    stream = tok.encode_stream(["ab", "", "c\x00"])
    assert stream.dtype == np.int64
    assert stream.tolist() == [97, 98, 0, 0, 99, 0]
    assert stream.tolist() == concat_with_eos(tok.encode_batch(["ab", "", "c\x00"]), 0).tolist()
    with pytest.raises(ValueError, match="0..255"):
        tok.decode([300])
    with pytest.raises(ValueError, match="unknown"):
        get_tokenizer("sentencepiece")


def test_gpt2_without_local_file_raises_helpful_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tiktoken_path") as exc:
        get_tokenizer("gpt2")
    assert "byte" in str(exc.value) and "gpt2.tiktoken" in str(exc.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        get_tokenizer("gpt2", tiktoken_path=tmp_path / "nope.tiktoken")
    with pytest.raises(FileNotFoundError, match="directory without"):
        get_tokenizer("gpt2", tiktoken_path=tmp_path)
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("not base64 at all\n")
    with pytest.raises(ValueError, match="bad.tiktoken"):
        get_tokenizer("gpt2", tiktoken_path=bad)


def _tiny_ranks() -> dict[bytes, int]:
    ranks = {bytes([b]): b for b in range(256)}
    for merge in (b"th", b"the", b" t", b" the", b"in", b"ing"):
        ranks[merge] = len(ranks)
    return ranks


def test_gpt2_style_tokenizer_from_local_files(tmp_path):
    ranks = _tiny_ranks()
    f = tmp_path / "gpt2.tiktoken"
    f.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in ranks.items()))
    tok = get_tokenizer("gpt2", tiktoken_path=f)
    text = "the thing is the thing"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges were applied
    assert tok.eos_id == len(ranks) and tok.vocab_size == len(ranks) + 1
    assert not tok.matches_reference
    assert tok.encode("<|endoftext|>") != [tok.eos_id]  # special text is not EOS
    # The same vocabulary as GPT-2's data-gym encoder.json, found through a directory.
    char_of = {b: c for c, b in _data_gym_byte_map().items()}
    table = {"".join(char_of[b] for b in t): r for t, r in ranks.items()}
    d = tmp_path / "cache"
    d.mkdir()
    (d / "encoder.json").write_text(json.dumps(table))
    tok2 = load_gpt2_tokenizer(d)
    assert tok2.encode(text) == ids
    assert load_gpt2_tokenizer(d / "encoder.json").encode(text) == ids
    stream = tok2.encode_stream([text, text])
    assert stream.tolist() == ids + [tok2.eos_id] + ids + [tok2.eos_id]


# ------------------------------------------------------------------------------------- packing

def _naive_pack(docs, seq_len, eos):
    stream = [t for d in docs for t in list(d) + [eos]]
    n = len(stream) // (seq_len + 1)
    return [stream[i * (seq_len + 1):(i + 1) * (seq_len + 1)] for i in range(n)]


def test_pack_documents_layout_and_remainder():
    out = pack_documents([[1, 2, 3], [4, 5]], seq_len=3, eos_id=0)
    assert out.dtype == np.int64 and out.shape == (1, 4)
    assert out.tolist() == [[1, 2, 3, 0]]  # [4, 5, 0] is the dropped remainder
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 256, size=int(n)).tolist() for n in rng.integers(0, 50, size=40)]
    for seq_len in (1, 7, 64):
        got = pack_documents(docs, seq_len, eos_id=0)
        assert got.shape[1] == seq_len + 1
        assert got.tolist() == _naive_pack(docs, seq_len, 0)
    assert pack_documents([], 8, 0).shape == (0, 9)
    with pytest.raises(ValueError, match="seq_len"):
        pack_documents(docs, 0, 0)


def test_stream_packer_carries_tail_and_tokenize_and_pack():
    rng = np.random.default_rng(1)
    stream = rng.integers(0, 256, size=1000)
    packer = StreamPacker(seq_len=15)
    pieces = [packer.push(chunk) for chunk in np.array_split(stream, 7)]
    assert np.concatenate(pieces).tolist() == stream_to_rows(stream, 15).tolist()
    assert packer.pending_tokens == 1000 % 16
    batch = {"text": np.array(["abc", None, "de"], dtype=object)}
    out = tokenize_and_pack(batch, ByteTokenizer(), seq_len=3)
    assert out["input_ids"].tolist() == [[97, 98, 99, 0]]
    with pytest.raises(ValueError, match="'text'"):
        tokenize_and_pack({"body": np.array(["x"])}, ByteTokenizer(), 3)


# ---------------------------------------------------------------------------- corpus + sources

def test_local_corpus_yields_real_text_deterministically():
    docs = list(iter_local_corpus(max_docs=20))
    assert len(docs) == 20
    assert all(tuple(d) == COLUMN_NAMES for d in docs)
    assert all(d["url"].startswith("file://") and Path(d["file_path"]).is_file() for d in docs)
    assert all(d["token_count"] == len(d["text"].encode()) > 0 for d in docs)
    assert all(0 <= d["int_score"] <= 5 and d["language"] == "en" for d in docs)
    joined = " ".join(d["text"] for d in docs)
    assert sum(w in joined for w in (" the ", "import ", "def ", "return")) >= 3
    assert [d["id"] for d in iter_local_corpus(max_docs=20)] == [d["id"] for d in docs]
    assert len({d["id"] for d in docs}) == 20
    capped = list(iter_local_corpus(max_bytes=200_000))
    assert 0 < sum(d["token_count"] for d in capped) <= 200_000


def test_jsonl_and_txt_sources(tmp_path):
    jl = tmp_path / "a.jsonl"
    jl.write_text(json.dumps({"text": "first doc", "id": "x1", "score": 3.5}) + "\n\n"
                  + json.dumps({"text": "second doc"}) + "\n")
    docs = list(iter_jsonl(jl))
    assert [d["text"] for d in docs] == ["first doc", "second doc"]
    assert docs[0]["score"] == 3.5 and tuple(docs[1]) == COLUMN_NAMES
    (tmp_path / "b.jsonl").write_text('{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"b\.jsonl:1"):
        list(iter_jsonl(tmp_path))
    txt = tmp_path / "t.txt"
    txt.write_text("para one\nstill one\n\n\npara two\n  \npara three")
    assert [d["text"] for d in iter_txt(txt, split="paragraph")] == \
        ["para one\nstill one", "para two", "para three"]
    assert len(list(iter_txt(txt))) == 1
    assert [d["text"] for d in limit_docs(iter_txt(txt, "paragraph"), max_docs=2)] == \
        ["para one\nstill one", "para two"]


def test_hub_source_fails_fast_with_hint():
    pytest.importorskip("datasets")
    with pytest.raises(ConnectionError, match="--source local"):
        iter_hub_fineweb(timeout_s=3.0, host="nonexistent.invalid")


# --------------------------------------------------------------------------------------- shards

def _docs(n: int):
    return list(iter_local_corpus(max_docs=n))


def test_write_shards_manifest_and_check(tmp_path):
    out = tmp_path / "data"
    docs = _docs(40)
    manifest = write_shards(iter(docs), out, docs_per_shard=10, val_docs=4)
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([f"train-0000{i}-of-00004.parquet" for i in range(4)]
                           + ["manifest.json", "val-00000.parquet"])
    assert manifest == read_manifest(out)
    assert [e["docs"] for e in manifest["train"]] == [10, 10, 10, 6]
    assert manifest["totals"]["train_tokens"] == sum(d["token_count"] for d in docs[4:])
    files = check_data_path(out)
    assert [Path(f).name for f in files] == [e["path"] for e in manifest["train"]]
    val = find_val_shards(out)
    assert [Path(v).name for v in val] == ["val-00000.parquet"]
    train_ids = set(pq.read_table(files, columns=["id"]).column("id").to_pylist())
    val_ids = pq.read_table(val[0], columns=["id"]).column("id").to_pylist()
    assert len(train_ids) == 36 and val_ids == [d["id"] for d in docs[:4]]
    assert not train_ids & set(val_ids)
    assert pq.read_schema(files[0]).names == list(COLUMN_NAMES)
    with pytest.raises(FileExistsError, match="--overwrite"):
        write_shards(iter(docs), out, docs_per_shard=10)
    write_shards(iter(docs), out, docs_per_shard=20, val_fraction=0.2, overwrite=True)
    assert len(check_data_path(out)) == 2 and not any(p.name.startswith(".tmp") for p in out.iterdir())


def test_write_shards_failure_leaves_nothing(tmp_path):
    def broken():
        yield from _docs(3)
        raise RuntimeError("source died")

    with pytest.raises(RuntimeError):
        write_shards(broken(), tmp_path / "x", docs_per_shard=1)
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="no training documents"):
        write_shards(iter(_docs(2)), tmp_path / "y", val_docs=5)


def _write(path: Path, table: pa.Table) -> Path:
    pq.write_table(table, path)
    return path


@pytest.mark.parametrize("case", ["missing_dir", "empty_dir", "empty_shard", "corrupt",
                                  "no_text_column", "checksum", "manifest_missing_file"])
def test_check_data_path_errors_name_the_file(tmp_path, case):
    d = tmp_path / "shards"
    if case != "missing_dir":
        d.mkdir()
    culprit = d
    expected: type[Exception] = ValueError
    if case in ("missing_dir", "empty_dir"):
        expected = FileNotFoundError
    elif case == "empty_shard":
        culprit = _write(d / "train-0.parquet", pa.table({"text": pa.array([], pa.string())}))
    elif case == "corrupt":
        culprit = d / "train-0.parquet"
        culprit.write_bytes(b"this is not parquet" * 10)
    elif case == "no_text_column":
        culprit = _write(d / "train-0.parquet", pa.table({"content": ["a", "b"]}))
    else:
        write_shards(iter(_docs(6)), d, docs_per_shard=3)
        culprit = d / "train-00001-of-00002.parquet"
        if case == "checksum":
            _write(culprit, pa.table({"text": ["tampered"]}))
        else:
            culprit.unlink()
            expected = FileNotFoundError
    with pytest.raises(expected) as exc:
        check_data_path(d)
    msg = str(exc.value)
    assert str(culprit) in msg
    assert "prepare_data.py" in msg or "delete it" in msg


def test_check_data_path_plain_parquet_directory(tmp_path):
    # A FineWeb-Edu-like download: nested parquet files, no manifest, a val/ folder.
    (tmp_path / "CC-MAIN-2024-10").mkdir()
    (tmp_path / "val").mkdir()
    a = _write(tmp_path / "CC-MAIN-2024-10" / "000_00000.parquet", pa.table({"text": ["a", "b"]}))
    b = _write(tmp_path / "001_00000.parquet", pa.table({"text": ["c"], "score": [3.0]}))
    v = _write(tmp_path / "val" / "000.parquet", pa.table({"text": ["held out"]}))
    assert check_data_path(tmp_path) == sorted([str(a), str(b)])
    assert find_val_shards(tmp_path) == [str(v)]
    assert check_data_path(b) == [str(b)]


def test_iter_packed_batches_matches_whole_stream(tmp_path):
    docs = _docs(12)
    write_shards(iter(docs), tmp_path / "d", docs_per_shard=5)
    files = check_data_path(tmp_path / "d")
    seq_len, bsz = 63, 4
    batches = list(iter_packed_batches(files, seq_len, "byte", bsz, doc_batch=3))
    expected = stream_to_rows(ByteTokenizer().encode_stream([d["text"] for d in docs]), seq_len)
    n = expected.shape[0] // bsz
    assert len(batches) == n and all(b.shape == (bsz, seq_len + 1) for b in batches)
    assert np.array_equal(np.concatenate(batches), expected[: n * bsz])
    skipped = next(iter_packed_batches(files, seq_len, "byte", bsz, skip_batches=2))
    assert np.array_equal(skipped, batches[2])


# ------------------------------------------------------------------------------------------ CLI

def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "pipelines" / "prepare_data.py"), *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def test_prepare_data_cli_end_to_end(tmp_path, capsys):
    out = tmp_path / "fw"
    r = _cli("--out", str(out), "--max-docs", "30", "--docs-per-shard", "10", "--val-docs", "3",
             "--no-progress")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["train_docs"] == 27 and summary["val_docs"] == 3
    assert summary["train_shards"] == 3 and len(check_data_path(out)) == 3
    assert "train-00000-of-00003.parquet" in r.stdout
    # The rest in-process (each subprocess pays for importing torch through nsa/__init__).
    spec = importlib.util.spec_from_file_location("prepare_data", REPO / "pipelines/prepare_data.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main(["--out", str(out), "--max-docs", "5", "--no-progress"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert "--source" in cli.build_parser().format_help()
    assert cli.main(["--out", str(out), "--max-docs", "8", "--val-docs", "0", "--overwrite",
                     "--no-progress"]) == 0
    assert read_manifest(out)["totals"]["train_docs"] == 8 and find_val_shards(out) == []


def test_prepare_data_after_auto_prepare_is_a_no_op(tmp_path, capsys, monkeypatch):
    """train.py's auto-prepare then a plain prepare_data.py: the same inputs, so nothing is rewritten;
    other inputs or foreign files in --out are refused with one line naming --out and --overwrite."""
    import nsa.data.sources as sources
    from nsa.config import DataConfig
    from nsa.launch.builder import prepare_local_corpus
    cli = _load_cli()
    assert DataConfig().path == sources.OFFLINE_DATA_PATH == sources.DEFAULT_OUT["local"]
    assert "fineweb" not in sources.OFFLINE_DATA_PATH and sources.DEFAULT_OUT["hub"] == "data/fineweb_edu"
    real = sources.iter_source     # a few documents instead of 30 MB; the recorded inputs are the defaults'
    monkeypatch.setattr(sources, "iter_source", lambda *a, **kw: real(*a, **{**kw, "max_docs": 70}))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / sources.OFFLINE_DATA_PATH
    prepare_local_corpus(out)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    assert cli.main(["--no-progress", "--storage-root", ""]) == 0
    res = capsys.readouterr().out
    assert res.startswith(f"data already there: {out}") and "nothing to do" in res
    assert json.loads(res.strip().splitlines()[-1])["unchanged"] is True
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert cli.main(["--no-progress", "--storage-root", "", "--max-bytes", "1MB"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "max_bytes: 30000000 there, 1000000 now" in err
    assert "--overwrite" in err and "--out" in err
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("not shards")
    assert cli.main(["--no-progress", "--out", str(tmp_path / "notes")]) == 2
    assert "has no manifest.json" in capsys.readouterr().err
    assert (tmp_path / "notes" / "mine.txt").read_text() == "not shards"


def _load_cli():
    spec = importlib.util.spec_from_file_location("prepare_data", REPO / "pipelines/prepare_data.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli
