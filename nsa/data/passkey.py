"""Passkey training rows: the retrieval test of nsa/evaluation/core.py, in its exact format, mixed into training.

A share ``data.passkey_fraction`` of the training rows begins with passkey documents (core's prompt builder:
instructions, filler with a random 5-digit key planted at a random depth, the question and the key as answer),
each followed by EOS, then the rest of the text row they replace the head of; the other rows are the text stream's.
``data.passkey_mode``: ``one`` puts one document of seq_len/8..seq_len tokens at the row's start, every token
scored; ``packed`` fills the row with documents back to back (lengths log-uniform, so most are short and a row holds
several) and scores only the key's copies (the answer, and the repeat inside the needle): the filler is a fixed text
the model learns at once, and the few key digits it cannot guess are otherwise a sliver of the loss. A skipped
target is stored as ``~id`` (negative): the input is still ``id``, and nsa/train/step.py's ``split_batch`` turns
the target into cross-entropy's ignore index.

Why rows, not documents in the text stream: packing cuts the stream at fixed offsets (nsa/data/packing.py), so a
document of L tokens inserted there would straddle a row boundary about L / (seq_len + 1) of the time, and the
model would be asked for a key it never saw. A row that starts with the document keeps it whole (L <= seq_len)
and puts it at position 0, as the evaluation does.

Determinism and resume: whether a row is replaced and the document it gets depend only on (runtime.seed, epoch,
data stream rank, batch index in the epoch, row), all of which a DataPosition restores; the text stream's own
position is untouched (the displaced text tokens are simply not trained on), so a seek or a fast-forward resume
yields the uninterrupted run's rows, on any number of ranks that continue the same streams.
"""
from __future__ import annotations

import math
import random
from typing import Any, Iterator

import numpy as np

from nsa.evaluation.core import passkey_overhead, passkey_prompt, random_key

DIGITS = 5            # the evaluation's default --digits
MIN_SHARE = 8         # mode one: documents are seq_len // MIN_SHARE .. seq_len tokens long (at least the prompt)


def seq_len_error(seq_len: int, tok: Any) -> str | None:
    """One line naming train.seq_len when a passkey document cannot fit one row; None when it fits (checked
    before Ray starts, nsa/launch/preflight.py, and again where the rows are made)."""
    need = passkey_overhead(tok, DIGITS)
    if seq_len >= need:
        return None
    return (f"train.seq_len={seq_len} is shorter than a passkey document ({need} tokens with this tokenizer): "
            f"raise train.seq_len to >= {need} or set data.passkey_fraction=0")


def row_rng(seed: int, epoch: int, rank: int, batch: int, row: int) -> random.Random:
    """The one generator of a row's choices (string seeds hash with sha512: the same in every process)."""
    return random.Random(f"passkey/{seed}/{epoch}/{rank}/{batch}/{row}")


def passkey_doc(tok: Any, seq_len: int, rng: random.Random, digits: int = DIGITS) -> list[int]:
    """Ids of one passkey document, ending with its key: length uniform in [max(prompt, seq_len // MIN_SHARE),
    seq_len] tokens, depth uniform in [0, 1], a fresh ``digits``-digit key."""
    lo = max(passkey_overhead(tok, digits), seq_len // MIN_SHARE)
    length, depth, key = rng.randint(lo, seq_len), rng.random(), random_key(rng, digits)
    return passkey_prompt(tok, length, depth, key)[0]


def scored_doc(tok: Any, length: int, rng: random.Random, digits: int = DIGITS) -> np.ndarray:
    """One passkey document stored for packed mode, int64 [length]: ``~id`` everywhere but the answer and the key's
    repeat inside the needle ("{key}. Remember it. {key} is": a copy from a few tokens back, found where the
    tokenizer spells the key alike); the planted key itself is random, nothing to learn."""
    key = random_key(rng, digits)
    ids, start = passkey_prompt(tok, length, rng.random(), key)
    arr, k = np.asarray(ids, dtype=np.int64), np.asarray(tok.encode(key), dtype=np.int64)
    hits = np.flatnonzero((np.lib.stride_tricks.sliding_window_view(arr[:start], len(k)) == k).all(axis=1))
    keep = np.zeros(len(arr), dtype=bool)
    keep[start:] = True
    for h in hits[1:]:                                   # the plant's repeats (one with the byte tokenizer)
        keep[h:h + len(k)] = True
    return np.where(keep, arr, ~arr)


def packed_docs(tok: Any, seq_len: int, rng: random.Random, digits: int = DIGITS) -> np.ndarray:
    """Passkey documents back to back, each followed by EOS (stored ``~eos``), int64 [<= seq_len + 1]. Lengths
    log-uniform in [prompt, room left]: a 32k row holds a handful, most of them short."""
    lo, parts, used = passkey_overhead(tok, digits), [], 0
    while seq_len - used >= lo:                          # a document of L tokens and its EOS fit: L <= room
        length = int(round(math.exp(rng.uniform(math.log(lo), math.log(seq_len - used)))))
        parts += [scored_doc(tok, length, rng, digits), np.array([~tok.eos_id], dtype=np.int64)]
        used += length + 1
    return np.concatenate(parts)


def mix_rows(batch: np.ndarray, tok: Any, fraction: float, *, seed: int, epoch: int, rank: int,
             index: int, mode: str = "one") -> np.ndarray:
    """Batch ``index`` of an epoch, int64 [B, seq_len+1], with each row picked (probability ``fraction``) starting
    with passkey documents (``mode``, above) and EOS; a copy when a row changed, else ``batch`` itself."""
    seq_len = batch.shape[1] - 1
    out = batch
    for r in range(batch.shape[0]):                      # per row: a handful of documents per batch
        rng = row_rng(seed, epoch, rank, index, r)
        if rng.random() >= fraction:
            continue
        ids = packed_docs(tok, seq_len, rng) if mode == "packed" else passkey_doc(tok, seq_len, rng) + [tok.eos_id]
        if out is batch:
            out = batch.copy()
        out[r, :len(ids)] = ids
    return out


class PasskeyEpoch:
    """One data stream's epoch (nsa.data.position.RankEpoch) with passkey rows mixed in; same ``position()``."""

    def __init__(self, inner: Any, tok: Any, fraction: float, seed: int, rank: int, mode: str = "one") -> None:
        self.inner, self.tok, self.fraction, self.seed, self.rank, self.mode = inner, tok, fraction, seed, rank, mode

    def __iter__(self) -> Iterator[np.ndarray]:
        for b in self.inner:          # inner.batches counts this batch already: 1-based, restored on resume
            yield mix_rows(b, self.tok, self.fraction, seed=self.seed, epoch=self.inner.epoch, rank=self.rank,
                           index=self.inner.batches, mode=self.mode)

    def position(self) -> Any:
        return self.inner.position()


def with_passkey(epoch: Any, cfg: Any, tok: Any, rank: int) -> Any:
    """``epoch`` itself when data.passkey_fraction is 0, else its batches with passkey rows (``rank``: the data
    stream's, so every reader of one stream, a CP group or a resume on fewer ranks, mixes the same rows)."""
    fraction = cfg.data.passkey_fraction
    if fraction <= 0:
        return epoch
    err = seq_len_error(cfg.train.seq_len, tok)
    if err:
        from nsa.config import ConfigError
        raise ConfigError(err)
    return PasskeyEpoch(epoch, tok, fraction, cfg.runtime.seed, rank, cfg.data.passkey_mode)
