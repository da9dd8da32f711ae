"""RULER split across two machines: prompts are tokenised here, answered on a GPU host that has no tokenizer, scored here.

The GPU host we measure on lacks llama-cpp-python, so it cannot tokenise. The three steps:

  export  (here)      generate the samples exactly as bench/ruler.py does (same generator, seeds and chat template),
                      write <dir>/<model>_<length>.json (answers, metrics, budgets) and .ids.xz (the prompts' token ids,
                      int32, LZMA: the haystacks repeat across samples, so 260 32K-token prompts pack into a few MB)
  answer  (GPU host)  load the GGUF without a tokenizer and answer every sample greedily in each mode; all samples of
                      a length go into the engine at once (continuous batching), so a mode costs a few batched decodes;
                      writes answers.json: output token ids per (mode, length, sample) + the backend's sparse counters
  score   (here)      detokenise, score by substring match, print bench/ruler.py's tables, write
                      bench/results/ruler_<model>_<length>.json (same schema, plus "machine_answered")

Usage:
  python bench/ruler_split.py export --model qwen2.5-coder-0.5b --lengths 4096 8192 --samples 20 --dir .ruler_ids
  python bench/ruler_split.py answer --gguf model.gguf --dir .ruler_ids --modes full fixed fluxion --device cuda \
      --out answers.json
  python bench/ruler_split.py score --model qwen2.5-coder-0.5b --dir .ruler_ids --answers answers.json
"""
from __future__ import annotations

import argparse
import json
import lzma
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def model_tag(model: str) -> str:
    """File-name tag of a model: a catalog name as is, a GGUF path without directory and suffix."""
    return Path(model).stem if model.endswith(".gguf") else Path(model).name


def _paths(directory: Path, tag: str, length: int) -> tuple[Path, Path]:
    return directory / f"{tag}_{length}.json", directory / f"{tag}_{length}.ids.xz"


