"""A byte-level tokenizer: token i < 256 is byte i; BOS and EOS come from the config.

Nothing to download, ever: the vocabulary is the 256 byte values plus special ids. Ids
that are not bytes (specials, or ids a random model emits above 257) decode to nothing,
so any output decodes to valid text.
"""
from __future__ import annotations


class ByteTokenizer:
    def __init__(self, vocab_size: int, bos_token_id: int, eos_token_id: int):
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    @classmethod
    def from_config(cls, config) -> "ByteTokenizer":
        return cls(config.vocab_size, config.bos_token_id, config.eos_token_id)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"prompt must be a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
