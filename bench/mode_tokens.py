"""Greedy decode tokens of every attention mode on one model and prompt: a refactor's before / after check.

Runs each mode (full, full-host, fixed, gpu-sparse, fluxion) through the Engine on the same long prompt (essay
text, so the sparse modes select blocks), greedy, and writes {mode: [token ids]} as JSON; with --compare OLD.json
it prints, per mode, whether the tokens are identical to OLD's and exits 1 if any mode differs.

    python bench/mode_tokens.py --out /tmp/after.json --compare /tmp/before.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

MODES = ("full", "full-host", "fixed", "gpu-sparse", "fluxion")


def engine_classes():
    try:  # the package's public surface
        from fluxion_lite import Engine, SamplingParams
    except ImportError:  # a tree from before the public surface existed (for a before / after run)
        from fluxion_lite.engine import Engine  # type: ignore[no-redef]
        from fluxion_lite.sampling import SamplingParams  # type: ignore[no-redef]
    return Engine, SamplingParams


def essay_prompt(tokenizer, n_tokens: int) -> list[int]:
    import long_context_eval  # the eval text package (a test dependency)

    path = Path(long_context_eval.__file__).parent / "data" / "synthetic" / "json" / "PaulGrahamEssays.json"
    text = json.loads(path.read_text())["text"]
    return tokenizer.encode(text[: n_tokens * 8], add_special=False)[:n_tokens]


def run(model: str, prompt_tokens: int, new_tokens: int, modes: list[str]) -> dict[str, list[int]]:
    Engine, SamplingParams = engine_classes()
    out: dict[str, list[int]] = {}
    engine = Engine(model, attention="full")
    prompt = essay_prompt(engine.tokenizer, prompt_tokens)
    for mode in modes:
        engine.set_attention(mode)
        t0 = time.perf_counter()
        rid = engine.add_request(list(prompt), SamplingParams(temperature=0.0, max_tokens=new_tokens))
        tokens: list[int] = []
        while engine.has_unfinished():
            for o in engine.step():
                if o.request_id == rid:
                    tokens += o.new_token_ids
        out[mode] = tokens
        print(f"{mode:>10}: {len(tokens)} tokens in {time.perf_counter() - t0:.1f} s  {tokens[:12]}...", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare", default=None, help="a JSON written by an earlier run: exit 1 unless identical")
    args = ap.parse_args()
    tokens = run(args.model, args.prompt_tokens, args.new_tokens, args.modes)
    Path(args.out).write_text(json.dumps({"machine": platform.processor() or platform.machine(), "model": args.model,
                                          "prompt_tokens": args.prompt_tokens, "tokens": tokens}, indent=1))
    if args.compare is None:
        return 0
    old = json.loads(Path(args.compare).read_text())["tokens"]
    same = True
    for mode in args.modes:
        ok = old.get(mode) == tokens[mode]
        same &= ok
        print(f"{mode:>10}: {'identical' if ok else 'DIFFERENT'} ({len(tokens[mode])} tokens)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
