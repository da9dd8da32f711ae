"""How our CPU decode step scales with threads, against llama.cpp on the same file, and where a step's time goes.

For each thread count: our engine's decode TPOT (greedy, EOS ignored, after a prefill of --context tokens), split into
the layers' native calls (the one call for all layers of a lone dense sequence, NativeDecoder.step, or of a fluxion
step, SparseDecodeStep.run; else per layer
NativeLayer.qkv, attention, NativeLayer.out_mlp), the vocabulary product, sampling and the rest (Python and torch
between the calls); the same calls timed back to back outside the engine (the kernels' own
cost at this thread count); llama.cpp's TPOT on the same file. Torch's intra-op threads are --torch-threads (0: the
same as the pool).

Usage: python research/cpu_threads.py --models smollm2-135m --threads 2 4 8 16 --context 512
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

from fluxion_lite.engine import engine as engine_module
from fluxion_lite.engine.engine import Engine
from fluxion_lite.engine.sampling import SamplingParams
from fluxion_lite.hostkv import native
from fluxion_lite.hostkv.layer import NativeDecoder, NativeLayer, SparseDecodeStep
from fluxion_lite.hub.resolve import resolve_model
from fluxion_lite.model.transformer import Transformer
from fluxion_lite.offline.eval_text import essay_text
from fluxion_lite.offline.llamacpp_peer import last_logits, load_peer

TIMES: dict[str, float] = defaultdict(float)


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += time.perf_counter() - t0
    return wrapper


def decode_tpot(engine: Engine, tokens: list[int], n_decode: int) -> float:
    """Mean ms per decode step after the first token."""
    rid = engine.add_request(tokens, SamplingParams(temperature=0.0, max_tokens=n_decode, ignore_eos=True))
    stamps: list[float] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids:
                stamps.append(time.perf_counter())
                if len(stamps) == 1:
                    TIMES.clear()
    return 1000 * (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def kernel_costs(engine: Engine, reps: int) -> dict[str, float]:
    """The layer's native calls back to back (us per call), outside the engine."""
    lw = engine.model.layers[0]
    cfg = engine.config
    x = torch.randn(1, cfg.d_model) * 0.1
    rope = engine.model.rope.ensure(8)[:1].contiguous()  # [1, 2, R]
    o = torch.randn(1, cfg.n_heads * cfg.head_dim) * 0.1
    out = {}
    for name, call in (("qkv", lambda: lw.native.qkv(x, rope)), ("out_mlp", lambda: lw.native.out_mlp(x.clone(), o))):
        for _ in range(20):
            call()
        t0 = time.perf_counter()
        for _ in range(reps):
            call()
        out[name] = 1e6 * (time.perf_counter() - t0) / reps
    return out


def attention_probe(threads: list[int], hq: int, hkv: int, d: int, n: int, layers: int, reps: int) -> list[dict]:
    """The dense decode attention alone: one call per "layer" over `layers` distinct caches of n tokens (so the
    K/V come from DRAM as in a step), us per call and the read rate, per pool size."""
    from fluxion_lite.hostkv.layer import decode_attention

    g = torch.Generator().manual_seed(0)
    ks = [torch.randn(hkv, n + 64, d, generator=g) for _ in range(layers)]
    vs = [torch.randn(hkv, n + 64, d, generator=g) for _ in range(layers)]
    q, out = torch.randn(hq, d, generator=g), torch.empty(hq, d)
    rows = []
    for t in threads:
        native.set_threads(t)
        for i in range(layers):
            decode_attention(q, ks[i], vs[i], n, d ** -0.5, out=out)
        t0 = time.perf_counter()
        for _ in range(reps):
            for i in range(layers):
                decode_attention(q, ks[i], vs[i], n, d ** -0.5, out=out)
        us = 1e6 * (time.perf_counter() - t0) / (reps * layers)
        rows.append({"probe": "decode_attention", "threads": t, "shape": [hq, hkv, d, n], "us_per_call": us,
                     "gb_per_s": 2 * hkv * n * d * 4 / us / 1e3})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m"])
    ap.add_argument("--threads", nargs="+", type=int, default=[2, 4, 8, 16])
    ap.add_argument("--torch-threads", type=int, default=0)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--attention", default="full", choices=["full", "fluxion"])
    ap.add_argument("--spin-us", type=float, default=None, help="the pool's idle spin (default: the library's)")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("/tmp/cpu_threads.json"))
    ap.add_argument("--attention-probe", action="store_true",
                    help="also time the dense decode attention alone (the 1.5b shape at --context, over 400 caches)")
    args = ap.parse_args()
    NativeDecoder.step = timed("decode_layers", NativeDecoder.step)  # type: ignore[method-assign]  # one call a step
    SparseDecodeStep.run = timed("sparse_decode_layers", SparseDecodeStep.run)  # type: ignore[method-assign]
    NativeLayer.qkv = timed("qkv", NativeLayer.qkv)  # type: ignore[method-assign]
    NativeLayer.out_mlp = timed("out_mlp", NativeLayer.out_mlp)  # type: ignore[method-assign]
    Transformer.logits = timed("logits", Transformer.logits)  # type: ignore[method-assign]
    import fluxion_lite.model.attention as attention_module
    from fluxion_lite.model.kv_cache import DenseKVCache

    attention_module.decode_attention_unchecked = timed("attention.native", attention_module.decode_attention_unchecked)
    DenseKVCache.append_decode = timed("attention.append", DenseKVCache.append_decode)  # type: ignore
    Transformer.embed_tokens = timed("embed", Transformer.embed_tokens)  # type: ignore[method-assign]
    engine_module.sample_rows = timed("sample", engine_module.sample_rows)
    if args.spin_us is not None:
        native.set_spin_us(args.spin_us)
    rows = []
    if args.attention_probe:
        rows += attention_probe(args.threads, 12, 2, 128, args.context, 400, 5)  # 400 MB: past any L3
    for name in args.models:
        for t in args.threads:
            native.set_threads(t)
            torch.set_num_threads(args.torch_threads or t)
            engine = Engine(name, attention=args.attention, prefill_chunk=512, prefix_cache_entries=0)
            engine.attn.attend = timed("attention", engine.attn.attend)  # type: ignore[method-assign]
            ids = engine.tokenizer.encode(essay_text()[: args.context * 8], add_special=True)[: args.context]
            decode_tpot(engine, ids, 8)  # warm
            TIMES.clear()
            tpot = decode_tpot(engine, ids, args.decode)
            steps = args.decode - 1
            split = {k: 1000 * v / steps for k, v in TIMES.items()}
            split["rest"] = tpot - sum(v for k, v in split.items() if "." not in k)  # a.b is part of a
            kernels = kernel_costs(engine, 200)
            del engine
            peer_tpot = None
            if not args.no_peer:
                peer = load_peer(resolve_model(name, pull_missing=False), n_ctx=args.context + args.decode + 8,
                                 n_threads=t, logits_all=False)
                peer.eval(ids)
                t0 = time.perf_counter()
                for _ in range(args.decode - 1):
                    peer.eval([int(last_logits(peer).argmax())])
                peer_tpot = 1000 * (time.perf_counter() - t0) / (args.decode - 1)
                del peer
            row = {"model": name, "threads": t, "torch_threads": torch.get_num_threads(),
                   "spin_us": args.spin_us, "tpot_ms": tpot,
                   "split_ms": split, "kernel_us": kernels, "tpot_ms_llamacpp": peer_tpot}
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
