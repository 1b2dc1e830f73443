"""Document records with FineWeb-Edu's columns, shared by every source and the shard writer.

FineWeb-Edu rows: text, id, dump, url, file_path, language, language_score, token_count (GPT-2
tokens there), score (educational classifier, 0..5), int_score. Local sources fill the metadata
plausibly; `token_count` here is the UTF-8 byte count (= byte-tokenizer tokens, EOS excluded) unless
the source provides one, and `score` is a cheap prose heuristic, not the FineWeb-Edu classifier.
"""
from __future__ import annotations

import hashlib
import uuid
from typing import Any, Iterable, Iterator, Mapping

# (name, pyarrow type name) in FineWeb-Edu's order; the shard writer builds its schema from this.
FINEWEB_COLUMNS: tuple[tuple[str, str], ...] = (
    ("text", "string"),
    ("id", "string"),
    ("dump", "string"),
    ("url", "string"),
    ("file_path", "string"),
    ("language", "string"),
    ("language_score", "float64"),
    ("token_count", "int64"),
    ("score", "float64"),
    ("int_score", "int64"),
)
COLUMN_NAMES: tuple[str, ...] = tuple(c for c, _ in FINEWEB_COLUMNS)


def stable_uuid(key: str) -> str:
    """A FineWeb-style `<urn:uuid:...>` id that is a pure function of `key` (deterministic runs)."""
    return f"<urn:uuid:{uuid.UUID(bytes=hashlib.sha1(key.encode()).digest()[:16])}>"


def prose_score(text: str) -> float:
    """0..5 heuristic: share of letters and spaces (prose-like text scores higher than tables)."""
    if not text:
        return 0.0
    sample = text[:20000]
    letters = sum(ch.isalpha() or ch == " " for ch in sample)
    return round(5.0 * letters / len(sample), 3)


def make_doc(text: str, *, key: str, url: str, file_path: str, dump: str,
             extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Build one record; values in `extra` (e.g. a JSONL line's own metadata) win when typed right."""
    score = prose_score(text)
    doc: dict[str, Any] = {
        "text": text,
        "id": stable_uuid(key),
        "dump": dump,
        "url": url,
        "file_path": file_path,
        "language": "en",
        "language_score": 0.9,
        "token_count": len(text.encode("utf-8", errors="replace")),
        "score": score,
        "int_score": int(round(score)),
    }
    for name, typ in FINEWEB_COLUMNS[1:]:
        if extra is not None and name in extra and extra[name] is not None:
            doc[name] = _coerce(extra[name], typ, doc[name])
    return doc


def _coerce(value: Any, typ: str, default: Any) -> Any:
    try:
        if typ == "string":
            return str(value)
        if typ == "float64":
            return float(value)
        return int(value)
    except (TypeError, ValueError):
        return default


def limit_docs(docs: Iterable[dict[str, Any]], max_docs: int | None = None,
               max_bytes: int | None = None) -> Iterator[dict[str, Any]]:
    """Stop after `max_docs` documents or once `max_bytes` of UTF-8 text has been yielded.

    The byte cap is checked before a document is yielded, so the total never exceeds it; the
    stream ends at the first document that no longer fits (leading documents that are larger than
    the whole cap are skipped so that a small cap still yields something).
    """
    if max_docs is not None and max_docs < 0:
        raise ValueError(f"max_docs must be >= 0 or None, got {max_docs}")
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes}")
    n = total = 0
    for doc in docs:
        if max_docs is not None and n >= max_docs:
            return
        size = len(doc["text"].encode("utf-8", errors="replace"))
        if max_bytes is not None and total + size > max_bytes:
            if total == 0 and size > max_bytes:
                continue
            return
        n += 1
        total += size
        yield doc
