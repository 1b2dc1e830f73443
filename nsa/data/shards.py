"""Parquet shards with a manifest: writing them atomically and checking them before training.

Layout of a prepared data directory (FineWeb-Edu's columns, see nsa.data.docs):

    train-00000-of-00004.parquet ... train-00003-of-00004.parquet
    val-00000.parquet            held-out documents (never in a train shard)
    manifest.json                per shard: path, split, docs, tokens, text_bytes, file_bytes, sha256

Atomicity: everything is written into a hidden staging folder inside `out_dir` and moved into place
only after the last shard is complete; `manifest.json` is replaced last, so a directory with a
manifest always has complete shards. An interrupted run leaves at most the hidden staging folder.

`check_data_path` accepts a prepared directory, any directory of parquet files with a `text` column
(e.g. FineWeb-Edu's own `sample/10BT/*.parquet`), or a single parquet file, and raises errors that
name the file and the fix. A URL (`hf://datasets/...`, `file:///...`) is listed and checked by
nsa.data.sources instead: no manifest, checksum or verdict cache applies to it.

Preflight cost: every launch reads each shard's footer and checks every row group's metadata (column
chunks inside the file, row counts adding up). The first time a shard is seen it is also decoded
(each row group's `text` column) and its manifest checksum verified; the verdict is remembered by
path, size and mtime in `VERDICTS` (in the data directory, or ~/.cache/nsa/ when that is read-only),
so a relaunch on a large corpus costs metadata reads, and a shard that changes is checked again.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from nsa.data.sources import VAL_NAME, check_parquet_url, is_url

MANIFEST = "manifest.json"
VERDICTS = ".nsa-shards-verified.json"
FORMAT = "nsa-shards/1"
PREPARE_HINT = "python pipelines/prepare_data.py"


def _pa():
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pa, pq


def _schema():
    from nsa.data.docs import FINEWEB_COLUMNS

    pa, _ = _pa()
    return pa.schema([(name, getattr(pa, typ)()) for name, typ in FINEWEB_COLUMNS])


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def _hash_unit(doc_id: str) -> float:
    """Deterministic value in [0, 1) from a document id (val_fraction membership)."""
    return int.from_bytes(hashlib.sha1(doc_id.encode()).digest()[:8], "big") / 2.0**64


class _ShardBuffer:
    """Collects one split's documents and writes numbered parquet files into the staging folder."""

    def __init__(self, split: str, staging: Path, docs_per_shard: int | None, shard_bytes: int,
                 count_tokens: Callable[[list[str]], int], compression: str) -> None:
        self.split, self.staging = split, staging
        self.docs_per_shard, self.shard_bytes = docs_per_shard, shard_bytes
        self.count_tokens, self.compression = count_tokens, compression
        self.rows: list[Mapping[str, Any]] = []
        self.nbytes = 0
        self.written: list[dict[str, Any]] = []

    def add(self, doc: Mapping[str, Any], nbytes: int) -> None:
        self.rows.append(doc)
        self.nbytes += nbytes
        full = (self.docs_per_shard is not None and len(self.rows) >= self.docs_per_shard) or \
            (self.docs_per_shard is None and self.nbytes >= self.shard_bytes)
        if full:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        pa, pq = _pa()
        schema = _schema()
        table = pa.Table.from_pylist([{k: d.get(k) for k in schema.names} for d in self.rows],
                                     schema=schema)
        path = self.staging / f"{self.split}-{len(self.written):05d}.parquet"
        # Row groups of ~1k docs keep footers small and let readers stream within a file.
        pq.write_table(table, path, compression=self.compression, row_group_size=1024)
        texts = [d["text"] for d in self.rows]
        self.written.append({"path": path.name, "split": self.split, "docs": len(self.rows),
                             "tokens": int(self.count_tokens(texts)), "text_bytes": self.nbytes,
                             "file_bytes": path.stat().st_size, "sha256": sha256_file(path)})
        self.rows, self.nbytes = [], 0


