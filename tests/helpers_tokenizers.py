"""Stand-in tokenizers for tests that need no real one: bytes as tokens for decoding, and the
few attributes build_model reads."""

from __future__ import annotations


class CharTokenizer:
    """Bytes as tokens (ids 0-255), eos 256, pad 257: enough for generate() and decode()."""

    eos_token_id, pad_token_id = 256, 257

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [list(t.encode()) for t in texts]}

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    def __len__(self):
        return 258


class StubTokenizer:
    """What build_model reads from a tokenizer: its length and special ids."""

    def __init__(self, size: int):
        self.size, self.eos_token_id, self.pad_token_id = size, size - 2, size - 1

    def __len__(self):
        return self.size
