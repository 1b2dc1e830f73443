"""NSAByteTokenizer: the project's byte tokenizer (nsa.data.tokenizers.ByteTokenizer) as a transformers
PreTrainedTokenizer, so AutoTokenizer.from_pretrained(export dir) gives the ids training used.

ids 0..255 are the UTF-8 bytes of the text; NUL bytes are dropped on encode, so id 0 only ever means
end-of-document (the eos token). Tokens are spelled "<0xNN>" (as byte-fallback vocabularies do): every
id has a printable, unambiguous name. Special tokens are never parsed out of text (split_special_tokens):
a text containing "<0x00>" encodes as its bytes, exactly as ByteTokenizer does. Nothing is added to an
encoding (no bos/eos), again as in training's per-document encoding.
"""
from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizer

from nsa.data.tokenizers import ByteTokenizer

_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
_IDS = {t: i for i, t in enumerate(_TOKENS)}


class NSAByteTokenizer(PreTrainedTokenizer):
    """Byte-level tokenizer of the NSA project (vocab 256, eos = pad = id 0 "<0x00>"); no vocab file."""

    vocab_files_names: dict[str, str] = {}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("eos_token", _TOKENS[ByteTokenizer.eos_id])
        kwargs.setdefault("pad_token", _TOKENS[ByteTokenizer.eos_id])
        kwargs.setdefault("split_special_tokens", True)
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        self._bytes = ByteTokenizer()
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return ByteTokenizer.vocab_size

    def get_vocab(self) -> dict[str, int]:
        return dict(_IDS)

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return [_TOKENS[i] for i in self._bytes.encode(text)]   # the project's encode: NULs dropped

    def _convert_token_to_id(self, token: str) -> int:
        if token not in _IDS:
            raise ValueError(f"NSAByteTokenizer: {token!r} is not a byte token (<0x00> .. <0xFF>)")
        return _IDS[token]

    def _convert_id_to_token(self, index: int) -> str:
        if not 0 <= int(index) < len(_TOKENS):
            raise ValueError(f"NSAByteTokenizer: id {index} is outside 0..255; was it made by another tokenizer?")
        return _TOKENS[int(index)]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self._bytes.decode([_IDS[t] for t in tokens])    # invalid UTF-8 -> U+FFFD, as the project

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        return ()   # the vocabulary is the 256 bytes: nothing to write
