"""Tokenizers: the model's own (Hugging Face), or a byte-level one for tiny test models.

The byte tokenizer maps UTF-8 bytes to ids 0..255 and reserves 258 (bos) and 259 (eos); it needs
no files, so tests and the tiny config run without the pretrained model installed.
"""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens; vocab 260 (256 bytes, 2 unused, bos = 258, eos = 259)."""

    name = "bytes"
    vocab_size = 260
    bos_id = 258
    eos_id = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="replace"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer; documents are separated by its eos token."""

    def __init__(self, hf_tokenizer, name: str):
        self.tok = hf_tokenizer
        self.name = name
        self.vocab_size = len(hf_tokenizer)
        eos = hf_tokenizer.eos_token_id
        self.eos_id = int(eos if eos is not None else 0)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.tok(texts, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)
