"""Document packing: tokenized documents -> fixed-length training rows.

Layout: every document is followed by one EOS, documents are concatenated in order, and the stream
is cut into non-overlapping rows of `seq_len + 1` tokens (inputs `row[:-1]`, targets `row[1:]`).
The tail that does not fill a row is dropped (stateless `pack_documents` / `tokenize_and_pack`) or
carried into the next call (`StreamPacker`, used by the plain iterator).

Documents longer than a row simply continue in the next row; attention is not masked at document
boundaries (the EOS token marks them), as in nanoGPT-style pretraining.
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

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


def doc_ends(stream: np.ndarray, valid: np.ndarray, eos_id: int) -> np.ndarray:
    """Token end (exclusive, EOS included) of each input row in `stream`, int64 [n_rows].

    `valid` [n_rows] bool marks the rows that were tokenized (null texts add no tokens and no EOS, so
    their end equals the previous row's). Needs a tokenizer that never emits `eos_id` inside a text
    (both built-in tokenizers guarantee it), so the EOS positions are the document boundaries.
    """
    eos_at = np.flatnonzero(stream == eos_id) + 1                        # [n_valid]
    if eos_at.size != int(valid.sum()):
        raise ValueError(f"tokenizer emitted {eos_at.size} EOS tokens for {int(valid.sum())} documents: "
                         "its eos_id must appear only between documents")
    ends = np.zeros(valid.size, dtype=np.int64)
    ends[valid] = eos_at
    return np.maximum.accumulate(ends) if ends.size else ends


class SeekPacker:
    """One rank's packer over tokenized read units, with the position after every batch it yields.

    A unit (one row group's documents [lo, hi), see nsa.data.position) arrives as its token stream and
    the per-document ends (`doc_ends`). Batches are consecutive [batch_size, seq_len+1] slices of the
    concatenated stream, exactly as `StreamPacker` + batching cut it. `position()` says where the
    stream stands after the last yielded batch: the unit's row group, `offset` = the first document not
    yet read into the packer, and `carry` = the tokens read but not yet yielded (at most the rest of
    the one document the batch ended in). A packer built from that carry and fed the same row group
    from `offset` on yields the same batches as the uninterrupted one.
    """

    def __init__(self, seq_len: int, batch_size: int, *, anchor: tuple[int, int, int] = (-1, 0, 0),
                 carry: np.ndarray | None = None) -> None:
        _check_seq_len(seq_len)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size, self.row = batch_size, seq_len + 1
        self._need = batch_size * self.row                               # tokens per batch
        self._buf = np.zeros(0, np.int64) if carry is None else np.asarray(carry, np.int64).reshape(-1)
        self._pos = 0                                                    # tokens of _buf yielded
        self._anchor = anchor          # (shard, row_group, offset) the carry precedes (before any feed)
        self._unit: Any = None         # last unit fed: .shard .row_group .lo .hi
        self._unit_start = 0           # where its tokens begin in _buf
        self._ends = np.zeros(0, np.int64)

    def drain(self) -> Iterator[np.ndarray]:
        """The batches the buffer already holds (a restored carry may span several)."""
        while self._buf.size - self._pos >= self._need:
            b = self._buf[self._pos:self._pos + self._need].reshape(self.batch_size, self.row)
            self._pos += self._need
            yield b

    def feed(self, unit: Any, tokens: np.ndarray, ends: np.ndarray) -> Iterator[np.ndarray]:
        """Append one unit's tokens [n] (+ its doc ends [hi-lo]) and yield the batches now complete."""
        rest = self._buf[self._pos:]
        self._buf = np.concatenate([rest, np.asarray(tokens, np.int64).reshape(-1)])
        self._pos, self._unit_start = 0, rest.size
        self._unit, self._ends = unit, np.asarray(ends, np.int64)
        yield from self.drain()

    def position(self) -> tuple[int, int, int, np.ndarray]:
        """(shard, row_group, offset, carry int64 [k]) after the last yielded batch (see class doc)."""
        u = self._unit
        if u is None:                                # nothing fed since the (re)start
            return (*self._anchor, self._buf[self._pos:].copy())
        c = self._pos - self._unit_start             # tokens of this unit already yielded
        if c <= 0:                                   # the batch ended inside older carry
            return u.shard, u.row_group, u.lo, self._buf[self._pos:self._unit_start].copy()
        j = int(np.searchsorted(self._ends, c, side="right"))           # documents fully yielded
        done = int(self._ends[j - 1]) if j else 0
        if j == self._ends.size or c == done:       # on a document boundary: nothing to carry
            return u.shard, u.row_group, u.lo + j, np.zeros(0, np.int64)
        end = self._unit_start + int(self._ends[j])
        return u.shard, u.row_group, u.lo + j + 1, self._buf[self._pos:end].copy()
