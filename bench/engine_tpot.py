"""TPOT through the engine itself (Engine.step, what the server and the library drive), async decode off vs on.

bench/tpot.py times model steps on synthetic context; this loads a real GGUF into the Engine, prefills real
prompts (random token ids: speed does not depend on the text) and decodes greedily (or with seeded sampling,
--temperature; penalties with --repetition-penalty and the OpenAI pair) with EOS ignored, timing the gap
between successive tokens of each request as a caller of Engine.step sees it (only once every request of the case
has its first token, so no prompt chunk shares the steps; the first two gaps of each request dropped). After an
untimed warm-up run, each case runs with FLUXION_ASYNC_DECODE's switch (Engine.async_decode) off and on,
alternated, `--repeats` times; the tokens of both must be the same. Attention modes are switched on one
loaded model (Engine.set_attention).

    python bench/engine_tpot.py --gguf qwen2.5-coder-0.5b --contexts 32768 --batches 1 4 --modes fluxion fixed \
        --device cuda --out bench/results/engine_tpot.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tpot  # noqa: E402 (machine name, commit label)

from fluxion_lite.engine.engine import Engine  # noqa: E402
from fluxion_lite.engine.sampling import SamplingParams  # noqa: E402


def run_case(engine: Engine, prompts: list[list[int]], decode: int, async_on: bool,
             params: SamplingParams) -> tuple[list[float], list[list[int]], float]:
    """-> (inter-token gaps in seconds over all requests, each request's tokens, prefill seconds). Every request
    gets `params` with max_tokens = decode and its own seed (the same in every run, so a sampled run must draw the
    same tokens as its twin; penalties keep each request's history on the device)."""
    engine.async_decode = async_on
    ids = [engine.add_request(p, dataclasses.replace(params, seed=1000 + r, max_tokens=decode, ignore_eos=True))
           for r, p in enumerate(prompts)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    stamps: dict[str, list[float]] = {i: [] for i in ids}
    t0 = time.perf_counter()
    first = None
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.new_token_ids:
                tokens[out.request_id].extend(out.new_token_ids)
                stamps[out.request_id].append(now)
        if first is None and all(stamps[i] for i in ids):
            first = now
    # pure decode only: gaps after every request has its first token (until then, other rows' prompt chunks
    # share the steps), the first two of each request dropped
    gaps = [b - a for i in ids for k, (a, b) in enumerate(zip(stamps[i], stamps[i][1:]))
            if k >= 2 and first is not None and a >= first]
    return gaps, [tokens[i] for i in ids], (first or t0) - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default="qwen2.5-coder-0.5b")
    ap.add_argument("--contexts", nargs="+", type=int, default=[32768])
    ap.add_argument("--batches", nargs="+", type=int, default=[1])
    ap.add_argument("--modes", nargs="+", default=["fluxion"])
    ap.add_argument("--decode", type=int, default=48, help="tokens generated per request")
    ap.add_argument("--repeats", type=int, default=2, help="off/on pairs per case")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else seeded sampling on the device")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0, help="llama.cpp-style, over the last 64 ids")
    ap.add_argument("--presence-penalty", type=float, default=0.0)
    ap.add_argument("--frequency-penalty", type=float, default=0.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty)
    params.validate()
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    engine = Engine(args.gguf, device=args.device, dtype=dtype, attention=args.modes[0], max_batch=max(args.batches),
                    max_context=max(args.contexts) + args.decode + 16, prefill_chunk=args.prefill_chunk,
                    load_tokenizer=False)
    dev = torch.device(args.device)
    note = f"{args.gguf} ({dtype}) on {tpot.machine_name(dev)}, commit {tpot.commit_label() or '?'}"
    print(note, flush=True)
    print(f"{'mode':<9}{'ctx':>7}{'B':>3}{'rep':>4}{'sync ms':>9}{'async ms':>9}{'ratio':>7}{'same':>6}"
          f"{'prefill s':>10}", flush=True)
    rows = []
    gen = torch.Generator().manual_seed(0)
    for mode in args.modes:
        if mode != engine.attention_mode:
            engine.set_attention(mode)
        for context in args.contexts:
            for batch in args.batches:
                n = context - args.decode - 8
                prompts = [torch.randint(100, engine.config.vocab_size - 100, (n,), generator=gen).tolist()
                           for _ in range(batch)]
                run_case(engine, prompts, 8, True, params)  # warm-up: captures, kernel builds, caches (not timed)
                first_tokens = None
                for rep in range(args.repeats):
                    res = {on: run_case(engine, prompts, args.decode, on, params)
                           for on in (False, True)}
                    sync_ms, async_ms = (1000 * statistics.median(res[on][0]) for on in (False, True))
                    same = res[False][1] == res[True][1]
                    first_tokens = first_tokens or res[False][1]
                    rows.append({"mode": mode, "context": context, "batch": batch, "repeat": rep,
                                 "tpot_sync_ms": sync_ms, "tpot_async_ms": async_ms, "same_tokens": same,
                                 "same_as_first_sync": [res[on][1] == first_tokens for on in (False, True)],
                                 "tokens": [res[False][1], res[True][1]],
                                 "prefill_s": [res[False][2], res[True][2]],
                                 "gaps_sync_ms": [1000 * g for g in res[False][0]],
                                 "gaps_async_ms": [1000 * g for g in res[True][0]]})
                    print(f"{mode:<9}{context:>7}{batch:>3}{rep:>4}{sync_ms:>9.2f}{async_ms:>9.2f}"
                          f"{sync_ms / async_ms:>7.2f}{'yes' if same else 'NO':>6}{res[True][2]:>10.1f}", flush=True)
                    if args.out:
                        Path(args.out).write_text(json.dumps({"note": note, "command": "python " + " ".join(sys.argv),
                                                              "params": dataclasses.asdict(params), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
