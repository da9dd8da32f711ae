"""Where a RULER needle's value went under a sparse plan: pinned, selected per step, or lost.

Answers chosen exported samples (bench/ruler_split.py export) one at a time, greedily, and records for every retrieval
group which blocks were pinned at prefill end and which blocks each decode step read (pins merged with the top-k).
Then, per sample: the model's output against the expected answer (decoded with the GGUF's tokenizer), the prompt
blocks that hold the answer's tokens, and per such block how many retrieval groups pinned it and the mean share of
decode steps that read it (with several block sizes in the plan: per answer token, each group's own block). A
value whose first block is pinned but whose later blocks are not shows as an output that is right up to the block
boundary. Where the output leaves the answer part-way, the step that produced the first wrong token is looked at:
in what share of groups did it read the block holding the token it should have copied.

`--oracle-pins` puts the answer's blocks into every group's pins in place of others (same count, same read): an
upper bound for the pin choice, to tell a value that was not read from one that was read and still lost.

  python research/pin_trace.py --plan models/qwen2.5-coder-0.5b.plan.json --length 4096 \
      --samples niah_single_3:1 niah_multikey_3:0 --out bench/results/pin_trace.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the product benchmarks they build on
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ruler_split import load_ids, model_tag  # noqa: E402

from fluxion_lite.plan import pins as pinned  # noqa: E402

from fluxion_lite.hostkv import native
from fluxion_lite.engine.engine import Engine  # noqa: E402
from fluxion_lite.hub.resolve import resolve_model  # noqa: E402
from fluxion_lite.model.gguf_loader import read_metadata  # noqa: E402
from fluxion_lite.engine.sampling import SamplingParams  # noqa: E402
from fluxion_lite.plan.sparse_plan import SparsePlan  # noqa: E402
from fluxion_lite.model.tokenizer import Tokenizer  # noqa: E402


class Recorder:
    """Keeps the last sequence's pins and per-step reads, by wrapping (class- and module-wide) PinnedBlocks._store,
    PinnedBlocks.table and the native top-k's entry points: native.group_topk (the eager step) and
    PreparedSelection.topk / .select_attend (the graphed step). The native top-k merges the pins into its selection
    (fluxion.h, PINNED BLOCKS), so its ids are the blocks read; table() is called with the same task table just before
    and tells each task row's layer."""

    def __init__(self) -> None:
        self.pins: dict[int, list[set[int]]] = {}  # layer -> per KV group
        self.steps: list[dict[tuple[int, int], set[int]]] = []  # per decode step: (layer, group) -> blocks read
        self._last_layer = -1  # layers come in order within a step: a layer not above the last one starts a step
        self._table: tuple[np.ndarray, np.ndarray] | None = None  # the last table() call: tasks, each row's layer
        # --oracle-pins: (plan, answer span [lo, hi) in prompt positions); each group's pins then hold the answer's
        # blocks first, as many as it pins anyway (an upper bound for the pin choice at the same read, not a method)
        self.oracle: tuple[SparsePlan, tuple[int, int]] | None = None
        store, table = pinned.PinnedBlocks._store, pinned.PinnedBlocks.table
        group_topk = native.group_topk
        topk, select_attend = native.PreparedSelection.topk, native.PreparedSelection.select_attend

        def recording_store(blocks: pinned.PinnedBlocks, layer: int, slot: int, pins: list[np.ndarray]) -> None:
            if self.oracle is not None:
                pins = self._oracle_pins(layer, pins)
            self.pins[layer] = [set(p.tolist()) for p in pins]
            store(blocks, layer, slot, pins)

        def recording_table(blocks: pinned.PinnedBlocks, layer: int | np.ndarray,
                            tasks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            self._table = (tasks.copy(), np.broadcast_to(np.asarray(layer), (len(tasks),)).copy())
            return table(blocks, layer, tasks)

        def recording_group_topk(view: Any, q: Any, tasks: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
            ids, scores, counts = group_topk(view, q, tasks, *args, **kwargs)
            self._record(np.asarray(tasks), ids, counts)
            return ids, scores, counts

        def recording_topk(sel: native.PreparedSelection, view: Any, lo: int, hi: int, *args: Any,
                           **kwargs: Any) -> None:
            topk(sel, view, lo, hi, *args, **kwargs)
            self._record(sel.tasks[lo:hi], sel.ids[lo:hi], sel.counts[lo:hi], lo, sel.tasks)

        def recording_select_attend(sel: native.PreparedSelection, view: Any, lo: int, hi: int, *args: Any,
                                    **kwargs: Any) -> tuple[int, float, float]:
            out = select_attend(sel, view, lo, hi, *args, **kwargs)
            self._record(sel.tasks[lo:hi], sel.ids[lo:hi], sel.counts[lo:hi], lo, sel.tasks)
            return out

        pinned.PinnedBlocks._store = recording_store  # type: ignore[method-assign]
        pinned.PinnedBlocks.table = recording_table  # type: ignore[method-assign]
        native.group_topk = recording_group_topk
        native.PreparedSelection.topk = recording_topk  # type: ignore[method-assign]
        native.PreparedSelection.select_attend = recording_select_attend  # type: ignore[method-assign]

    def _record(self, tasks: np.ndarray, ids: np.ndarray, counts: np.ndarray, lo: int = 0,
                whole: np.ndarray | None = None) -> None:
        """One top-k call's selections (task rows tasks, of a table `whole` from row lo on). Calls whose task table
        did not go through table() just before (a layer without pins) have no known layer and are not recorded."""
        whole = tasks if whole is None else whole
        if self._table is None or not np.array_equal(self._table[0], whole) or not len(tasks):
            return
        layer = int(self._table[1][lo])
        if layer <= self._last_layer or not self.steps:
            self.steps.append({})
        self._last_layer = layer
        for i in range(len(tasks)):
            self.steps[-1][(layer, int(tasks[i, 2]))] = set(ids[i, : counts[i]].tolist())

    def _oracle_pins(self, layer: int, pins: list[np.ndarray]) -> list[np.ndarray]:
        """The group's pins with the answer's blocks (its own g) put in place of others: same count, ascending."""
        assert self.oracle is not None
        plan, (lo, hi) = self.oracle
        out = []
        for h, p in enumerate(pins):
            g = plan.groups[layer][h].g
            answer = list(range(lo // g, (hi - 1) // g + 1))
            rest = [int(b) for b in p if int(b) not in answer]
            keep = (answer + rest)[: len(p)]
            out.append(np.asarray(sorted(keep), dtype=p.dtype))
        return out

    def clear(self) -> None:
        self.pins.clear()
        self.steps.clear()
        self._last_layer = -1
        self._table = None


def token_span(tok: Tokenizer, ids: list[int], text: str) -> tuple[int, int] | None:
    """Token positions [start, end) of the first occurrence of text in the prompt (by per-token decoding)."""
    pieces = [tok.decode([t]) for t in ids]
    starts = np.cumsum([0] + [len(p) for p in pieces])
    at = "".join(pieces).find(text)
    if at < 0:
        return None
    return int(np.searchsorted(starts, at, side="right") - 1), int(np.searchsorted(starts, at + len(text)))


def coverage(rec: Recorder, groups: list[tuple[int, int, int]], position: int,
             steps: list[dict[tuple[int, int], set[int]]] | None = None) -> tuple[int, float]:
    """How many of the groups (layer, KV group, g) pinned the block holding prompt position `position` (each group
    its own g), and the mean over groups of the share of `steps` (default: all decode steps) that read it."""
    steps = rec.steps if steps is None else steps
    pinned_in = sum(position // g in (rec.pins.get(layer) or [set()] * (h + 1))[h] for layer, h, g in groups)
    read = [np.mean([position // g in step.get((layer, h), set()) for step in steps]) if steps else 0.0
            for layer, h, g in groups]
    return int(pinned_in), round(float(np.mean(read)), 3)


def first_wrong(tok: Tokenizer, rec: Recorder, groups: list[tuple[int, int, int]], ids: list[int],
                span: tuple[int, int], answer: str, pieces: list[str]) -> dict[str, Any] | None:
    """Where the output first leaves the answer: the output token that does, the prompt position of the answer
    character it should have continued with, and the share of groups whose block holding that position the step
    producing the token read. Output token j (j >= 1) comes from decode step j - 1, whose query is token j - 1;
    token 0 comes from the prefill, which attends to everything. None when the output holds the whole answer; a
    note when not even its first 4 characters appear (another needle's value, say). pieces: the output's tokens,
    each decoded."""
    text = "".join(pieces)
    if answer in text:
        return None
    at = text.find(answer[:4])  # where the value starts in the output, if its first characters are right
    if at < 0:
        return {"output_token": None, "note": "the value is wrong from its first characters"}
    wrong = at + next((i for i, (a, b) in enumerate(zip(answer, text[at:])) if a != b), len(text) - at)
    ends = np.cumsum([len(p) for p in pieces])
    j = int(np.searchsorted(ends, wrong, side="right"))  # the output token holding character `wrong`
    char = wrong - at  # the answer character it should have been
    prompt_text = [tok.decode([t]) for t in ids[span[0]:span[1]]]
    starts = np.cumsum([0] + [len(p) for p in prompt_text])
    lead = "".join(prompt_text).find(answer)
    position = span[0] + int(np.searchsorted(starts, lead + char, side="right") - 1)
    row: dict[str, Any] = {"output_token": j, "output_text": pieces[j] if j < len(pieces) else "",
                           "expected_at": position - span[0], "expected_text": tok.decode([ids[position]])}
    if 1 <= j <= len(rec.steps):
        pinned_in, read = coverage(rec, groups, position, [rec.steps[j - 1]])
        row |= {"groups_pinned": pinned_in, "share_of_groups_read": read}
    return row


def trace(engine: Engine, tok: Tokenizer, rec: Recorder, plan: SparsePlan, sample: dict[str, Any], ids: list[int],
          min_budget: float, oracle: bool = False) -> dict[str, Any]:
    rec.clear()
    answer = sample["answers"][0]
    span = token_span(tok, ids, answer)
    rec.oracle = (plan, span) if oracle and span is not None else None
    engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=sample["max_new_tokens"]))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out.extend(o.new_token_ids)
    kept = [t for t in out if t not in engine.eog_ids]
    result: dict[str, Any] = {"task": sample["task"], "index": sample["index"], "answer": answer,
                              "output": tok.decode(kept), "output_tokens": [tok.decode([t]) for t in kept]}
    if span is None:
        return result
    groups = [(layer, h, gp.g) for layer, row in enumerate(plan.groups) for h, gp in enumerate(row)
              if not gp.streaming and gp.budget >= min_budget]
    sizes = {g for _, _, g in groups}
    if len(sizes) == 1:  # one block size: the answer's blocks, as before
        block = sizes.pop()
        per_block = []
        for b in range(span[0] // block, (span[1] - 1) // block + 1):
            lo, hi = max(b * block, span[0]), min((b + 1) * block, span[1])
            pinned_in, read = coverage(rec, groups, lo)
            per_block.append({"block": b, "answer_tokens": [lo - span[0], hi - span[0]],
                              "answer_text": tok.decode(ids[lo:hi]), "groups_pinned": pinned_in,
                              "mean_share_of_steps_read": read})
        result["blocks"] = per_block
    else:  # several block sizes: per answer token, each group's own block holding it
        result["tokens"] = [{"token": t - span[0], "text": tok.decode([ids[t]]),
                             **dict(zip(("groups_pinned", "mean_share_of_steps_read"), coverage(rec, groups, t)))}
                            for t in range(*span)]
    result |= {"answer_positions": list(span), "groups": len(groups),
               "first_wrong": first_wrong(tok, rec, groups, ids, span, answer, result["output_tokens"])}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dir", default=".ruler_ids", help="exported samples (ruler_split.py export)")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--plan", nargs="+", required=True, help="plan files (pin_fraction > 0)")
    ap.add_argument("--samples", nargs="+", required=True, help="task:index, e.g. niah_single_3:1")
    ap.add_argument("--min-budget", type=float, default=0.03, help="count only retrieval groups with this budget")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--oracle-pins", action="store_true",
                    help="each group pins the answer's blocks in place of others (same pin count and read): does "
                         "pinning the value everywhere fix the answer?")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tag = model_tag(args.gguf)
    meta, prompts = load_ids(Path(args.dir) / f"{tag}_{args.length}.json", Path(args.dir) / f"{tag}_{args.length}.ids.xz")
    where = {(s["task"], s["index"]): k for k, s in enumerate(meta["samples"])}
    picks = []
    for item in args.samples:
        task, _, index = item.partition(":")
        if not index.isdigit() or (task, int(index)) not in where:
            sys.exit(f"error: --samples {item!r}: no such exported sample at {args.length}")
        picks.append(where[(task, int(index))])
    path = resolve_model(args.gguf)
    tok = Tokenizer(path, read_metadata(path)[0])
    engine = Engine(args.gguf, attention="full", device="cpu", dtype=args.dtype, max_batch=1,
                    max_context=args.length, prefill_chunk=1024, prefix_cache_entries=0, load_tokenizer=False)
    engine.eog_ids = frozenset(meta["eog_ids"])
    rec = Recorder()
    results: dict[str, Any] = {"length": args.length, "dtype": args.dtype, "plans": {}}
    for plan_path in args.plan:
        plan = SparsePlan.load(Path(plan_path))
        if not plan.pin_fraction:
            sys.exit(f"error: {plan_path}: pin_fraction is 0, nothing is pinned")
        engine.set_attention("fluxion", plan)
        rows = results["plans"][Path(plan_path).name] = []
        for k in picks:
            r = trace(engine, tok, rec, plan, meta["samples"][k], prompts[k], args.min_budget, args.oracle_pins)
            rows.append(r)
            print(f"[{Path(plan_path).name}] {r['task']}:{r['index']} answer {r['answer']!r} output {r['output']!r}")
            for b in r.get("blocks", []):
                print(f"   block {b['block']:>4} {b['answer_text']!r:<24} pinned in {b['groups_pinned']:>2}/{r['groups']} "
                      f"groups, read on {b['mean_share_of_steps_read']:.0%} of steps (mean)", flush=True)
            for t in r.get("tokens", []):
                print(f"   token {t['token']:>3} {t['text']!r:<8} pinned in {t['groups_pinned']:>2}/{r['groups']} "
                      f"groups, read on {t['mean_share_of_steps_read']:.0%} of steps (mean)", flush=True)
            if r.get("first_wrong") and r["first_wrong"]["output_token"] is not None:
                w = r["first_wrong"]
                print(f"   first wrong: output token {w['output_token']} {w['output_text']!r} for answer token "
                      f"{w['expected_at']} {w['expected_text']!r}; its step read that token's block in "
                      f"{w.get('share_of_groups_read', float('nan')):.0%} of groups "
                      f"({w.get('groups_pinned', '-')} pinned)", flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
