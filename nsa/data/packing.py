"""Document packing: tokenized documents -> fixed-length training rows.

Layout: every document is followed by one EOS, documents are concatenated in order, and the stream
is cut into non-overlapping rows of `seq_len + 1` tokens (inputs `row[:-1]`, targets `row[1:]`).
The tail that does not fill a row is dropped (stateless `pack_documents` / `tokenize_and_pack`) or
carried into the next call (`StreamPacker`, used by the plain iterator).

Documents longer than a row simply continue in the next row; attention is not masked at document
boundaries (the EOS token marks them), as in nanoGPT-style pretraining.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np


def _check_seq_len(seq_len: int) -> None:
    if not isinstance(seq_len, (int, np.integer)) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")


def concat_with_eos(token_lists: Sequence[Sequence[int]], eos_id: int) -> np.ndarray:
    """[doc0..., eos, doc1..., eos, ...] as int64 [sum(len_i) + n_docs]."""
    n_docs = len(token_lists)
    if n_docs == 0:
        return np.zeros(0, dtype=np.int64)
    docs = [np.asarray(t, dtype=np.int64).reshape(-1) for t in token_lists]  # per-doc, not per-token
    lengths = np.fromiter((d.size for d in docs), dtype=np.int64, count=n_docs)  # [n_docs]
    flat = np.concatenate(docs) if lengths.sum() else np.zeros(0, dtype=np.int64)
    out = np.full(int(lengths.sum()) + n_docs, eos_id, dtype=np.int64)
    # Token j of the stream belongs to doc k = repeat(arange, lengths)[j]; every earlier doc added
    # one EOS, so it lands at j + k.
    out[np.arange(flat.size) + np.repeat(np.arange(n_docs), lengths)] = flat
    return out


def stream_to_rows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Cut a 1-D token stream into [n, seq_len+1] rows, dropping the incomplete tail."""
    _check_seq_len(seq_len)
    row = seq_len + 1
    n = stream.size // row
    return np.ascontiguousarray(stream[: n * row].reshape(n, row), dtype=np.int64)


def pack_documents(token_lists: Sequence[Sequence[int]], seq_len: int, eos_id: int) -> np.ndarray:
    """EOS after each document, concatenate, cut into int64 [n, seq_len+1], drop the remainder."""
    _check_seq_len(seq_len)
    return stream_to_rows(concat_with_eos(token_lists, eos_id), seq_len)


def encode_stream(tokenizer: Any, texts: Sequence[str]) -> np.ndarray:
    """Tokenize + concatenate with EOS; uses the tokenizer's fast path when it has one."""
    if hasattr(tokenizer, "encode_stream"):
        return np.asarray(tokenizer.encode_stream(texts), dtype=np.int64)
    return concat_with_eos(tokenizer.encode_batch(list(texts)), tokenizer.eos_id)


def _texts_of(batch: Mapping[str, Any]) -> list[str]:
    if "text" not in batch:
        raise ValueError(f"tokenize_and_pack: batch has no 'text' column (columns: "
                         f"{sorted(batch)}); read the parquet files with columns=['text']")
    col = batch["text"]
    # Ray hands a numpy object array; nulls (None) are skipped rather than packed as "None".
    return [t if isinstance(t, str) else t.decode("utf-8", "replace") if isinstance(t, bytes)
            else "" for t in col if t is not None]


def tokenize_and_pack(batch: Mapping[str, Any], tokenizer: Any, seq_len: int) -> dict[str, np.ndarray]:
    """Ray Data `map_batches` function (batch_format="numpy").

    {"text": [n_docs] str} -> {"input_ids": int64 [n_rows, seq_len+1]}; n_rows may be 0 when the
    batch holds fewer than seq_len+1 tokens (the tail of each batch is dropped).
    """
    _check_seq_len(seq_len)
    stream = encode_stream(tokenizer, _texts_of(batch))
    return {"input_ids": stream_to_rows(stream, seq_len)}


class StreamPacker:
    """Stateful packer that carries the incomplete tail into the next `push` (no tokens lost)."""

    def __init__(self, seq_len: int) -> None:
        _check_seq_len(seq_len)
        self.seq_len = seq_len
        self._tail = np.zeros(0, dtype=np.int64)

    @property
    def pending_tokens(self) -> int:
        return int(self._tail.size)

    def push(self, stream: np.ndarray) -> np.ndarray:
        """Append a token stream; return the complete rows [n, seq_len+1] now available."""
        buf = np.concatenate([self._tail, np.asarray(stream, dtype=np.int64).reshape(-1)])
        rows = stream_to_rows(buf, self.seq_len)
        self._tail = buf[rows.size:].copy()
        return rows