def _byte_count(texts: list[str]) -> int:
    return sum(len(t.encode("utf-8", errors="replace")) - t.count("\x00") for t in texts)


def _prepare_out_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir {str(out)!r} exists and is not a directory; choose another --out")
    if out.is_dir() and any(not p.name.startswith(".tmp-") for p in out.iterdir()) and not overwrite:
        raise FileExistsError(f"out_dir {str(out)!r} is not empty; refusing to overwrite it. Pass "
                              f"overwrite=True (--overwrite) or choose another --out")
    out.mkdir(parents=True, exist_ok=True)


def _remove_previous(out: Path) -> None:
    """On overwrite, delete only what a previous write_shards produced (other files are kept)."""
    manifest = out / MANIFEST
    for pat in ("train-*.parquet", "val-*.parquet"):
        for f in out.glob(pat):
            f.unlink()
    if manifest.exists():
        manifest.unlink()
    (out / VERDICTS).unlink(missing_ok=True)     # verdicts on the deleted shards


def write_shards(docs: Iterable[Mapping[str, Any]], out_dir: str | os.PathLike, *,
                 docs_per_shard: int | None = None, shard_bytes: int = 8_000_000,
                 val_docs: int | None = None, val_fraction: float | None = None,
                 overwrite: bool = False, tokenizer: Any = None, source: str = "",
                 progress: Callable[[int, int], None] | None = None,
                 compression: str = "zstd", inputs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write `docs` as train/val parquet shards + manifest.json; return the manifest.

    Shards close at `docs_per_shard` documents if given, else at ~`shard_bytes` of text.
    Held-out set: the first `val_docs` documents, or the documents whose id hashes below
    `val_fraction` (both: hashed, capped at `val_docs`). `tokens` in the manifest are counted with
    `tokenizer` (its `encode_batch`), else as UTF-8 bytes (= byte-tokenizer tokens, EOS excluded).
    `progress(docs_done, bytes_done)` is called after every document. `inputs` (see
    nsa.data.sources.prepare_inputs) go into the manifest so that a re-run can tell it has nothing to do.
    """
    if docs_per_shard is not None and docs_per_shard < 1:
        raise ValueError(f"docs_per_shard must be >= 1 or None, got {docs_per_shard}")
    if shard_bytes < 1:
        raise ValueError(f"shard_bytes must be >= 1, got {shard_bytes}")
    if val_docs is not None and val_docs < 0:
        raise ValueError(f"val_docs must be >= 0 or None, got {val_docs}")
    if val_fraction is not None and not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    out = Path(out_dir)
    created = not out.exists()
    _prepare_out_dir(out, overwrite)
    staging = out / f".tmp-{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    count = _byte_count if tokenizer is None else \
        (lambda texts: sum(len(ids) for ids in tokenizer.encode_batch(texts)))
    try:
        train = _ShardBuffer("train", staging, docs_per_shard, shard_bytes, count, compression)
        val = _ShardBuffer("val", staging, None, shard_bytes, count, compression)
        n_docs = n_bytes = n_val = 0
        for doc in docs:
            text = doc.get("text")
            if not isinstance(text, str):
                raise ValueError(f"document {n_docs} has no string 'text' field "
                                 f"(keys: {sorted(doc)[:10]})")
            nbytes = len(text.encode("utf-8", errors="replace"))
            if val_fraction is not None:
                to_val = _hash_unit(str(doc.get("id", n_docs))) < val_fraction
                to_val = to_val and (val_docs is None or n_val < val_docs)
            else:
                to_val = val_docs is not None and n_val < val_docs
            (val if to_val else train).add(doc, nbytes)
            n_val += int(to_val)
            n_docs += 1
            n_bytes += nbytes
            if progress is not None:
                progress(n_docs, n_bytes)
        train.flush()
        val.flush()
        if not train.written:
            raise ValueError(f"no training documents: the source gave {n_docs} document(s) and "
                             f"{n_val} went to the validation split; raise --max-docs/--max-bytes "
                             f"or lower --val-docs/--val-fraction")
        manifest = _commit(out, staging, train.written, val.written, overwrite, source, tokenizer, inputs)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created and not any(out.iterdir()):
            out.rmdir()  # a failed first write leaves nothing behind
        raise
    shutil.rmtree(staging, ignore_errors=True)
    return manifest


def _commit(out: Path, staging: Path, train: list[dict[str, Any]], val: list[dict[str, Any]],
            overwrite: bool, source: str, tokenizer: Any,
            inputs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Give train shards their final `-of-N` names, move everything into `out`, manifest last."""
    n = len(train)
    for i, entry in enumerate(train):
        final = f"train-{i:05d}-of-{n:05d}.parquet"
        os.replace(staging / entry["path"], staging / final)
        entry["path"] = final
    if overwrite:
        _remove_previous(out)
    for entry in train + val:
        os.replace(staging / entry["path"], out / entry["path"])

    def total(entries: list[dict[str, Any]], key: str) -> int:
        return sum(e[key] for e in entries)

    manifest = {
        "format": FORMAT,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "source": source,
        "token_counter": getattr(tokenizer, "name", "byte") if tokenizer is not None else "byte",
        **({"inputs": dict(inputs)} if inputs is not None else {}),
        "train": train,
        "val": val,
        "totals": {"train_shards": n, "train_docs": total(train, "docs"),
                   "train_tokens": total(train, "tokens"), "val_docs": total(val, "docs"),
                   "val_tokens": total(val, "tokens"),
                   "text_bytes": total(train, "text_bytes") + total(val, "text_bytes")},
    }
    tmp = staging / MANIFEST
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, out / MANIFEST)
    return manifest


