"""Training data for the head-property predictor: varied prompts, features at the prompt's end, labels after it.

Each sample prompt is split into a prefix (what a request's prefill would hold) and a continuation of M tokens (what
decoding would produce). Features come from the last FEATURE_QUERIES positions of the prefix over the prefix's K/V,
exactly as SparseAttention computes them online; labels are the calibration labels (effective error c*d per config)
of the M continuation positions over the whole K/V. So the predictor learns "from what prefill shows, how will this
group behave while decoding", not "how did it behave on the queries it was shown".

Prompt kinds (RULER-like plus ordinary text), rotated so every kind appears in training and held-out prompts:
  facts   essay haystack with 3 planted magic numbers, question about one; continuation = the answer, then essay
  multikey essay haystack with 12 planted key -> value lines, question about two keys; continuation = both answers
  chain   variable-assignment chains hidden in essay text (VAR X = 12345 / VAR Y = VAR X); continuation = the chain
  chat    a multi-turn User/Assistant transcript over essay passages; continuation = the last assistant reply
  code    Python standard-library source files concatenated; continuation = the next lines of code
"""
from __future__ import annotations

import random
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fluxion_lite.plan.space import all_configs

from fluxion_lite.plan.calibration import capture_prompt, layer_errors
from fluxion_lite.plan.head_features import FEATURE_QUERIES, N_FEATURES, layer_features

KINDS = ("facts", "multikey", "chain", "chat", "code")
WORDS = ("apple", "river", "falcon", "marble", "lantern", "cedar", "violet", "harbor", "meadow", "copper", "thistle",
         "orbit", "saffron", "glacier", "pepper", "quartz", "willow", "ember", "canyon", "basil", "juniper", "cobalt",
         "heron", "tundra", "walnut", "zephyr", "indigo", "onyx", "prairie", "sparrow")
Encode = Callable[[str], list[int]]


@dataclass
class Dataset:
    features: np.ndarray  # [P, L, Hkv, F] float32
    errors: np.ndarray  # [P, L, Hkv, C] float32: effective error per config (calibration.all_configs order)
    kinds: list[str]  # [P]
    lengths: np.ndarray  # [P] prefix tokens
    meta: dict[str, object]

    def save(self, path: Path) -> None:
        import json

        np.savez_compressed(path, features=self.features, errors=self.errors, lengths=self.lengths,
                            kinds=np.array(self.kinds), meta=np.array(json.dumps(self.meta)))

    @classmethod
    def load(cls, path: Path) -> "Dataset":
        import json

        with np.load(path, allow_pickle=False) as z:
            return cls(z["features"], z["errors"], [str(k) for k in z["kinds"]], z["lengths"], json.loads(str(z["meta"])))


def _essay_slice(essay_ids: list[int], n: int, rng: random.Random) -> list[int]:
    start = rng.randrange(0, max(1, len(essay_ids) - n))
    return essay_ids[start : start + n]


def _plant(body: list[int], inserts: list[list[int]], rng: random.Random) -> list[int]:
    for ins in inserts:
        at = rng.randrange(0, len(body) + 1)
        body = body[:at] + ins + body[at:]
    return body


def make_prompt(kind: str, n_tokens: int, m: int, essay_ids: list[int], code_ids: list[int], enc: Encode,
                rng: random.Random) -> tuple[list[int], list[int]]:
    """(prefix, continuation) with len(prefix) + m == n_tokens and len(continuation) == m."""
    n_prefix = n_tokens - m
    if kind in ("facts", "multikey"):
        n_keys, n_ask = (3, 1) if kind == "facts" else (12, 2)
        keys = rng.sample(WORDS, n_keys)
        vals = [rng.randrange(1_000_000, 9_999_999) for _ in keys]
        if kind == "facts":
            inserts = [enc(f" The special magic number for {k} is {v}. ") for k, v in zip(keys, vals)]
        else:
            inserts = [enc(f"\n{k}-{i}: {v}\n") for i, (k, v) in enumerate(zip(keys, vals))]
        ask = rng.sample(range(n_keys), n_ask)
        if kind == "facts":
            q = enc(f"\nQuestion: What is the special magic number for {keys[ask[0]]}? Answer:")
            answer = enc(f" The special magic number for {keys[ask[0]]} is {vals[ask[0]]}.")
        else:
            names = " and ".join(f"{keys[a]}-{a}" for a in ask)
            q = enc(f"\nQuestion: What are the values of {names}? Answer:")
            answer = enc(" " + ", ".join(f"{keys[a]}-{a} is {vals[a]}" for a in ask) + ".")
        body = _essay_slice(essay_ids, max(1, n_prefix - len(q) - sum(map(len, inserts))), rng)
        prefix = _plant(body, inserts, rng) + q
    elif kind == "chain":
        names = rng.sample([f"{a}{b}{rng.randrange(10, 99)}" for a in "ABCDEFGHJK" for b in "XYZQ"], 5)
        value = rng.randrange(10_000, 99_999)
        lines = [f"VAR {names[0]} = {value}"] + [f"VAR {names[i]} = VAR {names[i - 1]}" for i in range(1, 5)]
        inserts = [enc(f"\n{line}\n") for line in lines]
        q = enc(f"\nQuestion: Find all variables that are assigned the value {value}. Answer:")
        answer = enc(" According to the chain, " + ", ".join(names) + ".")
        body = _essay_slice(essay_ids, max(1, n_prefix - len(q) - sum(map(len, inserts))), rng)
        # keep the chain in order: sorted insertion points
        cuts = sorted(rng.randrange(0, len(body) + 1) for _ in inserts)
        pieces, last = [], 0
        for cut, ins in zip(cuts, inserts):
            pieces += body[last:cut] + ins
            last = cut
        prefix = pieces + body[last:] + q
    elif kind == "chat":
        turns: list[int] = []
        while len(turns) < n_prefix:
            user = _essay_slice(essay_ids, rng.randrange(20, 60), rng)
            reply = _essay_slice(essay_ids, rng.randrange(80, 240), rng)
            turns += enc("\nUser: ") + user + enc("\nAssistant: ") + reply
        prefix = turns[:n_prefix]
        answer = _essay_slice(essay_ids, m, rng)
    elif kind == "code":
        start = rng.randrange(0, max(1, len(code_ids) - n_tokens))
        return code_ids[start : start + n_prefix], code_ids[start + n_prefix : start + n_tokens]
    else:
        raise ValueError(f"unknown prompt kind {kind!r}")
    prefix = prefix[-n_prefix:]
    cont = (answer + _essay_slice(essay_ids, m, rng))[:m]
    return prefix, cont


