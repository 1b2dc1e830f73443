"""What a trained TinyLM (NSA or its dense twin) is worth: held-out bits per byte and passkey retrieval.

Bits per byte: the val split (never trained on) as one token stream (documents joined by EOS, as packing
does), cut into non-overlapping windows of ``length + 1`` tokens; every position of a window is scored
and the sum of its cross-entropy (nats) over ln 2 is divided by the UTF-8 bytes its targets stand for
(an EOS counts one byte). Bytes, not tokens, so a byte-level and a GPT-2 model compare on one scale.

Passkey (Mohtashami & Jaggi's test, the one the NSA paper reports at 64k): a random ``digits``-digit key
planted at ``depth`` (0 = right after the instructions, 1 = just before the question) of repeated filler,
asked for at the end. A trial counts when the greedy continuation is exactly the key; scored in one forward
pass (argmax at every answer position given the true prefix, which is what greedy decoding would emit).
The prompt builder is public so a training recipe can teach exactly this format.

Long windows never materialise [B, T, vocab] logits: the head runs over chunks of positions.
"""
from __future__ import annotations

import hashlib
import math
import random
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

LN2 = math.log(2.0)
HEAD_CHUNK = 4096          # positions per lm_head call: bounds the logits buffer at any length

PREFIX = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
          "I will quiz you about the important information there.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "What is the pass key? The pass key is "


# ------------------------------------------------------------------------------------------ memory
def activation_bytes_per_position(model_cfg: Any, dtype: torch.dtype) -> int:
    """One block's working set per position in a no-grad forward (residual, norms, q/k/v/o, SwiGLU),
    errs high like limits.decode_budget; the head's logits are bounded separately by HEAD_CHUNK."""
    elem = torch.empty((), dtype=dtype).element_size()
    m = model_cfg
    return elem * (int(m.dim * (4 + 3 * m.ffn_mult)) + 3 * m.n_heads * (m.d_k + m.d_v))


