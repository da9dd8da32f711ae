"""Tokenizer and chat template.

Tokenisation goes through llama.cpp (llama-cpp-python, vocab-only load: no weights are read), so token ids match
llama.cpp exactly. The chat template is the model's own Jinja template from the GGUF metadata.
"""
from __future__ import annotations

import codecs
import contextlib
import os
from pathlib import Path
from typing import Any

from fluxion_lite.errors import ModelFileError, RequestError


class Tokenizer:
    def __init__(self, model_path: str | os.PathLike[str], metadata: dict[str, Any]):
        try:
            import llama_cpp
        except ImportError as exc:  # the GPU host runs on token ids and has no llama-cpp-python
            raise ModelFileError("llama-cpp-python is not installed: text in/out needs it (token ids work without)") from exc
        with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
            try:
                self._llama = llama_cpp.Llama(str(model_path), vocab_only=True, verbose=False)
            except ValueError as exc:
                raise ModelFileError(f"{model_path}: llama.cpp could not load the vocabulary ({exc})") from exc
        self._lib = llama_cpp
        self._vocab = llama_cpp.llama_model_get_vocab(self._llama.model)
        self.vocab_size = int(self._llama.n_vocab())
        self.bos_id: int | None = _opt_int(metadata.get("tokenizer.ggml.bos_token_id"))
        self.eos_id: int | None = _opt_int(metadata.get("tokenizer.ggml.eos_token_id"))
        # End-of-generation ids as llama.cpp defines them (eos, eot, <|im_end|>, ...), not just the single eos field.
        self.eog_ids: frozenset[int] = frozenset(
            i for i in range(self.vocab_size) if llama_cpp.llama_vocab_is_eog(self._vocab, i)
        )
        self._template_src: str | None = metadata.get("tokenizer.chat_template")
        self._template: Any = None
        self._path = Path(model_path)
        self._piece_cache: dict[int, bytes] = {}

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Text -> ids. add_special adds BOS where the model asks for it; special-token text (e.g. <|im_start|>) is
        always parsed as the special token, since chat templates produce it."""
        return list(self._llama.tokenize(text.encode("utf-8"), add_bos=add_special, special=True))

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (control tokens render as nothing)."""
        piece = self._piece_cache.get(token_id)
        if piece is None:
            piece = self._llama.detokenize([token_id], special=False)
            self._piece_cache[token_id] = piece
        return piece

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def token_str(self, token_id: int, special: bool = True) -> str:
        return self._llama.detokenize([token_id], special=special).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not messages:
            raise RequestError("messages must not be empty")
        if self._template_src is None:
            raise RequestError(f"{self._path.name} has no chat template; use plain completion instead")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(message: str) -> None:
                raise RequestError(f"chat template: {message}")

            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self._template_src)
        return str(
            self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.token_str(self.bos_id) if self.bos_id is not None else "",
                eos_token=self.token_str(self.eos_id) if self.eos_id is not None else "",
            )
        )


class IncrementalDecoder:
    """Turns a stream of token ids into text pieces that are always valid UTF-8: bytes of a character split across
    tokens are held until the character completes."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self._tok.token_bytes(token_id))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)