def code_text(limit_chars: int, rng: random.Random) -> str:
    """Python standard-library source (always on the machine, real code), files in a seeded order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))
    rng.shuffle(files)
    out: list[str] = []
    total = 0
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        out.append(f"# file: {f.name}\n{text}\n")
        total += len(text)
        if total > limit_chars:
            break
    return "".join(out)


def prompt_features_and_errors(model: object, prefix: list[int], cont: list[int], sink: int, window: int
                               ) -> tuple[np.ndarray, np.ndarray]:
    """Features [L, Hkv, F] of the prefix's end and effective errors [L, Hkv, C] of the continuation positions."""
    from fluxion_lite.model.transformer import Transformer

    assert isinstance(model, Transformer)
    cfg = model.cfg
    n_q, m = FEATURE_QUERIES, len(cont)
    cap = capture_prompt(model, prefix + cont, m + n_q)
    r, d, hkv = cfg.gqa_ratio, cfg.head_dim, cfg.n_kv_heads
    n_prefix = len(prefix)
    positions = torch.arange(n_prefix, n_prefix + m)
    configs = all_configs()
    feats = np.zeros((cfg.n_layers, hkv, N_FEATURES), dtype=np.float32)
    errs = np.zeros((cfg.n_layers, hkv, len(configs)), dtype=np.float32)
    for layer in range(cfg.n_layers):
        q = torch.cat(cap.q[layer]).view(m + n_q, hkv, r, d)  # positions n_prefix - Q .. n_prefix + m - 1
        keys, values = cap.kv[layer]
        wo = model.layers[layer].wo_dense()
        feats[layer] = layer_features(q[:n_q], keys[:, :n_prefix], values[:, :n_prefix], wo, layer, cfg.n_layers,
                                      sink, window).numpy()
        err, _ = layer_errors(model, layer, q[n_q:], keys, values, positions, configs, sink, window)
        errs[layer] = err.numpy()
    return feats, errs


def collect(model_name: str, *, samples: int, context: int, positions: int, sink: int, window: int, seed: int,
            threads: int | None = None) -> Dataset:
    """Run `samples` prompts (kinds rotated, lengths 1/2, 3/4 or all of `context`); deterministic given `seed`."""
    from fluxion_lite.engine.engine import Engine
    from fluxion_lite.offline.eval_text import essay_text
    from fluxion_lite.plan.progress import progress

    if threads:
        torch.set_num_threads(threads)
    engine = Engine(model_name, attention="full", dtype="float32", prefix_cache_entries=0)  # dense fp32: the labels' reference
    tok = engine.tokenizer
    assert tok is not None

    def enc(s: str) -> list[int]:
        return tok.encode(s, add_special=False)

    rng = random.Random(seed)
    essay_ids = enc(essay_text()[: context * 60])
    code_ids = enc(code_text(context * 8, random.Random(seed + 1)))
    feats, errs, kinds, lengths = [], [], [], []
    t0 = time.time()
    for i in range(samples):
        kind = KINDS[i % len(KINDS)]
        n_tokens = int(context * rng.choice((0.5, 0.75, 1.0)))
        prefix, cont = make_prompt(kind, n_tokens, positions, essay_ids, code_ids, enc, rng)
        f, e = prompt_features_and_errors(engine.model, prefix, cont, sink, window)
        feats.append(f)
        errs.append(e)
        kinds.append(kind)
        lengths.append(len(prefix))
        progress(i + 1, samples, t0, f"predictor data ({kind:>8}, {n_tokens} tok)")
    meta = {"model": model_name, "samples": samples, "context": context, "positions": positions, "sink": sink,
            "window": window, "seed": seed, "n_layers": engine.config.n_layers, "n_groups": engine.config.n_kv_heads,
            "head_dim": engine.config.head_dim, "feature_queries": FEATURE_QUERIES,
            "configs": [c.key for c in all_configs()], "seconds": round(time.time() - t0, 1)}
    return Dataset(np.stack(feats), np.stack(errs), kinds, np.array(lengths), meta)
