"""Document sources: for prepare_data (local corpus, JSONL, TXT, FineWeb-Edu from the HF hub), and
parquet URLs that training streams without staging (`data.path=hf://datasets/...`).

All prepare_data sources yield FineWeb-Edu-shaped records (nsa.data.docs). The hub source streams
`HuggingFaceFW/fineweb-edu` (config `sample-10BT`) through `datasets` and fails fast when the network
is unavailable: a TCP probe of the hub host, then `load_dataset` and the first row each under
`timeout_s` (the old stack's `--loader-timeout`), with an error that suggests `--source local`.

Parquet URLs (bottom of this file): `hf://datasets/<org>/<name>/<folder or glob>` through
huggingface_hub's fsspec filesystem (`HfFileSystem`), or `file:///abs/<folder or glob>` through fsspec's
local one; both take the same code (URL -> (filesystem, path) -> listing -> footer check -> Ray Data
`read_parquet(paths, filesystem=fs)`), so the `file://` form tests the hub route offline. What is
checked for a URL (no manifest, no checksums, nothing cached or written): the listing is non-empty and
the first file's footer has a string `text` column; a damaged remote file fails at read time.
"""
from __future__ import annotations

import gzip
import json
import os
import queue
import re
import socket
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

from nsa.data.docs import limit_docs, make_doc
from nsa.data.local_corpus import iter_local_corpus

SOURCES: tuple[str, ...] = ("local", "jsonl", "txt", "hub")
HUB_DATASET = "HuggingFaceFW/fineweb-edu"
T = TypeVar("T")

_OFFLINE_HINT = ("Use the offline corpus instead: python pipelines/prepare_data.py --source local "
                 "(or --source jsonl/txt --input <local files>).")

# Default folders of prepare_data.py per source. The offline corpus (`local`) is the Python installation's
# own sources and docs, so its folder says so and is never mistaken for FineWeb-Edu (the hub's folder).
# OFFLINE_DATA_PATH is also data.path's default (nsa.config.DataConfig), which train.py auto-prepares.
OFFLINE_DATA_PATH = "data/offline_python"
DEFAULT_OUT: dict[str, str] = {"local": OFFLINE_DATA_PATH, "hub": "data/fineweb_edu",
                               "jsonl": "data/jsonl_docs", "txt": "data/txt_docs"}
OFFLINE_MAX_BYTES = 30_000_000   # sized for the tiny CPU profile: ~30M byte tokens
OFFLINE_VAL_DOCS = 64
SHARD_BYTES = 8_000_000


