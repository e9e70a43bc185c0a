"""A token's own bytes, for logprobs of tokens that hold part of a character.

A byte-level BPE token can hold the first bytes of a multi-byte character (an emoji is 4 bytes,
often 2-3 tokens); decoded alone it is U+FFFD, the replacement character, and its bytes are lost.
OpenAI's logprobs carry each token's own `bytes` so that clients can join them back into the
characters. Those come from the token's spelling: byte-level vocabularies (GPT-2's, Llama 3's,
Qwen's, SmolLM2's) spell each byte as one character of a fixed 256-character alphabet;
SentencePiece vocabularies spell a byte-fallback token as `<0xHH>`.
"""

from __future__ import annotations

import re
from typing import Any

_HEX_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the other 68 bytes
    for the characters from U+0100 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


_BYTE_LEVEL = _byte_alphabet()


class TokenBytes:
    """The bytes of a tokenizer's tokens whose decoded text lost some (decoded alone: U+FFFD)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"

    def partial(self, token_id: int, text: str) -> bytes | None:
        """The token's own bytes where its decoded `text` is not them (a replacement character in
        it), else None (the text's UTF-8 is the token's bytes)."""
        if "\ufffd" not in text:
            return None
        spelled = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(spelled, str):
            return None
        hex_byte = _HEX_BYTE.fullmatch(spelled)
        if hex_byte is not None:
            return bytes([int(hex_byte.group(1), 16)])
        if self.byte_level and all(c in _BYTE_LEVEL for c in spelled):
            return bytes(_BYTE_LEVEL[c] for c in spelled)
        return None


def escaped(raw: bytes) -> str:
    """Bytes written as OpenAI writes a token that is not whole characters: `\\xf0\\x9f`."""
    return "".join(f"\\x{b:02x}" for b in raw)