def forward_budget(model_cfg: Any, batch: int, length: int, device: torch.device, dtype: torch.dtype, *,
                   flag: str, free: Optional[int] = None) -> int:
    """Bytes a scoring forward of ``batch`` x ``length`` tokens needs (the KV estimate of generate's
    decode_budget plus one block's activations and a head chunk); ValueError naming ``flag`` and the
    longest length that fits when it exceeds limits.SAFETY x the device's free memory."""
    from nsa.train.limits import SAFETY, bytes_per_position, free_memory
    per = bytes_per_position(model_cfg, dtype) + activation_bytes_per_position(model_cfg, dtype)
    fixed = 2 * HEAD_CHUNK * model_cfg.vocab * 4
    need = per * batch * length + fixed
    free = free_memory(device) if free is None else free
    if free is not None and need > SAFETY * free:
        fits = max(0, (int(SAFETY * free) - fixed) // (per * batch))
        raise ValueError(f"{flag}: length {length} (batch {batch}) needs about {need / 2**30:.1f} GiB on {device}, "
                         f"more than half of its {free / 2**30:.1f} GiB free: use lengths <= {fits}"
                         + (" or --batch-size 1" if batch > 1 else ""))
    return need


# ------------------------------------------------------------------------------------------ model
def build_model(config: Mapping[str, Any], weights: Mapping[str, torch.Tensor], device: Any = "cpu",
                dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """An eval-mode TinyLM from a checkpoint's stored config dict and model state dict."""
    from nsa.config import config_from_dict
    from nsa.model import TinyLM
    cfg = config_from_dict(dict(config))
    model = TinyLM.from_config(cfg.model, cfg.nsa, grad_checkpointing=False)
    model.load_state_dict(weights, strict=True)
    return model.to(device=device, dtype=dtype).eval()


def hidden_states(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """TinyLM.forward without the head: [B, T] -> final-norm states [B, T, dim]."""
    x = model.embed(ids)
    for blk in model.blocks:
        x = blk(x)
    return model.norm(x)


# ------------------------------------------------------------------------------------------ val data
def iter_val_texts(files: Sequence[str]) -> Iterator[list[str]]:
    """The ``text`` column of each row group of the val files, in order."""
    from nsa.data.sources import open_parquet
    for f in files:
        pf = open_parquet(f)
        for rg in range(pf.num_row_groups):
            yield [t for t in pf.read_row_group(rg, columns=["text"]).column("text").to_pylist() if t]


def val_stream(files: Sequence[str], tok: Any, max_tokens: int) -> np.ndarray:
    """Up to ``max_tokens`` tokens of the val split, documents joined by EOS (nsa.data.packing's layout)."""
    parts, n = [], 0
    for texts in iter_val_texts(files):
        if texts:
            arr = np.asarray(tok.encode_stream(texts), dtype=np.int64)
            parts.append(arr)
            n += arr.size
        if n >= max_tokens:
            break
    return np.concatenate(parts)[:max_tokens] if parts else np.zeros(0, dtype=np.int64)


def val_fingerprint(files: Sequence[str]) -> str:
    """sha256 over the val files' contents: two evaluations compare only on the same held-out bytes."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda p: Path(p).name):
        h.update(Path(f).name.encode())
        if "://" in str(f):        # a URL: its name stands for it (no download just to hash)
            continue
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def target_bytes(tok: Any, targets: np.ndarray) -> int:
    """UTF-8 bytes the target tokens stand for (EOS = 1 byte, the document boundary)."""
    eos = targets == tok.eos_id
    if getattr(tok, "name", "") == "byte":
        return int(targets.size)
    text = tok.decode(targets[~eos].tolist())
    return len(text.encode("utf-8")) + int(eos.sum())


@torch.no_grad()
def bits_per_byte(model: torch.nn.Module, stream: np.ndarray, tok: Any, length: int, *, max_tokens: int,
                  batch_size: int = 1) -> dict[str, Any]:
    """Held-out bits per byte over windows of ``length`` tokens (at most ``max_tokens`` scored tokens,
    at least one window); ValueError naming --lengths when the val split is shorter than one window."""
    n_win = min(stream.size // (length + 1), max(1, max_tokens // length))
    if n_win < 1:
        raise ValueError(f"--lengths: {length} needs {length + 1} val tokens, the val split has {stream.size}: "
                         f"use lengths <= {max(0, stream.size - 1)} or a larger val split (data.val_path)")
    rows = stream[: n_win * (length + 1)].reshape(n_win, length + 1)
    device = next(model.parameters()).device
    nats, nbytes = 0.0, 0
    for i in range(0, n_win, batch_size):
        chunk = torch.from_numpy(rows[i:i + batch_size]).to(device)
        h = hidden_states(model, chunk[:, :-1]).flatten(0, 1)
        y = chunk[:, 1:].flatten()
        for j in range(0, y.numel(), HEAD_CHUNK):
            logits = model.lm_head(h[j:j + HEAD_CHUNK]).float()
            nats += float(F.cross_entropy(logits, y[j:j + HEAD_CHUNK], reduction="sum"))
        nbytes += target_bytes(tok, rows[i:i + batch_size, 1:].reshape(-1))
    return {"length": length, "bpb": nats / LN2 / nbytes, "loss": nats / (n_win * length),
            "tokens": n_win * length, "bytes": nbytes, "windows": n_win}


# ------------------------------------------------------------------------------------------ passkey
def passkey_overhead(tok: Any, digits: int = 5) -> int:
    """Tokens of a passkey prompt without filler: the shortest length the test can take."""
    key = "9" * digits
    return sum(len(tok.encode(s)) for s in (PREFIX, NEEDLE.format(key=key), QUESTION, key))


def passkey_prompt(tok: Any, length: int, depth: float, key: str) -> tuple[list[int], int]:
    """(ids of exactly ``length`` tokens ending with the key, index where the key starts). The needle goes
    in at the filler sentence boundary nearest ``depth`` x the filler (0: first, 1: last before the question)."""
    pre, needle, q, ans = (tok.encode(s) for s in (PREFIX, NEEDLE.format(key=key), QUESTION, key))
    n_fill = length - len(pre) - len(needle) - len(q) - len(ans)
    if n_fill < 0:
        raise ValueError(f"--passkey-lengths: {length} is shorter than the passkey prompt itself "
                         f"({length - n_fill} tokens with this tokenizer): use lengths >= {length - n_fill}")
    unit = tok.encode(FILLER)
    filler = (unit * (n_fill // len(unit) + 1))[:n_fill]
    cut = min(n_fill, int(round(depth * n_fill / len(unit))) * len(unit))
    ids = pre + filler[:cut] + needle + filler[cut:] + q + ans
    return ids, len(ids) - len(ans)


def random_key(rng: random.Random, digits: int) -> str:
    return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))


@torch.no_grad()
def passkey_cell(model: torch.nn.Module, tok: Any, length: int, depth: float, *, trials: int, seed: int,
                 digits: int = 5, batch_size: int = 1) -> dict[str, Any]:
    """Accuracy over ``trials`` keys at one (length, depth); the keys depend only on (seed, length, depth)."""
    rng = random.Random(f"{seed}/{length}/{depth}")
    samples = [passkey_prompt(tok, length, depth, random_key(rng, digits)) for _ in range(trials)]
    device = next(model.parameters()).device
    exact, digit_hits, digit_total = 0, 0, 0
    for i in range(0, trials, batch_size):
        part = samples[i:i + batch_size]
        ids = torch.tensor([s[0] for s in part], dtype=torch.long, device=device)
        h = hidden_states(model, ids[:, :-1])
        for b, (row, start) in enumerate(part):
            pred = model.lm_head(h[b, start - 1:]).argmax(-1).tolist()     # position p predicts token p+1
            want = row[start:]
            hits = sum(int(p == w) for p, w in zip(pred, want))
            exact += int(hits == len(want))
            digit_hits, digit_total = digit_hits + hits, digit_total + len(want)
    return {"length": length, "depth": depth, "trials": trials, "correct": exact,
            "accuracy": exact / trials, "token_accuracy": digit_hits / max(1, digit_total)}


def passkey_table(cells: Sequence[Mapping[str, Any]]) -> str:
    """Markdown table: one row per depth, one column per length, accuracy in percent; then the mean, and the key's
    digits right (chance 10%): a model part way to retrieving shows here while every exact cell is still 0%."""
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    acc = {(c["length"], c["depth"]): c["accuracy"] for c in cells}
    lines = ["| depth \\ length | " + " | ".join(str(n) for n in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for d in depths:
        lines.append(f"| {d:g} | " + " | ".join(f"{100 * acc[(n, d)]:.0f}%" for n in lengths) + " |")
    for label, field in (("mean", "accuracy"), ("digits right", "token_accuracy")):   # means over depths
        by = {(c["length"], c["depth"]): c[field] for c in cells}
        lines.append(f"| {label} | " + " | ".join(
            f"{100 * sum(by[(n, d)] for d in depths) / len(depths):.0f}%" for n in lengths) + " |")
    return "\n".join(lines)


def plot_passkey(cells: Sequence[Mapping[str, Any]], out_png: str | Path, *, title: str) -> Path:
    """Heat map of accuracy (rows: depth, columns: length), each cell annotated; matplotlib OO, no display."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    acc = {(c["length"], c["depth"]): c["accuracy"] for c in cells}
    grid = np.array([[acc[(n, d)] for n in lengths] for d in depths])
    fig = Figure(figsize=(max(4.5, 1.5 + 0.9 * len(lengths)), 1.5 + 0.5 * len(depths)), tight_layout=True)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("key depth")
    for r in range(len(depths)):
        for c in range(len(lengths)):
            ax.text(c, r, f"{100 * grid[r, c]:.0f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax, label="passkey accuracy")
    ax.set_title(title, fontsize=9)
    out = Path(out_png)
    fig.savefig(out, dpi=100)
    return out
