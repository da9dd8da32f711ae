"""Native kernel bandwidth: sparse attention, top-k scoring, gather -- next to this machine's measured read bandwidth.

One run prints a table per thread count and writes bench/results/kernels-<host>.json:
  * read bandwidth: a STREAM-like read of a large buffer on the same thread pool (the ceiling),
  * sparse attention GB/s: bytes of K and V in the selected blocks / time of one per-layer call for all tasks,
  * top-k GB/s: bytes of block summaries scanned / time (min and max per dimension, 16-bit like the KV; fp32
    before fx_version 4, so GB/s across that change compare at twice the bytes: compare ms/call),
  * gather GB/s: bytes of K and V copied into the (pinned if CUDA) staging buffer / time (bytes read; a copy
    also writes as many), with non-temporal stores (default) and with plain cached stores,
  * block read: the same selected K and V blocks read the way sparse attention reads them (same work items, order
    and next-block prefetch) with no compute -- the ceiling of that scattered access pattern on this machine; the
    attention row's "of block read" is its rate over this one,
  * torch CPU: the same attention with index_select + matmul in torch, same thread count, for comparison,
  * fixed cost: the same attention call with empty selections (Python wrapper + validation + pool dispatch).
--simd a,b times the attention on each SIMD path in turn within every round (e.g. avx512 vs avx512bf16; the latter
uses bf16 dot products only when q is exactly bf16: add --q-dtype bfloat16, the q of a bf16 model).
Every timing is the median of --repeats calls after a warm-up call; the ceiling and the kernels are measured in
alternating rounds (the machine may be shared) and the medians of the rounds are reported.
Decode cases (--decode-batches, --decode-budget): the Llama-3.1-8B decode shape at batch 1 and 8 with a 5% budget,
after the main case; a batch-8 store of --decode-layers layers is built for it (no torch baseline there).
Layers rotate from call to call and the store (default 8 layers x 32K tokens, Llama-3.1-8B KV shape: 8 KV heads,
GQA 4, head_dim 128, bf16) is far larger than the last-level cache, so the numbers are memory-bound reads.

Usage: python bench/kernels.py [--threads 1,all] [--tokens 32768] [--layers 8] [--batch 1] [--budget 0.1]
                              [--decode-batches 1,8] [--decode-budget 0.05] [--decode-layers 12]
                              [--simd avx512,avx512bf16] [--q-dtype bfloat16]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fluxion_lite.hostkv import native  # noqa: E402
from fluxion_lite.hostkv.store import HostKVStore  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() over `repeats` calls after one warm-up."""
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def build_store(args: argparse.Namespace) -> tuple[HostKVStore, list[int], list[torch.Tensor], list[torch.Tensor]]:
    """The store, its slots, and (with args.torch_baseline) contiguous torch copies for the torch baseline."""
    store = HostKVStore(args.layers, args.kv_heads, args.head_dim, dtype=torch.bfloat16, max_seqs=args.batch,
                        page_tokens=1024, granularities=(args.topk_g, args.g),
                        initial_pages_per_seq=-(-args.tokens // 1024))
    slots = [store.allocate() for _ in range(args.batch)]
    # torch copies [Hkv, B*N, D] per layer for the torch baseline (contiguous per head, like the store)
    torch_k, torch_v = [], []
    chunk = 4096
    for layer in range(args.layers):
        shape = (args.kv_heads, args.batch * args.tokens, args.head_dim) if args.torch_baseline else (0, 0, 0)
        tk = torch.empty(shape, dtype=torch.bfloat16)
        tv = torch.empty_like(tk)
        for si, slot in enumerate(slots):
            for start in range(0, args.tokens, chunk):
                n = min(chunk, args.tokens - start)
                k = torch.randn(n, args.kv_heads, args.head_dim).bfloat16()
                v = torch.randn(n, args.kv_heads, args.head_dim).bfloat16()
                store.append(layer, slot, k, v)
                base = si * args.tokens + start
                if args.torch_baseline:
                    tk[:, base:base + n] = k.transpose(0, 1)
                    tv[:, base:base + n] = v.transpose(0, 1)
        torch_k.append(tk)
        torch_v.append(tv)
    return store, slots, torch_k, torch_v


def run(args: argparse.Namespace, threads: int, store: HostKVStore, slots: list[int], torch_k: list[torch.Tensor],
        torch_v: list[torch.Tensor], probe_buf: np.ndarray, simd_paths: list[str]) -> dict:
    """One case at one thread count. The attention is timed on each of simd_paths in turn within every round (so a
    slow phase of a shared machine hits all paths alike); everything else runs on the first path."""
    native.set_simd(simd_paths[0])
    native.set_threads(threads)
    torch.set_num_threads(threads)
    H, r, D, g, N, B = args.kv_heads, args.group, args.head_dim, args.g, args.tokens, args.batch
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, H * r, D), dtype=np.float32)
    if args.q_dtype == "bfloat16":  # the q of a bf16 model: every element a bf16 value (the avx512bf16 path's case)
        q = torch.from_numpy(q).bfloat16().float().numpy()
    scale = 1.0 / np.sqrt(D)
    n_blocks = N // g
    k_sel = max(1, int(args.budget * n_blocks))
    # Selections: the top-k of random queries over random keys is a near-uniform scatter of blocks.
    tasks = native.make_tasks(np.repeat(slots, H), np.repeat(np.arange(B), H), np.tile(np.arange(H), B), g, k_sel)
    ids_per_layer = []
    for layer in range(args.layers):
        ids, _, counts = native.group_topk(store.view(layer), q, tasks)
        ids_per_layer.append((ids, counts))
    n_tasks = len(tasks)
    kv_bytes = n_tasks * k_sel * g * D * 2 * 2  # K and V of the selected blocks

    reps = 3

    layer_cycle = {"i": 0}

    def next_layer() -> int:
        layer_cycle["i"] = (layer_cycle["i"] + 1) % args.layers
        return layer_cycle["i"]

    # (a) sparse attention
    out = np.empty((n_tasks, r, D), np.float32)
    lse = np.empty((n_tasks, r), np.float32)

    def attend() -> None:
        layer = next_layer()
        ids, counts = ids_per_layer[layer]
        native.sparse_attention(store.view(layer), q, tasks, ids, counts, scale, out=out, lse=lse)


    # (b) top-k over g=topk_g summaries (all blocks of every task scanned)
    topk_tasks = tasks.copy()
    topk_tasks[:, 3] = args.topk_g
    topk_tasks[:, 4] = max(1, int(args.budget * (N // args.topk_g)))
    k_cap = int(topk_tasks[0, 4])
    topk_out = (np.empty((n_tasks, k_cap), np.int32), np.empty((n_tasks, k_cap), np.float32),
                np.empty(n_tasks, np.int32))
    summary_bytes = n_tasks * (N // args.topk_g) * 2 * D * 2  # [blocks][2][D] 16-bit per task

    def topk() -> None:
        native.group_topk(store.view(next_layer()), q, topk_tasks, k_cap=k_cap, out=topk_out)


    # (c) gather into a staging buffer
    pin = torch.cuda.is_available()
    stage_k = torch.empty(n_tasks * k_sel * g, D, dtype=torch.bfloat16, pin_memory=pin)
    stage_v = torch.empty_like(stage_k, pin_memory=pin) if pin else torch.empty_like(stage_k)
    offsets = (np.arange(n_tasks, dtype=np.int64) * k_sel * g)

    def gather() -> None:
        layer = next_layer()
        ids, counts = ids_per_layer[layer]
        native.gather(store.view(layer), tasks, ids, counts, stage_k, stage_v, out_offset=offsets)

    # The machine may be shared: measure the ceiling and the kernels in alternating rounds, report medians.
    # Fixed cost per call: the same attention call with every selection empty (no KV bytes touched).
    no_counts = np.zeros(n_tasks, np.int32)

    def attend_empty() -> None:
        layer = next_layer()
        native.sparse_attention(store.view(layer), q, tasks, ids_per_layer[layer][0], no_counts, scale, out=out,
                                lse=lse)

    # (d) the attention's reads alone: same blocks, same work split and prefetch, no compute
    def blocks_read() -> None:
        layer = next_layer()
        ids, counts = ids_per_layer[layer]
        native.read_blocks_probe(store.view(layer), tasks, ids, counts)

    rounds: dict[str, list[float]] = {"read": [], "topk": [], "gather": [], "gather_cached": [], "blocks_read": []}
    rounds.update({f"attn:{path}": [] for path in simd_paths})
    for rnd in range(args.rounds):
        rounds["read"].append(timed(lambda: native.read_bandwidth_probe(probe_buf, reps), 3))
        first = rnd % len(simd_paths)  # each path goes first in some rounds
        for path in simd_paths[first:] + simd_paths[:first]:
            native.set_simd(path)
            rounds[f"attn:{path}"].append(timed(attend, args.repeats))
        native.set_simd(simd_paths[0])
        rounds["blocks_read"].append(timed(blocks_read, args.repeats))
        rounds["topk"].append(timed(topk, args.repeats))
        rounds["gather"].append(timed(gather, args.repeats))
        native.set_stream_stores(False)  # outside the timed calls
        rounds["gather_cached"].append(timed(gather, args.repeats))
        native.set_stream_stores(True)
    t_read, t_attn, t_topk, t_gather, t_gather_c = (
        statistics.median(rounds[k]) for k in ("read", f"attn:{simd_paths[0]}", "topk", "gather", "gather_cached"))
    t_blocks = statistics.median(rounds["blocks_read"])
    t_empty = timed(attend_empty, 200)
    read_gbs = probe_buf.nbytes * reps / t_read / 1e9
    gbs = lambda nbytes, t: nbytes / t / 1e9  # noqa: E731
    result = {
        "threads": threads,
        "batch": B,
        "budget": args.budget,
        "layers": args.layers,
        "simd": simd_paths[0],
        "read_GBps": read_gbs,
        "fixed_call_us": t_empty * 1e6,
        "sparse_attention": {"GBps": gbs(kv_bytes, t_attn), "ms": t_attn * 1e3, "bytes": kv_bytes,
                             "ratio_to_read": gbs(kv_bytes, t_attn) / read_gbs,
                             "ratio_to_blocks_read": t_blocks / t_attn},
        # the attention on every path asked for (sparse_attention above is the first one's)
        "sparse_attention_by_simd": {
            path: {"GBps": gbs(kv_bytes, t), "ms": t * 1e3, "ratio_to_read": gbs(kv_bytes, t) / read_gbs,
                   "ratio_to_blocks_read": t_blocks / t}
            for path, t in ((path, statistics.median(rounds[f"attn:{path}"])) for path in simd_paths)},
        "blocks_read": {"GBps": gbs(kv_bytes, t_blocks), "ms": t_blocks * 1e3, "bytes": kv_bytes,
                        "ratio_to_read": gbs(kv_bytes, t_blocks) / read_gbs},
        "topk": {"GBps": gbs(summary_bytes, t_topk), "ms": t_topk * 1e3, "bytes": summary_bytes,
                 "ratio_to_read": gbs(summary_bytes, t_topk) / read_gbs},
        # GBps counts bytes read; traffic_GBps adds the as many bytes written into the staging buffer.
        "gather": {"GBps": gbs(kv_bytes, t_gather), "ms": t_gather * 1e3, "bytes": kv_bytes,
                   "ratio_to_read": gbs(kv_bytes, t_gather) / read_gbs, "traffic_GBps": gbs(2 * kv_bytes, t_gather),
                   "pinned": pin},
        "gather_cached_stores": {"GBps": gbs(kv_bytes, t_gather_c), "ms": t_gather_c * 1e3, "bytes": kv_bytes,
                                 "ratio_to_read": gbs(kv_bytes, t_gather_c) / read_gbs,
                                 "traffic_GBps": gbs(2 * kv_bytes, t_gather_c), "pinned": pin},
    }
    if not args.torch_baseline:
        return result

    # torch CPU baseline: index_select the selected tokens, then matmul / softmax / matmul, all tasks batched
    tok_idx = []
    for layer in range(args.layers):
        ids, _ = ids_per_layer[layer]
        per_task = (ids[:, :, None].astype(np.int64) * g + np.arange(g)).reshape(n_tasks, -1)  # [T, k*g]
        seq_of_task = np.repeat(np.arange(B), H)
        tok_idx.append(torch.from_numpy(per_task + (seq_of_task * N)[:, None]))
    head_of_task = torch.from_numpy(np.tile(np.arange(H), B))
    q_t = torch.from_numpy(q).view(B * H, r, D)

    def torch_attend() -> None:
        layer = next_layer()
        idx = tok_idx[layer]  # [T, S]
        kk = torch.stack([torch_k[layer][head_of_task[t]].index_select(0, idx[t]) for t in range(n_tasks)])
        vv = torch.stack([torch_v[layer][head_of_task[t]].index_select(0, idx[t]) for t in range(n_tasks)])
        logits = torch.matmul(q_t, kk.float().transpose(1, 2)) * scale  # [T, r, S]
        lse_t = torch.logsumexp(logits, -1)
        torch.matmul(torch.softmax(logits, -1), vv.float()), lse_t

    t_torch = timed(torch_attend, max(3, args.repeats // 4))

    # sanity: native result matches torch on one layer
    layer = 0
    ids, counts = ids_per_layer[layer]
    native.sparse_attention(store.view(layer), q, tasks, ids, counts, scale, out=out, lse=lse)
    idx = tok_idx[layer]
    kk = torch.stack([torch_k[layer][head_of_task[t]].index_select(0, idx[t]) for t in range(n_tasks)]).float()
    vv = torch.stack([torch_v[layer][head_of_task[t]].index_select(0, idx[t]) for t in range(n_tasks)]).float()
    ref = torch.softmax(torch.matmul(q_t, kk.transpose(1, 2)) * scale, -1) @ vv
    max_err = float((torch.from_numpy(out) - ref).abs().max())

    result["torch_attention"] = {"GBps": gbs(kv_bytes, t_torch), "ms": t_torch * 1e3,
                                 "native_speedup": t_torch / t_attn}
    result["native_vs_torch_max_abs_err"] = max_err
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,all", help="comma list; 'all' = physical cores")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--g", type=int, default=64, help="granularity of the attention / gather selection")
    p.add_argument("--topk-g", type=int, default=16, help="granularity scanned by the top-k benchmark")
    p.add_argument("--budget", type=float, default=0.1, help="fraction of blocks selected")
    p.add_argument("--repeats", type=int, default=30, help="calls per timing (median)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of ceiling + kernels (median)")
    p.add_argument("--probe-mib", type=int, default=1024, help="size of the read-bandwidth buffer")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/kernels-<host>.json)")
    p.add_argument("--simd", default="",
                   help="comma list of SIMD paths: the attention is timed on each in turn within every round, the "
                        "other kernels on the first ('' = the current setting: FLUXION_SIMD or auto)")
    p.add_argument("--q-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="values of q: random fp32, or rounded to bf16 values as a bf16 model's q")
    p.add_argument("--decode-batches", default="1,8",
                   help="decode cases after the main one: comma list of batch sizes ('' = none)")
    p.add_argument("--decode-budget", type=float, default=0.05, help="fraction of blocks selected in decode cases")
    p.add_argument("--decode-layers", type=int, default=12,
                   help="layers of the decode-case store (rotating; enough that a cycle exceeds the LLC)")
    args = p.parse_args()
    args.torch_baseline = True
    cores = native.physical_cores()
    thread_list = [cores if t == "all" else int(t) for t in args.threads.split(",")]
    simd_list = [x.strip() for x in args.simd.split(",") if x.strip()] or [native.get_simd()]
    probe_buf = np.ones(args.probe_mib << 20, np.uint8)

    cases = [args]
    for b in (int(x) for x in args.decode_batches.split(",") if x.strip()):
        case = argparse.Namespace(**vars(args))
        case.batch, case.budget, case.torch_baseline = b, args.decode_budget, False
        case.layers = args.layers if b == args.batch else args.decode_layers  # batch-1: reuse the main store
        cases.append(case)

    rows = []
    store = None
    built_for: tuple[int, int] | None = None
    for ci, case in enumerate(cases):
        if built_for != (case.batch, case.layers):
            store = torch_k = torch_v = None  # free the previous store first
            t0 = time.perf_counter()
            store, slots, torch_k, torch_v = build_store(case)
            built_for = (case.batch, case.layers)
            print(f"\nstore: {case.layers} layers x {case.batch} seq x {case.tokens} tokens, "
                  f"{store.bytes_used / 2**30:.2f} GiB (built in {time.perf_counter() - t0:.1f}s); Hkv={case.kv_heads} "
                  f"r={case.group} D={case.head_dim} bf16, g={case.g}, physical cores={cores}", flush=True)
        name = "main" if ci == 0 else f"decode-b{case.batch}"
        for threads in thread_list:
            res = run(case, threads, store, slots, torch_k, torch_v, probe_buf, simd_list)
            res["case"] = name
            rows.append(res)
            print(f"\n[{name}] batch={case.batch} budget={case.budget:.0%} threads={threads} simd={res['simd']}  "
                  f"measured read bandwidth {res['read_GBps']:.1f} GB/s, fixed cost {res['fixed_call_us']:.0f} us/call")
            print(f"  {'kernel':<22}{'GB/s':>8}{'ms/call':>10}{'of read bw':>12}")
            for kernel in ("sparse_attention", "blocks_read", "topk", "gather", "gather_cached_stores"):
                r = res[kernel]
                extra = f"   (read+write {r['traffic_GBps']:.1f} GB/s)" if "traffic_GBps" in r else ""
                if "ratio_to_blocks_read" in r:
                    extra = f"   ({r['ratio_to_blocks_read']:.0%} of block read)"
                print(f"  {kernel:<22}{r['GBps']:>8.1f}{r['ms']:>10.3f}{r['ratio_to_read']:>11.0%}{extra}")
                if kernel == "sparse_attention" and len(simd_list) > 1:
                    for path, a in res["sparse_attention_by_simd"].items():
                        print(f"    {'on ' + path:<20}{a['GBps']:>8.1f}{a['ms']:>10.3f}{a['ratio_to_read']:>11.0%}"
                              f"   ({a['ratio_to_blocks_read']:.0%} of block read)")
            if "torch_attention" in res:
                tr = res["torch_attention"]
                print(f"  {'torch index_select+mm':<22}{tr['GBps']:>8.1f}{tr['ms']:>10.3f}   native is "
                      f"{tr['native_speedup']:.1f}x faster (max |diff| {res['native_vs_torch_max_abs_err']:.1e})",
                      flush=True)

    host = platform.node() or "host"
    out = Path(args.out) if args.out else RESULTS / f"kernels-{host}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "host": host, "cpu": _cpu_name(), "physical_cores": cores, "torch": torch.__version__,
        "config": vars(args), "results": rows,
    }
    out.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {out}")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
