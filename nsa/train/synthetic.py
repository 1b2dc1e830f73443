"""Synthetic token rows (only when asked for: ``data.source=synthetic``), importable by Ray workers.

Ray Data pickles ``map_batches`` functions by reference, so they must live in an installed/shipped
package (``nsa``), not in an entry point's folder.
"""
from __future__ import annotations

from typing import Any

import numpy as np


def synthetic_rows(batch: dict[str, Any], seq_len: int, vocab: int, seed: int) -> dict[str, np.ndarray]:
    """Ray Data ``map_batches`` fn over ``ray.data.range``: {"id": [n]} -> {"input_ids": int64 [n, seq_len+1]}
    uniform random tokens, deterministic in (seed, first id of the batch)."""
    ids = batch["id"]
    rng = np.random.default_rng([seed, int(ids[0])])
    return {"input_ids": rng.integers(0, vocab, size=(len(ids), seq_len + 1), dtype=np.int64)}