def prepare_inputs(source: str, input_path: str | os.PathLike | None = None, *,
                   max_docs: int | None = None, max_bytes: int | None = OFFLINE_MAX_BYTES,
                   docs_per_shard: int | None = None, shard_bytes: int = SHARD_BYTES,
                   val_docs: int | None = OFFLINE_VAL_DOCS, val_fraction: float | None = None,
                   txt_split: str = "file", hub_name: str = "sample-10BT", seed: int | None = 0,
                   count_tokenizer: str = "byte") -> dict[str, Any]:
    """What decides the content of a prepared directory, recorded in its manifest as `inputs`: a re-run
    of prepare_data with equal inputs is a no-op. Only the options the source uses are kept, so e.g.
    --hub-name does not make a local corpus differ; the defaults are those of train.py's auto-prepare."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    inputs: dict[str, Any] = {"source": source}
    if input_path is not None:
        inputs["input"] = str(Path(input_path).expanduser().resolve())
    inputs.update(max_docs=max_docs, max_bytes=max_bytes, docs_per_shard=docs_per_shard,
                  shard_bytes=None if docs_per_shard is not None else shard_bytes,
                  val_docs=val_docs, val_fraction=val_fraction, count_tokenizer=count_tokenizer)
    inputs.update({"local": {"seed": seed}, "txt": {"txt_split": txt_split},
                   "hub": {"hub_name": hub_name}}.get(source, {}))
    return inputs


def _expand(path: str | os.PathLike, patterns: tuple[str, ...], what: str) -> list[Path]:
    """A file, or the sorted matching files of a directory; errors name the path and the fix."""
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted({f for pat in patterns for f in p.rglob(pat) if f.is_file()})
        if not files:
            raise FileNotFoundError(f"--input {str(p)!r}: directory has no {what} files "
                                    f"({', '.join(patterns)})")
        return files
    raise FileNotFoundError(f"--input {str(p)!r} does not exist; pass a {what} file or a "
                            f"directory of them")


def _open_text(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, "r", encoding="utf-8", errors="replace")


def iter_jsonl(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """One JSON object per line with a string `text`; other FineWeb columns are kept if present."""
    for file in _expand(path, ("*.jsonl", "*.jsonl.gz", "*.json"), "JSONL"):
        with _open_text(file) as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{file}:{lineno}: not valid JSON ({exc.msg}); JSONL needs one "
                                     f"object per line") from exc
                if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                    raise ValueError(f"{file}:{lineno}: each line needs a string field 'text' "
                                     f"(got {type(row).__name__} with keys "
                                     f"{sorted(row)[:8] if isinstance(row, dict) else '-'})")
                key = str(row.get("id") or f"{file.resolve()}:{lineno}")
                yield make_doc(row["text"], key=key, url=f"{file.resolve().as_uri()}#L{lineno}",
                               file_path=str(file.resolve()), dump="local-jsonl", extra=row)


def iter_txt(path: str | os.PathLike, split: str = "file") -> Iterator[dict[str, Any]]:
    """Plain text: one document per file (`split="file"`) or per blank-line-separated block."""
    if split not in ("file", "paragraph"):
        raise ValueError(f"txt split must be 'file' or 'paragraph', got {split!r}")
    for file in _expand(path, ("*.txt", "*.md", "*.rst", "*.txt.gz"), "text"):
        with _open_text(file) as fh:
            text = fh.read()
        blocks = [text] if split == "file" else re.split(r"\n[ \t]*\n", text)
        uri = file.resolve().as_uri()
        for i, block in enumerate(blocks):
            block = block.strip("\n") if split == "paragraph" else block
            if not block.strip():
                continue
            yield make_doc(block, key=f"{file.resolve()}#{i}", url=f"{uri}#{i}" if i else uri,
                           file_path=str(file.resolve()), dump="local-txt")


def _call_with_timeout(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """Run `fn` in a daemon thread; raise ConnectionError if it takes longer than `timeout_s`.

    A thread (not a signal) so it works off the main thread too; a stuck call is abandoned.
    """
    box: queue.Queue = queue.Queue(maxsize=1)

    def run() -> None:
        try:
            box.put((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box.put((False, exc))

    threading.Thread(target=run, name=f"nsa-hub-{what}", daemon=True).start()
    try:
        ok, value = box.get(timeout=timeout_s)
    except queue.Empty:
        raise ConnectionError(f"{what} did not finish within {timeout_s:.0f}s (no network or the "
                              f"hub is slow). {_OFFLINE_HINT}") from None
    if not ok:
        raise ConnectionError(f"{what} failed: {type(value).__name__}: {value}. "
                              f"{_OFFLINE_HINT}") from value
    return value


def probe_host(host: str, port: int = 443, timeout_s: float = 5.0) -> None:
    """Raise ConnectionError unless a TCP connection to host:port opens within `timeout_s`."""
    def connect() -> None:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass

    _call_with_timeout(connect, timeout_s + 1.0, f"connecting to {host}:{port}")


def iter_hub_fineweb(name: str = "sample-10BT", split: str = "train", timeout_s: float = 20.0,
                     host: str = "huggingface.co") -> Iterator[dict[str, Any]]:
    """Stream FineWeb-Edu rows from the hub; ConnectionError quickly when offline."""
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(f"--source hub needs the 'datasets' package (pip install datasets). "
                          f"{_OFFLINE_HINT}") from exc
    probe_host(host, 443, min(timeout_s, 5.0))
    ds = _call_with_timeout(
        lambda: datasets.load_dataset(HUB_DATASET, name=name, split=split, streaming=True),
        timeout_s, f"load_dataset({HUB_DATASET!r}, name={name!r})")
    it = iter(ds)
    first = _call_with_timeout(lambda: next(it, None), timeout_s, "reading the first hub row")
    return _hub_rows(first, it, name)


def _hub_rows(first: Any, it: Iterator[Any], name: str) -> Iterator[dict[str, Any]]:
    row = first
    while row is not None:
        text = row.get("text")
        if isinstance(text, str):
            key = str(row.get("id") or f"{HUB_DATASET}/{name}:{text[:64]}")
            yield make_doc(text, key=key, url=str(row.get("url") or f"hf://{HUB_DATASET}"),
                           file_path=str(row.get("file_path") or f"hf://datasets/{HUB_DATASET}"),
                           dump=str(row.get("dump") or name), extra=row)
        row = next(it, None)


def iter_source(source: str, input_path: str | os.PathLike | None = None, *,
                max_docs: int | None = None, max_bytes: int | None = None,
                txt_split: str = "file", hub_name: str = "sample-10BT",
                hub_timeout_s: float = 20.0, seed: int | None = 0,
                include_site_packages: bool = False) -> Iterator[dict[str, Any]]:
    """Dispatch on `source` (one of SOURCES) and apply the doc/byte caps."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    if source in ("jsonl", "txt") and input_path is None:
        raise ValueError(f"--source {source} needs --input PATH (a file or a directory)")
    if source == "local":
        root = input_path  # optional: any folder of text files instead of the stdlib
        return iter_local_corpus(root=root, max_docs=max_docs, max_bytes=max_bytes,
                                 shuffle_seed=seed, include_site_packages=include_site_packages)
    if source == "jsonl":
        docs: Iterator[dict[str, Any]] = iter_jsonl(input_path)  # type: ignore[arg-type]
    elif source == "txt":
        docs = iter_txt(input_path, split=txt_split)  # type: ignore[arg-type]
    else:
        docs = iter_hub_fineweb(name=hub_name, timeout_s=hub_timeout_s)
    return limit_docs(docs, max_docs=max_docs, max_bytes=max_bytes)


