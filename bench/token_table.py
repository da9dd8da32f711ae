"""A tokenizer stand-in for hosts without llama-cpp-python (the GPU host): each token id's bytes, plus the encodings
of the few texts a bench needs to find in prompts, exported where the real tokenizer runs.

The GPU host answers RULER on token ids (bench/ruler_split.py); an analysis that also prints text or looks for an
answer's tokens in a prompt (research/parting_mass.py) needs only `decode` and the encodings of known strings. The table
is JSON: {"model": name, "pieces": [hex of token i's bytes, ...], "encodings": {text: [ids]}}.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable


def export_table(tok: Any, model: str, texts: Iterable[str]) -> dict[str, Any]:
    """tok: a fluxion_lite Tokenizer (vocab_size, token_bytes, encode). Every id's bytes (control tokens as the
    tokenizer renders them: empty) and each text's encoding without special tokens."""
    return {"model": model, "pieces": [tok.token_bytes(i).hex() for i in range(tok.vocab_size)],
            "encodings": {t: list(tok.encode(t, add_special=False)) for t in sorted(set(texts))}}


class TokenTable:
    """decode / encode from an exported table; encode knows only the exported texts."""

    def __init__(self, data: dict[str, Any], source: str = "token table"):
        try:
            self.pieces = [bytes.fromhex(p) for p in data["pieces"]]
            self.encodings = {str(t): [int(i) for i in ids] for t, ids in data["encodings"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{source}: not a token table ({e})") from e
        self.source = source
        self.vocab_size = len(self.pieces)

    @classmethod
    def load(cls, path: Path) -> "TokenTable":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not a token table ({e})") from e
        return cls(data, str(path))

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        if add_special:
            raise ValueError("a token table holds encodings without special tokens only")
        if text not in self.encodings:
            raise KeyError(f"{self.source} has no encoding of {text!r}: export the table with this text")
        return list(self.encodings[text])
