"""Where full attention looks at the token where a sparse mode's RULER answer parts from full's.

For each loss that `research/ruler_diverge.py --out` recorded (or the ones named with --samples), the prompt plus the
reference output up to the parting token is run through full attention (teacher-forced, in prefill chunks); at the
last position, the step that chose the parting token, each layer's attention probabilities are summed per KV group
(mean over its query heads) into regions of the prompt: the sink (first --sink tokens), the rest of the prompt head
(up to --head tokens: the system prompt and the task instruction), the needle blocks (--g-token blocks holding one of
the sample's answers), the window (last --window positions) and everything else. The table prints each region's
mean mass over layers and groups, and the blocks outside sink and window that hold the most mass (with their text).
Mass on the prompt head or on needle blocks the plan does not read says what a plan change must cover.

With --plan, the sample is also answered greedily under that fluxion plan (the engine on --device, pins and top-k
recorded as research/pin_trace.py does) up to the parting token; if that run writes full's prefix, the step that chose
the parting token is the one compared: per retrieval group, the share of full's mass between sink and window that
lies in the blocks the step read, the same mass of the streaming groups (read by none), and the heaviest blocks that
retrieval groups left unread.

Usage: python research/parting_mass.py --model qwen2.5-coder-0.5b --dir .ruler_ids \\
           --diverge bench/results/ruler_diverge_qwen2.5-coder-0.5b_32768_full_vs_devsel_a6afbd6.json \\
           --tasks niah_multivalue niah_multiquery --limit 2 --out bench/results/parting_mass_32768.json
       (add --plan models/qwen2.5-coder-0.5b.plan.json for the reads of the fluxion step at the parting token)
On a host without llama-cpp-python (the GPU host): write the token table where the tokenizer runs, with the same
--diverge / --tasks / --limit, then pass it there:
       python research/parting_mass.py --diverge D --tasks ... --write-token-table /tmp/tokens.json   (VM)
       python research/parting_mass.py --diverge D --tasks ... --token-table /tmp/tokens.json --device cuda  (GPU host)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the product benchmarks they build on
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ruler_diverge import answer_outputs  # noqa: E402
from ruler_split import load_ids, model_tag  # noqa: E402
from token_table import TokenTable, export_table  # noqa: E402

from fluxion_lite.model.attention import DenseAttention, SeqChunk, causal_attention  # noqa: E402

# tail: the prompt's last --tail tokens that have left the recent window by this step (the question and the answer's
# lead-in sit there; pins cannot take them, since they were in the window at the first decode step)
REGIONS = ("sink", "head", "needles", "window", "rest", "tail")


class LastRowMass(DenseAttention):
    """Full attention that also keeps, for the sequence's position `target`, each layer's attention probabilities
    per KV group (mean over the group's query heads): mass[layer] [Hkv, target + 1] fp32 on the host."""

    def __init__(self, *args: Any, target: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.target = target
        self.mass: dict[int, torch.Tensor] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: list[SeqChunk]) -> torch.Tensor:
        (c,) = chunks  # one sequence, prefill chunks only
        keys, values = self.cache.append(layer, c.seq_id, c.start, k, v)  # [Hkv, L, D]
        if c.start <= self.target < c.start + c.length:
            row = q[self.target - c.start].float()  # [Hq, D]
            hkv = keys.shape[0]
            qg = row.view(hkv, -1, row.shape[-1])  # [Hkv, r, D]
            kk = keys[:, : self.target + 1].float()  # [Hkv, L, D]
            p = torch.softmax(torch.einsum("hrd,hld->hrl", qg, kk) * self.scale, dim=-1)  # [Hkv, r, L]
            self.mass[layer] = p.mean(1).cpu()
        return causal_attention(q, keys, values, c.start, self.scale)


def _find(ids: list[int], pattern: list[int]) -> list[int]:
    """Start positions of `pattern` in `ids`."""
    n = len(pattern)
    return [i for i in range(len(ids) - n + 1) if ids[i : i + n] == pattern] if n else []


def answer_variants(answers: list[str]) -> list[str]:
    """The texts an answer is looked for as: with and without a leading space (they tokenise differently)."""
    return [v for ans in answers for v in (ans, " " + ans)]


def needle_blocks(prompt: list[int], answers: list[str], tok: Any, g: int) -> set[int]:
    """g-token blocks of the prompt holding an answer's tokens (any of its answer_variants)."""
    blocks: set[int] = set()
    for variant in answer_variants(answers):
        pattern = tok.encode(variant, add_special=False)
        for start in _find(prompt, pattern):
            blocks.update(range(start // g, (start + len(pattern) - 1) // g + 1))
    return blocks


def regions(mass: torch.Tensor, n_prompt: int, needles: set[int], args: argparse.Namespace) -> dict[str, float]:
    """mass [L+1] of one group -> share per region (sink / head / needles / window / rest / tail)."""
    n = mass.shape[0]
    label = torch.full((n,), 4, dtype=torch.long)  # rest
    pos = torch.arange(n)
    for b in needles:
        label[b * args.g : min(n, (b + 1) * args.g)] = 2
    label[(pos >= n_prompt - args.tail) & (pos < n_prompt)] = 5
    label[pos < min(args.head, n_prompt)] = 1
    label[pos < args.sink] = 0
    label[pos >= n - args.window] = 3
    return {name: float(mass[label == i].sum()) for i, name in enumerate(REGIONS)}


def middle_masks(n: int, read: set[int], g: int, sink: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For n positions: (between the sink and the window, inside one of the g-token blocks `read`), bool [n] each."""
    pos = torch.arange(n)
    in_read = torch.zeros(n, dtype=torch.bool)
    for b in read:
        in_read[b * g : min(n, (b + 1) * g)] = True
    return (pos >= sink) & (pos < n - window), in_read


def read_split(mass: torch.Tensor, read: set[int], g: int, sink: int, window: int) -> tuple[float, float]:
    """mass [L+1] of one group -> (its mass between the sink and the window, the part of that in the g-token blocks
    `read`)."""
    middle, in_read = middle_masks(mass.shape[0], read, g, sink, window)
    return float(mass[middle].sum()), float(mass[middle & in_read].sum())


def plan_reads(engine: Any, rec: Any, plan: Any, prompt: list[int], reference: list[int], p: int,
               mass: dict[int, torch.Tensor], tokens: list[int], needles: set[int], tok: Any, top: int,
               ) -> dict[str, Any]:
    """Answer the prompt greedily under the engine's fluxion plan for p + 1 tokens and compare the reads of the step
    that chose token p (decode step p - 1: token 0 comes from the prefill) with full's mass at that position."""
    from fluxion_lite.engine.sampling import SamplingParams

    rec.clear()
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=p + 1))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out.extend(o.new_token_ids)
    if p < 1 or out[:p] != reference[:p] or len(rec.steps) < p:
        return {"reproduced": False, "plan_output_ids": out}  # another prefix here: not the same parting step
    reads = rec.steps[p - 1]
    plan_next = out[p] if len(out) > p else None  # the plan's token at the parting step
    g = next(gp.g for row in plan.groups for gp in row if not gp.streaming)
    retrieval = [(lay, h) for lay, row in enumerate(plan.groups) for h, gp in enumerate(row) if not gp.streaming]
    streaming = [(lay, h) for lay, row in enumerate(plan.groups) for h, gp in enumerate(row) if gp.streaming]
    split = {key: read_split(mass[key[0]][key[1]], reads.get(key, set()), g, plan.sink, plan.window)
             for key in retrieval}
    n = len(tokens)
    nb = -(-n // g)
    unread = torch.zeros(nb * g)  # mass between sink and window that a retrieval group did not read, summed
    for lay, h in retrieval:
        middle, in_read = middle_masks(n, reads.get((lay, h), set()), g, plan.sink, plan.window)
        unread[:n] += mass[lay][h] * (middle & ~in_read)
    unread = unread.view(nb, g).sum(1) / len(retrieval)
    heavy = [b for b in unread.argsort(descending=True).tolist() if unread[b] > 0][:top]
    middle = sum(mid for mid, _ in split.values())
    return {"reproduced": True, "plan_next": tok.decode([plan_next]) if plan_next is not None else None,
            "retrieval_middle_mass": middle / len(split),  # mean over retrieval groups
            "retrieval_read_share": sum(rd for _, rd in split.values()) / middle if middle else 0.0,
            "streaming_middle_mass": (sum(read_split(mass[lay][h], set(), g, plan.sink, plan.window)[0]
                                          for lay, h in streaming) / len(streaming)) if streaming else 0.0,
            "needle_blocks_read_by": {b: sum(b in reads.get(key, set()) for key in retrieval) for b in sorted(needles)},
            "retrieval_groups": len(retrieval),
            "heaviest_unread": [{"block": b, "mass": float(unread[b]), "needle": b in needles,
                                 "text": tok.decode(tokens[b * g : (b + 1) * g])} for b in heavy]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dir", default=".ruler_ids")
    ap.add_argument("--diverge", type=Path, required=True, help="a research/ruler_diverge.py --out file")
    ap.add_argument("--tasks", nargs="*", default=None, help="only losses of these tasks")
    ap.add_argument("--limit", type=int, default=None, help="at most this many losses")
    ap.add_argument("--sink", type=int, default=16)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--head", type=int, default=64, help="prompt tokens counted as the head (system + instruction)")
    ap.add_argument("--tail", type=int, default=128,
                    help="prompt tokens counted as the tail (question + answer lead-in) once out of the window")
    ap.add_argument("--g", type=int, default=16, help="block size of needle blocks and of the top-block list")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--plan", type=Path, default=None, help="also compare the reads of this fluxion plan's step")
    ap.add_argument("--token-table", type=Path, default=None,
                    help="decode / find answers with this bench/token_table.py file instead of llama-cpp-python "
                         "(the GPU host has none)")
    ap.add_argument("--write-token-table", type=Path, default=None,
                    help="write the token table the chosen losses need (run where the tokenizer is), then stop")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from fluxion_lite.hub.resolve import resolve_model
    from fluxion_lite.model.gguf_loader import load_gguf, read_metadata
    from fluxion_lite.model.transformer import Transformer
    from fluxion_lite.offline.teacher_forcing import teacher_forced_logits
    from fluxion_lite.model.tokenizer import Tokenizer

    try:
        div = json.loads(args.diverge.read_text())
        length, losses = div["length"], div["losses"]
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"error: {args.diverge}: not a research/ruler_diverge.py output ({e})")
    chosen = [x for x in losses if not args.tasks or x["task"] in args.tasks][: args.limit]
    if not chosen:
        sys.exit(f"error: {args.diverge} has no losses of tasks {args.tasks}")
    tag = model_tag(args.model)
    meta, prompts = load_ids(Path(args.dir) / f"{tag}_{length}.json", Path(args.dir) / f"{tag}_{length}.ids.xz")
    reference = answer_outputs(div["reference"], length)
    index = {(s["task"], s["index"]): k for k, s in enumerate(meta["samples"])}
    path = resolve_model(args.model)
    if args.token_table is not None:
        try:
            tok: Any = TokenTable.load(args.token_table)
        except ValueError as e:
            sys.exit(f"error: --token-table: {e}")
    else:
        tok = Tokenizer(path, read_metadata(path)[0])
    if args.write_token_table is not None:
        texts = answer_variants([a for x in chosen
                                 for a in meta["samples"][index[(x["task"], x["index"])]]["answers"]])
        args.write_token_table.write_text(json.dumps(export_table(tok, args.model, texts)))
        print(f"wrote {args.write_token_table} ({tok.vocab_size} pieces, {len(set(texts))} encodings)")
        return
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = Transformer(load_gguf(path, torch.float32), device, dtype)
    cfg = model.cfg
    engine = rec = plan = None
    if args.plan is not None:
        from pin_trace import Recorder

        from fluxion_lite.engine.engine import Engine
        from fluxion_lite.plan.sparse_plan import SparsePlan

        plan = SparsePlan.load(args.plan)
        if len({gp.g for row in plan.groups for gp in row if not gp.streaming}) != 1:
            sys.exit(f"error: --plan {args.plan}: needs one block size for every retrieval group")
        longest = max(len(prompts[index[(x["task"], x["index"])]]) + x["first_difference"] for x in chosen)
        engine = Engine(args.model, attention="full", device=args.device, dtype=args.dtype, max_batch=1,
                        max_context=longest + 8, prefill_chunk=args.chunk, prefix_cache_entries=0,
                        load_tokenizer=False)
        engine.set_attention("fluxion", plan)
        engine.eog_ids = frozenset(meta["eog_ids"])
        rec = Recorder()
    results = []
    for x in chosen:
        k = index[(x["task"], x["index"])]
        prompt, p = prompts[k], x["first_difference"]
        tokens = prompt + reference[k][:p]  # the shared output prefix: the last position chooses the parting token
        attn = LastRowMass(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, dtype, device, target=len(tokens) - 1)
        logits = teacher_forced_logits(model, attn, tokens, chunk=args.chunk, last_row_only=True)[-1]
        needles = needle_blocks(prompt, meta["samples"][k]["answers"], tok, args.g)
        per_layer = [[regions(attn.mass[layer][h], len(prompt), needles, args) for h in range(cfg.n_kv_heads)]
                     for layer in range(cfg.n_layers)]
        mean = {r: sum(g[r] for row in per_layer for g in row) / (cfg.n_layers * cfg.n_kv_heads) for r in REGIONS}
        total = torch.stack([attn.mass[layer] for layer in range(cfg.n_layers)]).mean((0, 1))  # [L+1]
        n = total.shape[0]
        nb = -(-n // args.g)
        blocks = torch.zeros(nb * args.g)
        blocks[:n] = total
        blocks = blocks.view(nb, args.g).sum(1)
        inner = [b for b in blocks.argsort(descending=True).tolist()
                 if b * args.g >= args.sink and (b + 1) * args.g <= n - args.window][: args.top]
        top = [{"block": b, "mass": float(blocks[b]), "needle": b in needles,
                "text": tok.decode(tokens[b * args.g : (b + 1) * args.g])} for b in inner]
        ref_next = reference[k][p] if p < len(reference[k]) else None
        # how decided full's choice is here: its token's logit over the best other token's (a small margin is a
        # near-tie that any small error in the sparse step can tip)
        lf = logits.float()
        chosen_id = ref_next if ref_next is not None else int(lf.argmax())
        others = lf.clone()
        others[chosen_id] = float("-inf")
        runner_up = int(others.argmax())
        results.append({"task": x["task"], "index": x["index"], "parting_token": p, "tokens": len(tokens),
                        "full_next": tok.decode([ref_next]) if ref_next is not None else None,
                        "argmax_next": tok.decode([int(logits.argmax())]), "regions": mean,
                        "logit_margin": float(lf[chosen_id] - lf[runner_up]), "runner_up": tok.decode([runner_up]),
                        "full_next_prob": float(lf.softmax(-1)[chosen_id]),
                        "needle_blocks": sorted(needles), "top_blocks": top})
        print(f"{x['task']} #{x['index']}: parting at output token {p} (full writes {results[-1]['full_next']!r}, "
              f"this forward's argmax {results[-1]['argmax_next']!r}, margin {results[-1]['logit_margin']:.2f} "
              f"over {results[-1]['runner_up']!r}, p {results[-1]['full_next_prob']:.2f}); mass "
              + ", ".join(f"{r} {mean[r]:.3f}" for r in REGIONS) + f"; {len(needles)} needle blocks")
        for t in top:
            print(f"    block {t['block']:5d} mass {t['mass']:.4f}{' needle' if t['needle'] else '       '} "
                  f"{t['text'][:80]!r}")
        if engine is not None:
            r = plan_reads(engine, rec, plan, prompt, reference[k], p, attn.mass, tokens, needles, tok, args.top)
            results[-1]["plan_reads"] = r
            if not r["reproduced"]:
                print(f"  plan {args.plan.name}: this run's output parts from full's before token {p} "
                      f"({tok.decode(r['plan_output_ids'])!r}): no step to compare")
                continue
            print(f"  plan {args.plan.name}, the parting step (writes {r['plan_next']!r}): retrieval groups hold "
                  f"{r['retrieval_middle_mass']:.3f} "
                  f"of full's mass between sink and window and read {r['retrieval_read_share']:.0%} of it; "
                  f"streaming groups hold {r['streaming_middle_mass']:.3f} there (unread); needle blocks read by "
                  + ", ".join(f"{b}: {c}/{r['retrieval_groups']}" for b, c in r["needle_blocks_read_by"].items()))
            for t in r["heaviest_unread"]:
                print(f"    unread block {t['block']:5d} mass {t['mass']:.4f}{' needle' if t['needle'] else '       '} "
                      f"{t['text'][:80]!r}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"diverge": str(args.diverge), "length": length, "device": args.device,
                                        "dtype": args.dtype, "plan": str(args.plan) if args.plan else None,
                                        "args": {k: v for k, v in vars(args).items()
                                                 if isinstance(v, (int, str, list))},
                                        "results": results}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