# ----------------------------------------------------------------------------------------------
# Parquet URLs for training without staging
# ----------------------------------------------------------------------------------------------

URL_SCHEMES: tuple[str, ...] = ("hf", "file")
DATA_PATH_FORMS = ("a local directory or .parquet file, file:///abs/<folder or glob>, or "
                   "hf://datasets/<org>/<name>/<folder or glob> (e.g. "
                   "hf://datasets/HuggingFaceFW/fineweb-edu/sample/10BT/*.parquet)")
# val-split file or folder names: `val-00000.parquet`, `validation_0.parquet`, `val/...` (also nsa.data.shards)
VAL_NAME = re.compile(r"^(val|valid|validation)([-_.]|$)", re.IGNORECASE)
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_GLOB_CHARS = "*?["
_STAGE_HINT = ("or stage the data offline: python pipelines/prepare_data.py --source hub --out DIR, "
               "then data.path=DIR")


def url_scheme(path: Any) -> str | None:
    """'hf', 'file', ... for `scheme://...`; None for a plain path."""
    m = _SCHEME.match(str(path))
    return m.group(1).lower() if m else None


def is_url(path: Any) -> bool:
    return url_scheme(path) is not None


def url_error(path: Any, field: str = "data.path") -> str | None:
    """One line naming `field` when `path` is a URL this project cannot read; None when it can."""
    scheme = url_scheme(path)
    if scheme is None:
        return None
    if scheme not in URL_SCHEMES:
        return f"{field}={str(path)!r}: unsupported scheme {scheme}://; use {DATA_PATH_FORMS}"
    rest = str(path)[len(scheme) + 3:]
    if scheme == "hf" and not rest.startswith("datasets/"):
        return (f"{field}={str(path)!r}: a hub path names a dataset's parquet files: "
                f"hf://datasets/<org>/<name>/<folder or glob>")
    if scheme == "file" and not rest.startswith("/"):
        return f"{field}={str(path)!r}: a file URL needs an absolute path: file:///abs/<folder or glob>"
    return None