# ----------------------------------------------------------------------------------------------
# Checking a data path before training
# ----------------------------------------------------------------------------------------------

def read_manifest(path: str | os.PathLike) -> dict[str, Any] | None:
    """The directory's manifest.json, None if it has none; ValueError if it is unreadable."""
    f = Path(path) / MANIFEST
    if not f.is_file():
        return None
    try:
        manifest = json.loads(f.read_text())
        if not isinstance(manifest.get("train"), list):
            raise ValueError("no 'train' list")
    except (ValueError, AttributeError) as exc:
        raise ValueError(f"{f}: unreadable manifest ({exc}); re-create the directory with "
                         f"{PREPARE_HINT} --out {Path(path)} --overwrite") from exc
    return manifest


class Verdicts:
    """Shards already decoded cleanly, by absolute path -> {size, mtime_ns, sha256?} (see module doc)."""

    def __init__(self, root: Path) -> None:
        root = root if root.is_dir() else root.parent
        self.path = root / VERDICTS
        if not os.access(root, os.W_OK):
            self.path = Path.home() / ".cache" / "nsa" / "shard-verdicts.json"
        try:
            self.data: dict[str, dict[str, Any]] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.data = {}
        self.dirty = False

    @staticmethod
    def _stamp(f: Path) -> dict[str, int]:
        st = f.stat()
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}

    def get(self, f: Path) -> dict[str, Any] | None:
        v = self.data.get(str(f.resolve()))
        return v if v is not None and all(v.get(k) == x for k, x in self._stamp(f).items()) else None

    def put(self, f: Path, **extra: Any) -> None:
        key = str(f.resolve())
        self.data[key] = {**(self.get(f) or {}), **self._stamp(f), **extra}
        self.dirty = True

    def save(self) -> None:
        if not self.dirty:
            return
        try:   # a cache: failing to write it costs the next launch a decode, nothing else
            from nsa.fileio import atomic_write_text
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, json.dumps(self.data, indent=1))
            self.dirty = False
        except OSError:
            pass


