"""Document sources for prepare_data: local corpus, JSONL, TXT, and FineWeb-Edu from the HF hub.

All yield FineWeb-Edu-shaped records (nsa.data.docs). The hub source streams
`HuggingFaceFW/fineweb-edu` (config `sample-10BT`) through `datasets` and fails fast when the network
is unavailable: a TCP probe of the hub host, then `load_dataset` and the first row each under
`timeout_s` (the old stack's `--loader-timeout`), with an error that suggests `--source local`.
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
from typing import Any, Callable, Iterator, TypeVar

from nsa.data.docs import limit_docs, make_doc
from nsa.data.local_corpus import iter_local_corpus

SOURCES: tuple[str, ...] = ("local", "jsonl", "txt", "hub")
HUB_DATASET = "HuggingFaceFW/fineweb-edu"
T = TypeVar("T")

_OFFLINE_HINT = ("Use the offline corpus instead: python pipelines/prepare_data.py --source local "
                 "(or --source jsonl/txt --input <local files>).")


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
