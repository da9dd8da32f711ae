"""Library API: `LLM("smollm2-135m").generate("...")` without a server."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fluxion_lite.engine.engine import Engine
from fluxion_lite.engine.sampling import SamplingParams
from fluxion_lite.settings import Settings


class LLM:
    """A model plus an engine, driven synchronously by the caller's thread."""

    def __init__(self, model: str, *, settings: Settings | None = None, **engine_kwargs: Any):
        """settings: every FLUXION_* knob (fluxion_lite.settings; None: Settings.load() when the engine is built);
        engine_kwargs: the rest of Engine's arguments."""
        self.engine = Engine(model, settings=settings, **engine_kwargs)
        self.settings = self.engine.settings
        if self.engine.tokenizer is None:
            raise ValueError("LLM needs the tokenizer; use Engine(load_tokenizer=False) for token ids")
        self.tokenizer = self.engine.tokenizer

    def generate_stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text pieces as they are generated. Closing the iterator early aborts the request and frees its KV."""
        rid = self.engine.add_request(prompt, params or SamplingParams())
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id != rid:
                        continue
                    if out.new_text:
                        yield out.new_text
                    finished = out.finished
        finally:
            if not finished:
                self.engine.abort(rid)
                self.engine.step()  # drain the abort notice

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None) -> str:
        return "".join(self.generate_stream(prompt, params))

    def chat(
        self, messages: list[dict[str, str]], params: SamplingParams | None = None, stream: bool = False
    ) -> str | Iterator[str]:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        pieces = self.generate_stream(prompt, params)
        return pieces if stream else "".join(pieces)