def _check_row_groups(f: Path, pf: Any, fix: str) -> None:
    """Every row group's metadata: column chunks lie inside the file, row counts add up."""
    md, size = pf.metadata, f.stat().st_size
    total = 0
    for i in range(md.num_row_groups):
        rg = md.row_group(i)
        total += rg.num_rows
        for c in range(rg.num_columns):
            cc = rg.column(c)
            start = min(o for o in (cc.dictionary_page_offset, cc.data_page_offset) if o is not None and o >= 0)
            if start < 4 or start + cc.total_compressed_size > size:
                raise ValueError(f"{f}: row group {i} column {cc.path_in_schema!r} points outside the file "
                                 f"({start}+{cc.total_compressed_size} > {size} bytes): truncated or corrupt; {fix}")
    if total != md.num_rows:
        raise ValueError(f"{f}: row groups hold {total} rows, the footer says {md.num_rows}: corrupt; {fix}")


def decode_shard(path: str | os.PathLike, pf: Any = None) -> None:
    """Decode each row group's ``text`` column once; a failure names the shard and the row group."""
    _, pq = _pa()
    f = Path(path)
    pf = pf or pq.ParquetFile(f)
    n = pf.metadata.num_row_groups
    for i in range(n):
        try:
            pf.read_row_group(i, columns=["text"])
        except Exception as exc:  # ZSTD/thrift/BYTE_ARRAY errors: all mean the bytes are damaged
            raise ValueError(f"{f}: row group {i} of {n} cannot be decoded ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}): the file is corrupt; delete it "
                             f"and re-run {PREPARE_HINT} --out {f.parent} --overwrite") from None


def validate_shard(path: str | os.PathLike, verdicts: Verdicts | None = None) -> int:
    """Open a parquet file's footer and check its row groups' metadata; decode it unless ``verdicts``
    remembers it as clean. Returns its row count. Errors name the file (and row group) and the fix."""
    _, pq = _pa()
    f = Path(path)
    fix = f"delete it and re-run {PREPARE_HINT} --out {f.parent} --overwrite"
    if not f.is_file():
        raise FileNotFoundError(f"{f}: shard is missing; {fix}")
    try:
        meta = pq.ParquetFile(f)
        rows, schema = meta.metadata.num_rows, meta.schema_arrow
    except Exception as exc:  # pyarrow raises ArrowInvalid/OSError variants for broken footers
        raise ValueError(f"{f}: corrupt parquet file, cannot read its footer "
                         f"({type(exc).__name__}: {exc}); {fix}") from exc
    _check_row_groups(f, meta, fix)
    if "text" not in schema.names:
        raise ValueError(f"{f}: no 'text' column (columns: {schema.names}); shards need a string "
                         f"'text' column like FineWeb-Edu's; {fix}")
    if str(schema.field("text").type) not in ("string", "large_string", "string_view"):
        raise ValueError(f"{f}: column 'text' has type {schema.field('text').type}, expected "
                         f"string; {fix}")
    if rows == 0:
        raise ValueError(f"{f}: empty shard (0 rows); {fix}")
    if verdicts is None or verdicts.get(f) is None or not verdicts.get(f).get("decoded"):
        decode_shard(f, meta)
        if verdicts is not None:
            verdicts.put(f, decoded=True)
    return rows


def _is_val(p: Path, root: Path) -> bool:
    """`val-00000.parquet`, `validation_0.parquet` or anything under a `val/` folder."""
    return any(VAL_NAME.match(part) for part in p.relative_to(root).parts)


def _listed(root: Path, manifest: dict[str, Any], split: str, verify_checksums: bool,
            verdicts: Verdicts | None = None) -> list[Path]:
    files = []
    for entry in manifest.get(split, []):
        f = root / entry["path"]
        if not f.is_file():
            raise FileNotFoundError(f"{f}: listed in {root / MANIFEST} but missing; re-run "
                                    f"{PREPARE_HINT} --out {root} --overwrite")
        want = entry.get("sha256")
        known = verdicts.get(f) if verdicts is not None else None
        if verify_checksums and want and not (known and known.get("sha256") == want):
            if sha256_file(f) != want:
                raise ValueError(f"{f}: sha256 does not match {root / MANIFEST} (file modified or "
                                 f"truncated); re-run {PREPARE_HINT} --out {root} --overwrite")
            if verdicts is not None:
                verdicts.put(f, sha256=want)
        files.append(f)
    return files