# ---- export (needs the tokenizer) -----------------------------------------------------------------------------------
def export(args: argparse.Namespace) -> None:
    from fluxion_lite.hub.resolve import resolve_model
    from fluxion_lite.model.gguf_loader import read_metadata
    from fluxion_lite.offline.ruler import TASKS, chat_prompt, generate_sample
    from fluxion_lite.model.tokenizer import Tokenizer

    path = resolve_model(args.model)
    metadata, _ = read_metadata(path)
    tok = Tokenizer(path, metadata)
    render = chat_prompt(tok.apply_chat_template)
    count = lambda text: len(tok.encode(text, add_special=True))  # noqa: E731
    tasks = list(TASKS) if args.tasks == ["all"] else args.tasks
    out_dir = Path(args.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for length in args.lengths:
        t0 = time.perf_counter()
        meta: list[dict[str, Any]] = []
        ids: list[np.ndarray] = []
        for task in tasks:
            for i in range(args.samples):
                s = generate_sample(task, length, i, count, render, args.seed)
                tokens = np.asarray(tok.encode(s.prompt, add_special=True), dtype=np.int32)
                ids.append(tokens)
                meta.append({"task": s.task, "index": s.index, "seed": s.seed, "answers": list(s.answers),
                             "metric": s.metric, "prompt_tokens": int(len(tokens)),
                             "max_new_tokens": s.max_new_tokens})
        flat = np.concatenate(ids)
        meta_path, ids_path = _paths(out_dir, model_tag(args.model), length)
        ids_path.write_bytes(lzma.compress(flat.tobytes(), preset=9 | lzma.PRESET_EXTREME))
        meta_path.write_text(json.dumps({"model": args.model, "length": length, "seed": args.seed, "tasks": tasks,
                                         "samples_per_task": args.samples, "eog_ids": sorted(tok.eog_ids),
                                         "samples": meta}))
        print(f"{length}: {len(meta)} samples, {flat.size} tokens -> {ids_path.stat().st_size / 2**20:.1f} MiB "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)


def exported_samples(directory: str | Path, model: str, length: int) -> tuple[dict[str, Any], list[list[int]]]:
    """The samples `export` wrote for a model (catalog name or GGUF path) and length: (metadata, prompt ids), or
    exit naming the export command that makes them."""
    meta_path, ids_path = _paths(Path(directory), model_tag(model), length)
    if not meta_path.exists() or not ids_path.exists():
        sys.exit(f"error: {meta_path} / {ids_path} missing: run bench/ruler_split.py export --model {model} "
                 f"--lengths {length} --dir {directory}")
    return load_ids(meta_path, ids_path)


def picked_samples(meta: dict[str, Any], tasks: list[str] | None, per_task: int, model: str) -> list[int]:
    """Indices into meta["samples"] of the first `per_task` samples of each of `tasks` (every task if None), or exit
    naming what was asked for when there is none."""
    picked = [k for k, s in enumerate(meta["samples"])
              if (tasks is None or s["task"] in tasks) and s["index"] < per_task]
    if not picked:
        sys.exit(f"error: no sample of {tasks} among {model}'s exported samples at {meta['length']}")
    return picked


def load_ids(meta_path: Path, ids_path: Path) -> tuple[dict[str, Any], list[list[int]]]:
    meta = json.loads(meta_path.read_text())
    flat = np.frombuffer(lzma.decompress(ids_path.read_bytes()), dtype=np.int32)
    out, offset = [], 0
    for s in meta["samples"]:
        n = s["prompt_tokens"]
        out.append(flat[offset : offset + n].tolist())
        offset += n
    if offset != flat.size:
        raise ValueError(f"{ids_path}: {flat.size} token ids, the metadata accounts for {offset}")
    return meta, out


# ---- answer (GPU host: no tokenizer) --------------------------------------------------------------------------------
def _stats(engine: Any) -> dict[str, float]:
    stats = engine.stats()  # the backend's counters and the engine's step kinds (decode / mixed, graph captures)
    return {k: float(v) for k, v in (stats.sparse | stats.steps).items()}


def answer(args: argparse.Namespace) -> None:
    import torch

    from fluxion_lite.engine.engine import Engine
    from fluxion_lite.engine.sampling import SamplingParams

    sets = [p for p in sorted(Path(args.dir).glob(f"{args.tag or ''}*_*.json")) if p.with_suffix(".ids.xz").exists()]
    if args.lengths:
        sets = [p for p in sets if int(p.stem.rsplit("_", 1)[1]) in args.lengths]
    if not sets:
        sys.exit(f"error: no exported samples in {args.dir}")
    loaded = [load_ids(p, p.with_suffix(".ids.xz")) for p in sets]
    max_len = max(m["length"] for m, _ in loaded)
    t_load = time.perf_counter()
    engine = Engine(args.gguf, attention="full", device=args.device, dtype=args.dtype, max_batch=args.max_batch,
                    max_context=max_len, prefill_chunk=args.prefill_chunk, prefix_cache_entries=0,
                    load_tokenizer=False, predictor=args.predictor)
    print(f"model loaded in {time.perf_counter() - t_load:.0f} s", flush=True)
    if args.cpu_hooks:  # the decode steps through the backends' hooks, run as plain torch calls (decode_graphs)
        from fluxion_lite.model.cuda_graphs import DecodeGraphs

        if torch.device(args.device).type == "cuda":
            sys.exit("error: --cpu-hooks is for a CPU device (on CUDA the hooks are captured anyway)")
        engine.model.graphs = DecodeGraphs(engine.model, capture=False)
    results: dict[str, Any] = {"machine": platform.node(), "device": args.device, "dtype": args.dtype,
                               "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                               "cpu_hooks": bool(args.cpu_hooks), "runs": []}
    out = Path(args.out)
    from fluxion_lite.plan.sparse_plan import SparsePlan

    # fluxion with other plans (policy variants): run as modes named fluxion@<file stem>
    variants: list[tuple[str, str, SparsePlan | None]] = [(m, m, None) for m in args.modes]
    variants += [("fluxion", f"fluxion@{Path(p).stem}", SparsePlan.load(Path(p))) for p in args.plan]
    # Lengths outside, modes inside: a run cut short by a time limit still has every mode of the lengths it did.
    for meta, prompts in loaded:
        chosen = [k for k, s in enumerate(meta["samples"])
                  if (not args.tasks or s["task"] in args.tasks) and args.from_index <= s["index"]
                  and (args.per_task is None or s["index"] < args.per_task)]
        for mode, label, plan in variants:
            engine.set_attention(mode, plan)  # one model load serves every mode: only the attention backend changes
            engine.eog_ids = frozenset(meta["eog_ids"])
            engine.attn.reset_stats()
            engine.step_counters.reset(engine.model.graphs)
            t0 = time.perf_counter()
            ids_by_req: dict[str, int] = {}
            for k in chosen:
                s, ids = meta["samples"][k], prompts[k]
                rid = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=s["max_new_tokens"]))
                ids_by_req[rid] = k
            outputs: list[list[int]] = [[] for _ in prompts]
            finished: list[int] = []
            run: dict[str, Any] = {"mode": label + ("+predictor" if mode == "fluxion" and args.predictor else ""),
                                   "length": meta["length"], "model": meta["model"], "answered": finished,
                                   "partial": True, "outputs": outputs}
            results["runs"].append(run)
            steps, last_write = 0, t0
            while engine.has_unfinished():
                for o in engine.step():
                    outputs[ids_by_req[o.request_id]].extend(o.new_token_ids)
                    if o.finished:
                        finished.append(ids_by_req[o.request_id])
                steps += 1
                if steps % 50 == 0:  # progress: a slow run shows where the time goes before a time limit hits
                    print(f"  [{label} {meta['length']}] step {steps}: {len(finished)}/{len(chosen)} done, "
                          f"{len(engine.running)} running, {time.perf_counter() - t0:.0f} s", flush=True)
                if time.perf_counter() - last_write > args.checkpoint_s:  # a time limit still leaves what finished
                    run |= {"seconds": time.perf_counter() - t0, "sparse": _stats(engine)}
                    out.write_text(json.dumps(results))
                    last_write = time.perf_counter()
            seconds = time.perf_counter() - t0
            run |= {"answered": sorted(finished), "partial": False, "seconds": seconds, "sparse": _stats(engine)}
            print(f"[{label} {meta['length']}] {len(chosen)} samples in {seconds:.1f} s {run['sparse']}", flush=True)
            out.write_text(json.dumps(results))
    print(f"wrote {out}")


