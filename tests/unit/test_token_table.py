"""bench/token_table.py: the tokenizer stand-in for the GPU host decodes as the tokenizer it was exported from and
encodes the exported texts, and refuses the rest with a clear error."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from token_table import TokenTable, export_table  # noqa: E402


class StubTokenizer:
    """Byte pieces of random lengths (some multi-byte UTF-8 split across tokens, some empty like control tokens)."""

    def __init__(self, seed: int = 0, vocab: int = 300):
        rng = np.random.default_rng(seed)
        text = "naïve café – 東京 " * 20
        raw = text.encode("utf-8")
        cuts = np.sort(rng.choice(np.arange(1, len(raw)), size=vocab - 3, replace=False))
        self.pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)])] + [b"", b"<x>"]
        self.vocab_size = len(self.pieces)

    def token_bytes(self, i: int) -> bytes:
        return self.pieces[i]

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        return [len(text) % self.vocab_size, 7, 3]  # any fixed ids: the table must return them as given


def test_decode_matches_the_exported_tokenizers_bytes_and_encode_the_exported_texts(tmp_path: Path) -> None:
    stub = StubTokenizer()
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps(export_table(stub, "stub", ["1234", " 1234", "1234"])))
    table = TokenTable.load(path)
    assert table.vocab_size == stub.vocab_size
    rng = np.random.default_rng(1)
    for _ in range(20):
        ids = rng.integers(0, stub.vocab_size, size=int(rng.integers(1, 40))).tolist()
        want = b"".join(stub.pieces[i] for i in ids).decode("utf-8", errors="replace")
        assert table.decode(ids) == want
    assert table.encode("1234") == stub.encode("1234") and table.encode(" 1234") == stub.encode(" 1234")
    assert sorted(table.encodings) == [" 1234", "1234"]


def test_unknown_text_and_bad_files_get_clear_errors(tmp_path: Path) -> None:
    table = TokenTable(export_table(StubTokenizer(), "stub", ["a"]), "t.json")
    with pytest.raises(KeyError, match="no encoding of 'b'"):
        table.encode("b")
    with pytest.raises(ValueError, match="without special tokens"):
        table.encode("a", add_special=True)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"pieces": ["zz"], "encodings": {}}))
    with pytest.raises(ValueError, match="not a token table"):
        TokenTable.load(bad)
    with pytest.raises(ValueError, match="not a token table"):
        TokenTable.load(tmp_path / "missing.json")