def url_filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) for a supported URL; constructs, never lists."""
    err = url_error(url)
    if err is not None:
        raise ValueError(err)
    if url_scheme(url) == "hf":
        try:
            import huggingface_hub  # noqa: F401 - fsspec's "hf" protocol is its HfFileSystem
        except ImportError:
            raise ImportError(f"{url!r} needs the huggingface_hub package: pip install "
                              f"huggingface_hub (or pip install -e '.[data]'), {_STAGE_HINT}") from None
    from fsspec.core import url_to_fs

    # HfFileSystem takes its token from HF_TOKEN / `hf auth login` and honours HF_HUB_OFFLINE; the path
    # comes back normalized without the scheme (what the filesystem's listings return too)
    return url_to_fs(url)


def _rel_parts(path: str, root: str) -> tuple[str, ...]:
    rel = path[len(root):] if path.startswith(root) else path
    return tuple(part for part in rel.split("/") if part)


def _glob_root(path: str) -> str:
    """The folder a glob is relative to: its parts before the first one with a wildcard."""
    parts = path.split("/")
    head = next(i for i, part in enumerate(parts) if any(c in part for c in _GLOB_CHARS))
    return "/".join(parts[:head])


def list_parquet_url(url: str, split: str = "train") -> list[str]:
    """Sorted parquet URLs that `url` names, for `split` ("train" or "val").

    A file URL: itself (train), nothing (val). A folder (recursive) or a glob: its parquet files outside
    hidden folders; val-named ones (`val-*`, `validation_*`, under `val/`, relative to the folder or the
    glob's fixed prefix) form the val split, the rest the train split, as for a local directory.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    fs, path = url_filesystem(url)
    scheme = url_scheme(url)
    path = path.rstrip("/")
    try:
        if any(c in path for c in _GLOB_CHARS):
            root, found = _glob_root(path), fs.glob(path)
        elif fs.isfile(path):
            return [url] if split == "train" and path.endswith(".parquet") else []
        else:
            root, found = path, (fs.find(path) if fs.isdir(path) else [])
    except Exception as exc:   # noqa: BLE001 - network (httpx errors are no OSError), auth, offline mode
        first = (str(exc).splitlines() or [""])[0]
        raise ConnectionError(f"{url!r}: listing failed ({type(exc).__name__}: {first}); "
                              f"check the network, HF_TOKEN and HF_HUB_OFFLINE, {_STAGE_HINT}") from None
    out = []
    for f in sorted(str(x) for x in found):
        parts = _rel_parts(f, root)
        if not f.endswith(".parquet") or any(p.startswith(".") for p in parts):
            continue
        if any(VAL_NAME.match(p) for p in parts) == (split == "val"):
            out.append(f"{scheme}://{f}")
    return out


def parquet_schema(url: str) -> Any:
    """The arrow schema from one parquet URL's footer (a small ranged read)."""
    import pyarrow.parquet as pq

    fs, path = url_filesystem(url)
    with fs.open(path, "rb") as fh:
        return pq.ParquetFile(fh).schema_arrow


def check_parquet_url(url: str, split: str = "train") -> list[str]:
    """The listing of `url` (see list_parquet_url), checked: non-empty ("train") and the first file's
    footer has a string `text` column. Errors are one line naming the URL and the fix (the launcher
    prefixes the field: `data.path: 'hf://...' lists no ...`)."""
    files = list_parquet_url(url, split)
    if not files:
        if split == "val":
            return []
        raise FileNotFoundError(f"{url!r} lists no {split} parquet files; name a folder or a "
                                f"glob of .parquet files: {DATA_PATH_FORMS}")
    try:
        schema = parquet_schema(files[0])
    except Exception as exc:  # noqa: BLE001 - unreachable (httpx errors), or not a parquet file
        raise ValueError(f"{url!r}: cannot read the footer of {files[0]} "
                         f"({type(exc).__name__}: {(str(exc).splitlines() or [''])[0]})") from None
    text = schema.field("text").type if "text" in schema.names else None
    if str(text) not in ("string", "large_string", "string_view"):
        raise ValueError(f"{url!r}: {files[0]} has no string 'text' column (columns: "
                         f"{schema.names}); training reads FineWeb-Edu-shaped parquet")
    return files


def open_parquet(path: str | os.PathLike) -> Any:
    """pyarrow ParquetFile for a local path or a parquet URL (the handle lives as long as the file)."""
    import pyarrow.parquet as pq

    if not is_url(path):
        return pq.ParquetFile(path)
    fs, inner = url_filesystem(str(path))
    return pq.ParquetFile(fs.open(inner, "rb"))


def read_parquet_args(files: Sequence[str | os.PathLike]) -> tuple[list[str], Any]:
    """(paths, filesystem) for ray.data.read_parquet: local paths with filesystem None, or the paths
    inside one fsspec filesystem for URLs (Ray wraps an fsspec filesystem for pyarrow itself)."""
    names = [str(f) for f in files]
    schemes = {url_scheme(f) for f in names}
    if schemes == {None}:
        return names, None
    if len(schemes) != 1:
        raise ValueError(f"parquet files mix local paths and URLs ({sorted(map(str, schemes))}); "
                         f"give one kind")
    fs, _ = url_filesystem(names[0])
    return [url_filesystem(f)[1] for f in names], fs   # fsspec caches the instance: no new filesystems