# ---- score (needs the tokenizer) -------------------------------------------------------------------------------------
def score(args: argparse.Namespace) -> None:
    from ruler import print_tables, summarise

    from fluxion_lite.hub.resolve import resolve_model
    from fluxion_lite.model.gguf_loader import read_metadata
    from fluxion_lite.offline.ruler import score_output
    from fluxion_lite.model.tokenizer import Tokenizer

    path = resolve_model(args.model)
    metadata, _ = read_metadata(path)
    tok = Tokenizer(path, metadata)
    answered = json.loads(Path(args.answers).read_text())
    tag = model_tag(args.model)
    by_length: dict[int, dict[str, Any]] = {}
    for run in answered["runs"]:
        length = run["length"]
        meta = json.loads(_paths(Path(args.dir), tag, length)[0].read_text())
        eog = set(meta["eog_ids"])
        records = []
        answered_ids = run.get("answered", range(len(meta["samples"])))  # older answer files: every sample
        if run.get("partial"):
            print(f"note: {run['mode']} at {length} was cut short: {len(answered_ids)} samples finished",
                  file=sys.stderr)
        if not answered_ids:
            continue
        for k in answered_ids:
            s, out_ids = meta["samples"][k], run["outputs"][k]
            kept = [t for t in out_ids if t not in eog]
            text = tok.decode(kept)
            records.append({"task": s["task"], "index": s["index"], "seed": s["seed"],
                            "prompt_tokens": s["prompt_tokens"], "score": score_output(text, s["answers"], s["metric"]),
                            "output": text, "answers": s["answers"],
                            # batched: a run's time and counters are per mode and length, shared by its samples
                            "seconds": run["seconds"] / len(answered_ids), "sparse": run["sparse"]})
        res = by_length.setdefault(length, {
            "model": args.model, "length": length, "samples_per_task": meta["samples_per_task"], "seed": meta["seed"],
            "tasks": meta["tasks"], "machine": "VM (scoring)", "machine_answered": answered.get("gpu") or
            answered.get("machine"), "device": answered.get("device"), "dtype": answered.get("dtype"), "modes": {}})
        res["modes"][run["mode"]] = summarise(records, meta["tasks"]) | {"records": records,
                                                                         "batch_seconds": run["seconds"],
                                                                         "partial": bool(run.get("partial"))}
    for length, res in sorted(by_length.items()):
        print_tables(length, res["tasks"], res["modes"])
        out = Path(args.out_dir) / f"ruler_{tag}_{length}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1))
        print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("--model", default="qwen2.5-coder-0.5b")
    e.add_argument("--lengths", type=int, nargs="+", default=[4096])
    e.add_argument("--samples", type=int, default=20)
    e.add_argument("--tasks", nargs="+", default=["all"])
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--dir", default=".ruler_ids")
    a = sub.add_parser("answer")
    a.add_argument("--gguf", required=True)
    a.add_argument("--dir", default=".ruler_ids")
    a.add_argument("--tag", default=None, help="model tag of the exported files (default: all in --dir)")
    a.add_argument("--lengths", type=int, nargs="*", default=None)
    a.add_argument("--modes", nargs="*", default=["full", "fixed", "fluxion"])
    a.add_argument("--device", default="cuda")
    a.add_argument("--dtype", default="bfloat16")
    a.add_argument("--max-batch", type=int, default=64)
    a.add_argument("--prefill-chunk", type=int, default=8192)
    a.add_argument("--out", default="answers.json")
    a.add_argument("--predictor", action="store_true", help="fluxion plans each request with the predictor")
    a.add_argument("--plan", nargs="*", default=[], help="also run fluxion with these plan files (fluxion@<stem>)")
    a.add_argument("--tasks", nargs="*", default=None, help="only these tasks (default: all)")
    a.add_argument("--per-task", type=int, default=None, help="only the first N samples of each task")
    a.add_argument("--from-index", type=int, default=0,
                   help="only samples whose index is at least this (a larger export answered beyond a smaller one's "
                        "samples; bench/ruler_paired.py pools the two runs)")
    a.add_argument("--cpu-hooks", action="store_true",
                   help="on a CPU device, run decode steps through the backends' decode hooks as the GPU's captured "
                        "steps do (uncaptured): with FLUXION_SELECTION=gpu FLUXION_ZERO_COPY=1, the device step's code")
    a.add_argument("--checkpoint-s", type=float, default=20.0,
                   help="rewrite --out this often during a run, with the samples finished so far (partial: true)")
    s = sub.add_parser("score")
    s.add_argument("--model", default="qwen2.5-coder-0.5b")
    s.add_argument("--dir", default=".ruler_ids")
    s.add_argument("--answers", required=True)
    s.add_argument("--out-dir", default="bench/results")
    args = ap.parse_args()
    {"export": export, "answer": answer, "score": score}[args.cmd](args)


if __name__ == "__main__":
    main()