def _scan(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.parquet")
                  if not any(part.startswith(".") for part in p.relative_to(root).parts))


def check_data_path(path: str | os.PathLike, *, verify_checksums: bool = True) -> list[str]:
    """Validated train shard paths of a data directory (or the file itself); see module doc.
    A URL (hf://, file://) gives its parquet URLs, checked as nsa.data.sources says (no manifest)."""
    if is_url(path):
        return check_parquet_url(str(path), "train")
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"data path {str(p)!r} does not exist; create it with "
                                f"{PREPARE_HINT} --out {p} (offline corpus) or point data.path at "
                                f"a directory of FineWeb-Edu parquet files")
    verdicts = Verdicts(p)
    if p.is_file():
        if p.suffix != ".parquet":
            raise ValueError(f"data path {str(p)!r} is not a .parquet file or a directory")
        validate_shard(p, verdicts)
        verdicts.save()
        return [str(p)]
    manifest = read_manifest(p)
    if manifest is not None:
        files = _listed(p, manifest, "train", verify_checksums, verdicts)
    else:
        files = [f for f in _scan(p) if not _is_val(f, p)]
    if not files:
        raise FileNotFoundError(f"{p}: no train parquet files found; create them with "
                                f"{PREPARE_HINT} --out {p}")
    try:
        for f in files:
            validate_shard(f, verdicts)
    finally:
        verdicts.save()      # the shards verified before a bad one are not decoded again
    return [str(f) for f in files]


def find_val_shards(path: str | os.PathLike, *, verify_checksums: bool = True) -> list[str]:
    """Validated held-out shard paths of a data directory or URL ([] when it has none)."""
    if is_url(path):
        return check_parquet_url(str(path), "val")
    p = Path(path).expanduser()
    if p.is_file():
        return []
    if not p.is_dir():
        raise FileNotFoundError(f"data path {str(p)!r} does not exist; create it with "
                                f"{PREPARE_HINT} --out {p}")
    manifest = read_manifest(p)
    verdicts = Verdicts(p)
    files = _listed(p, manifest, "val", verify_checksums, verdicts) if manifest is not None else \
        [f for f in _scan(p) if _is_val(f, p)]
    try:
        for f in files:
            validate_shard(f, verdicts)
    finally:
        verdicts.save()
    return [str(f) for f in files]


def resolve_val_files(data_path: str | os.PathLike, val_path: str | os.PathLike | None = None) -> list[str]:
    """The held-out files of a run: `val_path`'s (a file: itself; a directory or URL: its val-* files,
    else all its parquet files), or else `data_path`'s val-* files ([] for a single file)."""
    if val_path is None:
        return find_val_shards(data_path) if is_url(data_path) or Path(data_path).expanduser().is_dir() else []
    if is_url(val_path) or Path(val_path).expanduser().is_dir():
        return find_val_shards(val_path) or check_data_path(val_path)
    return check_data_path(val_path)       # one file: validated, its verdict remembered


class DataError(ValueError):
    """A shard failed to decode while training; the message names the shard and the row group."""


def diagnose_data_error(path: str | os.PathLike) -> str | None:
    """After a read failure at run time: decode the shards of ``path`` that are not remembered as clean
    (a clean, unchanged shard cannot be the cause), and return the first failure's one-line message.
    None for a URL: diagnosing would mean downloading the corpus; Ray's own error names the file."""
    if is_url(path):
        return None
    p = Path(path).expanduser()
    verdicts = Verdicts(p)
    files = [p] if p.is_file() else _scan(p)
    for f in files:
        known = verdicts.get(f)
        if known and known.get("decoded"):
            continue
        try:
            decode_shard(f)
        except (ValueError, OSError) as exc:
            return str(exc)
    return None
