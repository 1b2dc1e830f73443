"""An offline real-text corpus available on every machine: the Python installation's own files.

The standard library (sysconfig's `stdlib` path) holds ~30 MB of UTF-8 text: module sources with
their docstrings and comments, `pydoc_data/topics.py` (the language reference as prose), test
fixtures such as e-mail messages, a few .txt/.rst/.html documents. Optionally the installed
packages' READMEs/METADATA (long descriptions in Markdown/reST) from site-packages are added.

Order is deterministic: paths are sorted and then shuffled with a fixed seed, so a byte or doc cap
takes a spread over the whole library (not just modules starting with "_a") and the first documents
make a representative held-out set. Each document is one file, as a FineWeb-Edu-shaped record
(see nsa.data.docs).
"""
from __future__ import annotations

import html
import os
import platform
import random
import re
import sysconfig
from pathlib import Path
from typing import Any, Iterator, Sequence

from nsa.data.docs import limit_docs, make_doc

DEFAULT_EXTENSIONS: tuple[str, ...] = (".py", ".txt", ".rst", ".html")
# Folders that are not the standard library's text (or that hold generated/binary payloads).
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__",
                        "lib-dynload", "ensurepip"})
_DOC_NAME = re.compile(r"^(README|LICENSE|COPYING|CHANGES|CHANGELOG|HISTORY|NEWS|AUTHORS)"
                       r"(\.(md|rst|txt))?$", re.IGNORECASE)
_TAG = re.compile(r"<(script|style)\b.*?</\1>|<[^>]+>", re.IGNORECASE | re.DOTALL)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def site_packages_root() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def _stdlib_files(root: Path, extensions: Sequence[str], include_tests: bool) -> list[Path]:
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        # Prune in place (os.walk honours it) and keep the walk order stable.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")
                             and not d.startswith("config-")
                             and (include_tests or not (rel == Path(".") and d in ("test", "tests"))))
        out.extend(Path(dirpath) / f for f in filenames if f.endswith(tuple(extensions)))
    return sorted(out)


def _site_doc_files(root: Path) -> list[Path]:
    """READMEs/LICENSEs at a package's top level and the METADATA of each installed distribution."""
    out: list[Path] = []
    if not root.is_dir():
        return out
    for entry in sorted(root.iterdir()):
        if not entry.is_dir():
            continue
        if entry.name.endswith(".dist-info"):
            if (entry / "METADATA").is_file():
                out.append(entry / "METADATA")
            continue
        out.extend(sorted(f for f in entry.iterdir() if f.is_file() and _DOC_NAME.match(f.name)))
    return out


def _read_text(path: Path, max_file_bytes: int) -> str | None:
    """UTF-8 text of a file, or None for files that are too big, unreadable or not UTF-8."""
    try:
        if path.stat().st_size > max_file_bytes:
            return None
        raw = path.read_bytes()
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if "\x00" in text:  # binary payloads disguised as text
        return None
    if path.suffix == ".html":
        text = html.unescape(_TAG.sub(" ", text))
        text = re.sub(r"[ \t]+", " ", re.sub(r"\n\s*\n+", "\n\n", text)).strip()
    return text


def list_local_files(*, root: str | os.PathLike | None = None,
                     extensions: Sequence[str] = DEFAULT_EXTENSIONS, include_tests: bool = True,
                     include_site_packages: bool = False,
                     shuffle_seed: int | None = 0) -> list[Path]:
    """The corpus's file list in iteration order (sorted, then shuffled by `shuffle_seed`)."""
    base = Path(root) if root is not None else stdlib_root()
    if not base.is_dir():
        raise FileNotFoundError(f"local corpus root {str(base)!r} is not a directory; pass root= "
                                f"a folder with text files (default: the Python stdlib)")
    files = _stdlib_files(base, extensions, include_tests)
    if include_site_packages:
        files += _site_doc_files(site_packages_root())
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(files)
    return files


def iter_local_corpus(*, root: str | os.PathLike | None = None,
                      extensions: Sequence[str] = DEFAULT_EXTENSIONS, include_tests: bool = True,
                      include_site_packages: bool = False, max_docs: int | None = None,
                      max_bytes: int | None = None, min_chars: int = 64,
                      max_file_bytes: int = 2_000_000,
                      shuffle_seed: int | None = 0) -> Iterator[dict[str, Any]]:
    """Yield FineWeb-Edu-shaped records, one per text file of the Python installation.

    Files shorter than `min_chars`, larger than `max_file_bytes`, or not valid UTF-8 are skipped.
    `max_docs` / `max_bytes` cap the output (see nsa.data.docs.limit_docs).
    """
    if min_chars < 0 or max_file_bytes <= 0:
        raise ValueError(f"min_chars must be >= 0 and max_file_bytes > 0, got {min_chars}, "
                         f"{max_file_bytes}")
    files = list_local_files(root=root, extensions=extensions, include_tests=include_tests,
                             include_site_packages=include_site_packages, shuffle_seed=shuffle_seed)
    dump = f"local-python-{platform.python_version()}"

    def gen() -> Iterator[dict[str, Any]]:
        for path in files:
            text = _read_text(path, max_file_bytes)
            if text is None or len(text.strip()) < min_chars:
                continue
            absolute = path.resolve()
            yield make_doc(text, key=f"{dump}:{absolute}", url=absolute.as_uri(),
                           file_path=str(absolute), dump=dump)

    return limit_docs(gen(), max_docs=max_docs, max_bytes=max_bytes)
