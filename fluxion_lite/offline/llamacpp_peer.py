"""llama.cpp (through llama-cpp-python) as a peer: same GGUF, used for parity checks and side-by-side benchmarks.

llama-cpp-python 0.3.36 crashes in llama_decode on CPUs with AMX through its weight-repacking buffers; it has no
constructor argument for that, so the model params are created with `use_extra_bufts = False` while the peer loads.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np


@contextlib.contextmanager
def _no_extra_buffer_types() -> Iterator[None]:
    # Llama.__init__ calls the function through the bindings module (llama_cpp.llama_cpp); the package only re-exports
    # it, so patching the package's name alone left the repacking buffers on (a segfault on an AMX Xeon)
    import llama_cpp
    import llama_cpp.llama_cpp as bindings

    original = bindings.llama_model_default_params

    def patched() -> Any:
        params = original()
        params.use_extra_bufts = False
        return params

    bindings.llama_model_default_params = patched
    llama_cpp.llama_model_default_params = patched
    try:
        yield
    finally:
        bindings.llama_model_default_params = original
        llama_cpp.llama_model_default_params = original


def load_peer(path: str | Path, n_ctx: int, n_threads: int | None = None, logits_all: bool = True, **kwargs: Any) -> Any:
    import llama_cpp

    with _no_extra_buffer_types(), open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
        return llama_cpp.Llama(
            str(path),
            n_ctx=n_ctx,
            n_batch=min(512, n_ctx),
            n_threads=n_threads,
            n_threads_batch=n_threads,
            logits_all=logits_all,
            verbose=False,
            **kwargs,
        )


def teacher_forced_logits(peer: Any, tokens: list[int]) -> np.ndarray:
    """Logits [len(tokens), V] at every position (row i predicts token i + 1)."""
    peer.reset()
    peer.eval(tokens)
    return np.array(peer.scores[: len(tokens)], dtype=np.float32)


def greedy_continuation(peer: Any, prompt: list[int], n_tokens: int, stop_ids: frozenset[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens from llama.cpp and, for each, llama.cpp's own top-2 logit gap at that step."""
    peer.reset()
    peer.eval(prompt)
    out: list[int] = []
    gaps: list[float] = []
    for _ in range(n_tokens):
        logits = np.array(peer.scores[peer.n_tokens - 1], dtype=np.float32)
        top2 = np.partition(logits, -2)[-2:]
        token = int(np.argmax(logits))
        out.append(token)
        gaps.append(float(abs(top2[1] - top2[0])))
        if token in stop_ids:
            break
        peer.eval([token])
    return out, gaps


def last_logits(peer: Any) -> np.ndarray:
    """Logits of the last evaluated token when the peer was loaded with logits_all=False (llama-cpp-python then keeps
    no score rows; the context's own logits buffer still holds the last token's)."""
    return np.ctypeslib.as_array(peer._ctx.get_logits(), shape=(peer.n_vocab(),))
