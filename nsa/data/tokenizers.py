"""Tokenizers: a dependency-free byte tokenizer and GPT-2 BPE from a *local* tiktoken file.

Both expose the same small surface (`Tokenizer` protocol): `.name`, `.vocab_size`, `.eos_id`,
`.encode(str) -> list[int]`, `.encode_batch(list[str]) -> list[list[int]]`, `.decode(list[int]) -> str`
and `.encode_stream(texts) -> np.ndarray` (all documents concatenated, `eos_id` after each one), the
fast path used by packing.

GPT-2 without network: `tiktoken.get_encoding("gpt2")` downloads `vocab.bpe` + `encoder.json` (or
`r50k_base.tiktoken`, the same 50,256 ranks) on first use and caches them under a file named
`sha1(url)` in `$TIKTOKEN_CACHE_DIR`. Here the caller passes the location instead (this module reads
no environment variables): either a `.tiktoken` file (lines `base64(token) rank`) or a directory
holding `gpt2.tiktoken` / `r50k_base.tiktoken`, the pair `vocab.bpe` + `encoder.json`, or a tiktoken
cache directory with the `sha1(url)` names.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Protocol, Sequence, runtime_checkable

import numpy as np

from nsa.data.packing import concat_with_eos

_R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
_VOCAB_BPE_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe"
_ENCODER_JSON_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json"
# sha256 of the official r50k_base.tiktoken (what tiktoken itself checks after a download).
_R50K_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
_ENDOFTEXT = "<|endoftext|>"
# GPT-2's pre-tokenizer split (same regex as tiktoken's r50k family); used only if the constant
# cannot be imported from tiktoken_ext.
_GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""

GPT2_HELP = (
    "The gpt2 tokenizer needs its BPE file locally (tiktoken would download it; this machine may "
    "have no network). Provide it with tiktoken_path=<file or dir> (CLI/config: data.tiktoken_path): "
    "a 'gpt2.tiktoken' / 'r50k_base.tiktoken' file, a directory holding one of those or "
    "'vocab.bpe' + 'encoder.json', or a TIKTOKEN_CACHE_DIR filled on a machine with network "
    "(python -c \"import tiktoken; tiktoken.get_encoding('gpt2')\" with TIKTOKEN_CACHE_DIR set, then "
    f"copy the directory; or download {_R50K_URL}). Or use tokenizer 'byte', which needs no files."
)


@runtime_checkable
class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_stream(self, texts: Iterable[str]) -> np.ndarray: ...


class ByteTokenizer:
    """ids 0..255 are the UTF-8 bytes of the text; NUL (0) doubles as end-of-document.

    NUL bytes inside a text are dropped on encode so that 0 only ever means EOS; `decode` is
    therefore the exact inverse of `encode` for any text without NULs. Decoding invalid UTF-8
    (a model's random bytes) uses U+FFFD replacement instead of raising.
    """

    name = "byte"
    vocab_size = 256
    eos_id = 0

    @staticmethod
    def _bytes(text: str) -> bytes:
        return text.encode("utf-8", errors="replace").replace(b"\x00", b"")

    def encode(self, text: str) -> list[int]:
        return list(self._bytes(text))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_stream(self, texts: Iterable[str]) -> np.ndarray:
        # One join over documents, one frombuffer: no per-token Python work.
        parts = [self._bytes(t) for t in texts]
        if not parts:
            return np.zeros(0, dtype=np.int64)
        buf = b"\x00".join(parts) + b"\x00"
        return np.frombuffer(buf, dtype=np.uint8).astype(np.int64)  # [total]

    def decode(self, ids: Sequence[int]) -> str:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError(f"ByteTokenizer.decode: ids must be in 0..255, got min {arr.min()} "
                             f"max {arr.max()}; were they produced by another tokenizer?")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256, eos_id=0)"


class TiktokenTokenizer:
    """GPT-2 BPE through tiktoken, built from local files only (see module docstring).

    `eos_id` is `<|endoftext|>` (50256 for the real GPT-2 vocabulary), `vocab_size` = ranks + 1.
    `matches_reference` says whether the file was the official r50k/gpt2 vocabulary.
    """

    def __init__(self, mergeable_ranks: dict[bytes, int], name: str = "gpt2",
                 matches_reference: bool = False, source: str = "") -> None:
        import tiktoken

        n = len(mergeable_ranks)
        missing = [b for b in range(256) if bytes([b]) not in mergeable_ranks]
        if missing or sorted(mergeable_ranks.values()) != list(range(n)):
            raise ValueError(
                f"tiktoken_path {source!r}: not a usable BPE vocabulary (needs all 256 single bytes "
                f"and ranks 0..{n - 1} without gaps). {GPT2_HELP}")
        self.name = name
        self.eos_id = n
        self.vocab_size = n + 1
        self.matches_reference = matches_reference
        self.source = source
        self._enc = tiktoken.Encoding(name=f"{name}-local", pat_str=_gpt2_pattern(),
                                      mergeable_ranks=mergeable_ranks,
                                      special_tokens={_ENDOFTEXT: n})

    def encode(self, text: str) -> list[int]:
        # Text that happens to contain "<|endoftext|>" is encoded as plain text, never as EOS.
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts))

    def encode_stream(self, texts: Iterable[str]) -> np.ndarray:
        return concat_with_eos(self.encode_batch(list(texts)), self.eos_id)

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return (f"TiktokenTokenizer(name={self.name!r}, vocab_size={self.vocab_size}, "
                f"eos_id={self.eos_id}, reference={self.matches_reference}, source={self.source!r})")


def _gpt2_pattern() -> str:
    try:
        from tiktoken_ext.openai_public import r50k_pat_str  # import only; downloads nothing

        return r50k_pat_str
    except Exception:  # tiktoken_ext layout changed: keep our copy
        return _GPT2_PAT


def _cache_name(url: str) -> str:
    # tiktoken's cache key for a URL (tiktoken/load.py: sha1 of the blob path).
    return hashlib.sha1(url.encode()).hexdigest()


def parse_tiktoken_bpe(data: bytes, source: str) -> dict[bytes, int]:
    """Parse the `.tiktoken` format: one `base64(token) rank` per line."""
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            tok, rank = line.split()
            ranks[base64.b64decode(tok, validate=True)] = int(rank)
        except Exception as exc:
            raise ValueError(f"tiktoken_path {source!r} line {lineno}: expected "
                             f"'<base64 token> <rank>', got {line[:60]!r}. {GPT2_HELP}") from exc
    return ranks


def _data_gym_byte_map() -> dict[str, int]:
    # GPT-2's encoder.json spells bytes as printable characters: printable non-space Latin-1
    # bytes stand for themselves, the other 68 bytes map to chr(256 + k) in byte order.
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    mapping = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in mapping.values()]
    mapping.update({chr(256 + k): b for k, b in enumerate(others)})
    return mapping


def parse_data_gym(encoder_json: bytes, source: str) -> dict[bytes, int]:
    """Ranks from GPT-2's original `encoder.json` (token string -> id) in data-gym spelling."""
    byte_of = _data_gym_byte_map()
    try:
        table = json.loads(encoder_json)
        ranks = {bytes(byte_of[c] for c in tok): int(i) for tok, i in table.items()
                 if tok not in (_ENDOFTEXT, "<|startoftext|>")}
    except Exception as exc:
        raise ValueError(f"tiktoken_path {source!r}: encoder.json is not GPT-2's data-gym "
                         f"format ({exc}). {GPT2_HELP}") from exc
    return ranks


def _find_in_dir(d: Path) -> tuple[str, Path] | None:
    """Locate a usable vocabulary inside a directory: ('tiktoken'|'data_gym', path)."""
    for fname in ("gpt2.tiktoken", "r50k_base.tiktoken", _cache_name(_R50K_URL)):
        if (d / fname).is_file():
            return "tiktoken", d / fname
    for fname in ("encoder.json", _cache_name(_ENCODER_JSON_URL)):
        if (d / fname).is_file():
            return "data_gym", d / fname
    return None


def load_gpt2_tokenizer(tiktoken_path: str | os.PathLike | None) -> TiktokenTokenizer:
    """Build the GPT-2 tokenizer from a local file or directory; never touches the network."""
    if tiktoken_path is None or str(tiktoken_path) == "":
        raise FileNotFoundError(f"tokenizer 'gpt2' requested without tiktoken_path. {GPT2_HELP}")
    p = Path(tiktoken_path).expanduser()
    if p.is_dir():
        found = _find_in_dir(p)
        if found is None:
            raise FileNotFoundError(
                f"tiktoken_path {str(p)!r} is a directory without gpt2.tiktoken, r50k_base.tiktoken, "
                f"encoder.json or tiktoken cache entries ({_cache_name(_R50K_URL)}, "
                f"{_cache_name(_ENCODER_JSON_URL)}). {GPT2_HELP}")
        kind, file = found
    elif p.is_file():
        kind, file = "tiktoken", p
    else:
        raise FileNotFoundError(f"tiktoken_path {str(p)!r} does not exist. {GPT2_HELP}")
    data = file.read_bytes()
    if data.lstrip()[:1] == b"{":  # encoder.json content, whatever the file is called
        kind = "data_gym"
    if kind == "tiktoken":
        ranks = parse_tiktoken_bpe(data, str(file))
        reference = hashlib.sha256(data).hexdigest() == _R50K_SHA256
    else:
        ranks = parse_data_gym(data, str(file))
        reference = len(ranks) == 50256
    return TiktokenTokenizer(ranks, name="gpt2", matches_reference=reference, source=str(file))


def get_tokenizer(name: str = "byte", tiktoken_path: str | os.PathLike | None = None) -> Tokenizer:
    """`"byte"` -> ByteTokenizer; `"gpt2"` -> TiktokenTokenizer from `tiktoken_path` (local only)."""
    if not isinstance(name, str):
        raise ValueError(f"tokenizer name must be a string ('byte' or 'gpt2'), got {name!r}")
    key = name.strip().lower()
    if key == "byte":
        return ByteTokenizer()
    if key in ("gpt2", "r50k_base", "tiktoken"):
        return load_gpt2_tokenizer(tiktoken_path)
    raise ValueError(f"tokenizer {name!r} is unknown; use 'byte' (no files needed) or 'gpt2' "
                     f"(with tiktoken_path)")
