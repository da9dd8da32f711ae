"""While a RULER answer is copied out of its needle: which groups read the token being copied, under full attention
and under a plan's simulated selection.

The 1.5b's lost multikey_3 answers start with the asked UUID and turn into another part-way (docs/history.md, "Pins by
consensus"). This replays the reference answer (a `full` run's output ids) teacher-forced after the prompt in one
dense fp32 forward, and at every answer step j (the query at prompt_len - 1 + j, which produced output token j)
looks at each (layer, KV group):

  src mass   full attention (mean over the group's query heads) on the prompt token the output token copies
             (the answer's tokens aligned to the prompt: the offset where most of them match)
  read       whether the plan's selection at that step holds that token: sink + window (block-aligned to the group's
             g for retrieval groups), the pins (pinned.group_pins from the prompt's last obs_window queries, with
             pin_consensus when the plan has it) and the per-step top-k of the group-summed Quest bound over the rest
  dev, c     ||o_sparse - o_full|| / ||o_full|| of the group's heads under that selection, and the group's share of
             the layer's attention output (calibration.layer_errors' c)

Two what-ifs per retrieval group at the same block count (variant_masks): "oracle", the blocks with the most
full-attention mass; "sampled*", the top-k's weakest share swapped for an even sample of the unread blocks (weighted
by unread / sampled, or at weight 1). Each reports the sum over groups of c*d, mean over the answer's steps.

With --line i only the reference answer's i-th listed value is aligned (a multi-value answer copies each value
from another needle; lines split at newline tokens, short ones such as a lone ':' skipped), so src and read follow
that value's needle.

It prints, per sample, the step where a candidate run (another answers file) first leaves the reference, the groups
that attend most to the copied token there and whether the plan reads it, and per step the src-mass-weighted share
of groups that read it. A simulation in fp32 (the engine runs bf16, and its top-k takes the plan's summaries): it
tells which groups a copy leans on, not the engine's exact picks.

  python research/copy_heads.py --gguf qwen2.5-coder-1.5b --dir .ruler_ids --length 8192 \\
      --plan models/qwen2.5-coder-1.5b.plan.json \\
      --reference bench/results/ruler_answers_qwen2.5-coder-1.5b_8192_h200_a50dca1.json:full \\
      --candidate bench/results/ruler_answers_qwen2.5-coder-1.5b_8192_h200_curve_shipped_ac51e2e.json:fluxion@qwen2.5-coder-1.5b.plan \\
      --samples niah_multikey_3:4 niah_multikey_3:10 --out bench/results/copy_heads.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the product benchmarks they build on
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ruler_diverge import answer_outputs, first_difference  # noqa: E402
from ruler_split import exported_samples, model_tag  # noqa: E402

from fluxion_lite.plan import pins as pinned  # noqa: E402
from fluxion_lite.model.attention import SeqChunk  # noqa: E402
from fluxion_lite.plan.calibration import CaptureAttention  # noqa: E402
from fluxion_lite.engine.engine import Engine  # noqa: E402
from fluxion_lite.plan.sparse_plan import GroupPlan, SparsePlan  # noqa: E402


def copy_offset(prompt: list[int], out: list[int]) -> tuple[int, np.ndarray]:
    """The offset o where prompt[o + j] == out[j] for the most j, and those j's mask [len(out)]."""
    p, o = np.asarray(prompt), np.asarray(out)
    best, best_o = -1, 0
    for off in range(len(p) - len(o) + 1):
        hits = int((p[off : off + len(o)] == o).sum())
        if hits > best:
            best, best_o = hits, off
    return best_o, p[best_o : best_o + len(o)] == o


def answer_lines(out: list[int], newline_ids: set[int], min_tokens: int = 5) -> list[list[int]]:
    """The answer's lines, each as its list of step indices, split at tokens holding a newline; lines shorter than
    min_tokens (a lone ':' or a blank line before a numbered list) are left out, so line i is the i-th listed value."""
    lines, current = [], []
    for j, token in enumerate(out):
        if token in newline_ids:
            lines.append(current)
            current = []
        else:
            current.append(j)
    lines.append(current)
    return [line for line in lines if len(line) >= min_tokens]


def line_offset(prompt: list[int], out: list[int], steps: list[int]) -> tuple[int, np.ndarray]:
    """copy_offset for one line of the answer (its step indices `steps`): a multi-value answer copies each value from
    another place of the prompt. Returns the offset o with prompt[o + j] == out[j] for the most j of the line, and
    the mask [len(out)] of those j (False outside the line)."""
    off, hits = copy_offset(prompt, [out[j] for j in steps])
    copied = np.zeros(len(out), dtype=bool)
    copied[steps] = hits
    return off - steps[0], copied


def plan_blocks(plan: SparsePlan, gp: GroupPlan, n: int, bound: torch.Tensor, pins: np.ndarray
                ) -> tuple[int, int, set[int], list[int]]:
    """A retrieval group's blocks at a step with n tokens: (first, last) eligible block ids, its pins among them,
    and the per-step top-k by `bound` [n_blocks] over the eligible rest, best first (k less the pins)."""
    first, last = pinned.eligible_blocks(gp.g, n, plan.sink, plan.window)
    chosen = {int(b) for b in pins if first <= b < last}
    scores = bound[:last].clone()
    scores[:first] = float("-inf")
    if chosen:
        scores[torch.tensor(sorted(chosen))] = float("-inf")
    free = max(plan.block_count(gp, n) - len(chosen), 0)
    top = [int(b) for b in torch.argsort(scores, descending=True, stable=True)[:free] if scores[b] > float("-inf")]
    return first, last, chosen, top


def block_mask(n: int, g: int, sink_hi: int, win_lo: int, blocks: set[int] | list[int]) -> torch.Tensor:
    """Tokens [n]: [0, sink_hi), [win_lo, n) and the given blocks of g tokens."""
    pos = torch.arange(n)
    mask = (pos < sink_hi) | (pos >= win_lo)
    for b in blocks:
        mask[b * g : min((b + 1) * g, n)] = True
    return mask


def read_mask(plan: SparsePlan, gp: GroupPlan, n: int, bound: torch.Tensor | None, pins: np.ndarray,
              blocks: tuple[int, int, set[int], list[int]] | None = None) -> torch.Tensor:
    """Tokens [n] a step with n tokens reads for one group: exact sink + window for a streaming group (and a
    long-only one while its block count is 0 at this length unless its g-aligned ones apply), else the g-aligned
    sink + window, the pins and the best top-k blocks by `bound` [n_blocks] among the eligible rest (`blocks`:
    plan_blocks() of this step when the caller has it already)."""
    k = plan.block_count(gp, n)
    g = 1 if gp.streaming or (gp.long_only and plan.long_exact_stream and k == 0) else gp.g
    sink_hi, win_lo = pinned.aligned_sink_window(g, n, plan.sink, plan.window)
    if g == 1 or k == 0 or bound is None:
        return block_mask(n, g, sink_hi, win_lo, [])
    _, _, chosen, top = blocks if blocks is not None else plan_blocks(plan, gp, n, bound, pins)
    return block_mask(n, g, sink_hi, win_lo, chosen | set(top))


def variant_masks(plan: SparsePlan, gp: GroupPlan, n: int, probs: torch.Tensor, blocks: tuple[int, int, set[int],
                  list[int]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """What-ifs at the same block count for a retrieval group whose step reads the n keys before its own, each as
    (mask [n], logit bias [n]); blocks: plan_blocks() of the step (n + 1 tokens).
    "oracle": the blocks with the most full-attention mass (probs [r, n] summed over heads) in place of the pins and
    the top-k; SAMPLED: the top-k's weakest share of blocks (at least one) swapped for as many blocks spread evenly
    over the eligible blocks left unread, each weighted |unread| / sampled (a stratified estimate of the unread part:
    bias log of that weight on their logits) or at weight 1."""
    g = gp.g
    first, last, pinned_set, top = blocks
    k = plan.block_count(gp, n + 1)
    if k == 0 or last <= first:
        return {}
    sink_hi, win_lo = pinned.aligned_sink_window(g, n + 1, plan.sink, plan.window)
    zero = torch.zeros(n)
    per_block = torch.nn.functional.pad(probs.sum(0), (0, max(last * g - n, 0)))[: last * g].view(last, g).sum(1)
    per_block[:first] = -1.0
    best = torch.argsort(per_block, descending=True, stable=True)[: min(k, last - first)].tolist()
    out = {"oracle": (block_mask(n, g, sink_hi, win_lo, best), zero)}
    for name, share, weighted in SAMPLED:
        drop = max(1, int(len(top) * share)) if top else 0
        kept = pinned_set | set(top[: len(top) - drop])
        unread = np.array([b for b in range(first, last) if b not in kept])
        if not drop or not len(unread):
            out[name] = out["oracle"]
            continue
        picks = pinned.spread_evenly(unread, drop).tolist()
        bias = zero.clone()
        for b in picks:
            bias[b * g : (b + 1) * g] = float(np.log(len(unread) / drop)) if weighted else 0.0
        out[name] = (block_mask(n, g, sink_hi, win_lo, kept | set(picks)), bias)
    return out


# what-if variants: (name, share of the top-k swapped for an even sample of the unread blocks, weighted)
SAMPLED = (("sampled", 0.25, True), ("sampled_half", 0.5, True), ("sampled_unweighted", 0.25, False))


def quest_bound(qg: torch.Tensor, keys: torch.Tensor, g: int, n: int) -> torch.Tensor:
    """Group-summed Quest bound per block of the first n keys: qg [r, D], keys [>= n, D] -> [ceil(n / g)]."""
    nb = -(-n // g)
    padded = torch.nn.functional.pad(keys[:n], (0, 0, 0, nb * g - n))
    blocks = padded.view(nb, g, -1)
    kmin, kmax = blocks.amin(1), blocks.amax(1)  # [nb, D]
    return torch.maximum(qg[:, None, :] * kmin, qg[:, None, :] * kmax).sum(-1).sum(0)


def analyse(engine: Engine, plan: SparsePlan, prompt: list[int], out: list[int],
            line_steps: list[int] | None = None) -> dict[str, Any]:
    """Per answer step and group: src mass, read flag, deviation and contribution (see the module docstring);
    line_steps: align only that line of the answer (line_offset), else the whole answer (copy_offset)."""
    cfg = engine.model.cfg
    hkv, r, d = cfg.n_kv_heads, cfg.gqa_ratio, cfg.head_dim
    seq = prompt + out[:-1]
    m = len(out)
    obs = plan.obs_window
    cap = CaptureAttention(cfg, engine.model.device, len(seq), m - 1 + obs)
    cap.allocate(0)
    with torch.no_grad():
        for s in range(0, len(seq), 512):
            c = min(512, len(seq) - s)
            engine.model.forward(torch.tensor(seq[s : s + c]), torch.arange(s, s + c), [SeqChunk(0, s, c)], cap)
    cap.capture_kv(0)
    cap.free(0)
    offset, copied = line_offset(prompt, out, line_steps) if line_steps else copy_offset(prompt, out)
    n_prompt = len(prompt)
    scale = d**-0.5
    masses = {}
    qs = {}
    for layer in range(cfg.n_layers):
        q = torch.cat(cap.q[layer]).view(-1, hkv * r, d)  # [obs + m - 1, Hq, D]
        qs[layer] = q
        keys = cap.kv[layer][0]  # [Hkv, N, D]
        masses[layer] = pinned.attention_mass(q[:obs], keys[:, :n_prompt], n_prompt - obs, scale).numpy()
    n_first = n_prompt + 1
    masses = pinned.consensus_masses(plan, masses, n_first, plan.pin_consensus)
    src = np.zeros((m, cfg.n_layers, hkv))
    read = np.zeros((m, cfg.n_layers, hkv), dtype=bool)
    dev = np.zeros((m, cfg.n_layers, hkv))
    contrib = np.zeros((m, cfg.n_layers, hkv))
    unread = np.zeros((m, cfg.n_layers, hkv))
    # where the unread mass lies: the prompt's tail (question and answer prefix), the needle's neighbourhood, the rest
    regions = {"tail": (n_prompt - 256, n_prompt + m), "needle": (max(offset - 64, 0), offset + m + 64)}
    vdev = {name: np.zeros((m, cfg.n_layers, hkv)) for name in ["oracle"] + [v[0] for v in SAMPLED]}
    unread_by = {name: np.zeros((m, cfg.n_layers, hkv)) for name in regions}
    for layer in range(cfg.n_layers):
        keys, values = cap.kv[layer]
        wo = engine.model.layers[layer].wo.float()
        for j in range(m):
            n = n_prompt + j  # keys visible to the query at position n_prompt - 1 + j
            q = qs[layer][obs - 1 + j].view(hkv, r, d)  # [Hkv, r, D]
            proj = []
            for h in range(hkv):
                gp = plan.groups[layer][h]
                logits = (q[h] @ keys[h, :n].T) * scale  # [r, n]
                probs = torch.softmax(logits, dim=-1)
                pins = pinned.group_pins(plan, gp, masses[layer][h], n_first) if not gp.streaming else np.zeros(0)
                bound = quest_bound(q[h], keys[h], gp.g, n) if not gp.streaming else None
                blocks = plan_blocks(plan, gp, n + 1, bound, pins) if bound is not None else None
                mask = read_mask(plan, gp, n + 1, bound, pins, blocks)[:n]  # the step's n + 1 tokens minus its own
                full = probs @ values[h, :n]  # [r, D]
                sparse_p = torch.softmax(logits.masked_fill(~mask[None, :], float("-inf")), dim=-1)
                o_sparse = sparse_p @ values[h, :n]
                dev[j, layer, h] = float((o_sparse - full).norm() / full.norm().clamp(min=1e-12))
                if blocks is not None:
                    for name, (vm, vb) in variant_masks(plan, gp, n, probs, blocks).items():
                        vp = torch.softmax((logits + vb[None, :]).masked_fill(~vm[None, :], float("-inf")), dim=-1)
                        vdev[name][j, layer, h] = float((vp @ values[h, :n] - full).norm()
                                                        / full.norm().clamp(min=1e-12))
                else:
                    for name in vdev:
                        vdev[name][j, layer, h] = dev[j, layer, h]
                miss = (probs * (~mask)[None, :]).mean(0)  # [n]: unread mass per key, mean over the heads
                unread[j, layer, h] = float(miss.sum())
                for name, (lo, hi) in regions.items():
                    unread_by[name][j, layer, h] = float(miss[lo:min(hi, n)].sum())
                if copied[j]:
                    src[j, layer, h] = float(probs[:, offset + j].mean())
                    read[j, layer, h] = bool(mask[offset + j])
                proj.append(float((full.reshape(-1) @ wo[:, h * r * d : (h + 1) * r * d].T).norm()))
            total = sum(proj)
            contrib[j, layer] = [p / max(total, 1e-12) for p in proj]
    return {"offset": offset, "copied": copied.tolist(), "src": src, "read": read, "dev": dev, "contrib": contrib,
            "unread": unread, "unread_by": unread_by, "vdev": vdev}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--dir", default=".ruler_ids")
    ap.add_argument("--length", type=int, required=True)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--reference", required=True, help="FILE:MODE of the answers replayed (e.g. a full run)")
    ap.add_argument("--candidate", help="FILE:MODE of a sparse run: the step where it leaves the reference")
    ap.add_argument("--samples", nargs="+", required=True, help="task:index")
    ap.add_argument("--top", type=int, default=8, help="groups listed per looked-at step")
    ap.add_argument("--line", type=int, default=None,
                    help="align only this line of the reference answer (0 = its first listed value): a multi-value "
                         "answer copies each value from another needle")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tag = model_tag(args.gguf)
    meta, prompts = exported_samples(args.dir, args.gguf, args.length)
    ref = answer_outputs(args.reference, args.length)
    cand = answer_outputs(args.candidate, args.length) if args.candidate else None
    plan = SparsePlan.load(Path(args.plan))
    engine = Engine(args.gguf, attention="full", prefix_cache_entries=0, max_context=args.length + 256)
    index = {(s["task"], s["index"]): k for k, s in enumerate(meta["samples"])}
    results = []
    for spec in args.samples:
        task, _, i = spec.rpartition(":")
        if (task, int(i)) not in index:
            sys.exit(f"error: no sample {spec} among {tag}'s exported samples at {args.length}")
        k = index[(task, int(i))]
        out = [t for t in ref[k] if t not in meta["eog_ids"]]
        t0 = time.perf_counter()
        line_steps = None
        if args.line is not None:
            newline_ids = {t for t in set(out) if "\n" in engine.tokenizer.decode([t])}
            lines = answer_lines(out, newline_ids)
            if args.line >= len(lines):
                sys.exit(f"error: --line {args.line}: {spec}'s reference answer lists {len(lines)} values")
            line_steps = lines[args.line]
        a = analyse(engine, plan, prompts[k], out, line_steps)
        leave = first_difference(out, cand[k]) if cand is not None else None
        src, read, dev, contrib = a["src"], a["read"], a["dev"], a["contrib"]
        steps = []
        what = f"line {args.line} (steps {line_steps[0]}..{line_steps[-1]})" if line_steps else "answer"
        print(f"\n{spec}: {len(prompts[k])} prompt tokens, {what} of {len(out)} tokens copied from {a['offset']} "
              f"({sum(a['copied'])} aligned); candidate leaves at step {leave}; {time.perf_counter() - t0:.0f} s")
        for j in range(len(out)):
            if not a["copied"][j]:
                continue
            w = src[j].ravel()
            share = float((w * read[j].ravel()).sum() / max(w.sum(), 1e-12))
            cd = (contrib[j] * dev[j]).ravel()
            steps.append({"step": j, "src_mass_total": float(w.sum()), "read_share_weighted": share,
                          "mean_cd": float(cd.mean()), "max_cd": float(cd.max())})
            mark = " <- leaves" if j == leave else ""
            ub = {name: float((contrib[j] * u[j]).sum()) for name, u in a["unread_by"].items()}
            ub["all"] = float((contrib[j] * a["unread"][j]).sum())
            steps[-1]["unread_c_weighted"] = ub
            print(f"  step {j:2d}: src mass sum {w.sum():6.2f}, read (src-weighted) {share:5.2f}, "
                  f"mean c*d {cd.mean():.4f}, c-weighted unread: all {ub['all']:.2f} tail {ub['tail']:.2f} "
                  f"needle {ub['needle']:.2f}{mark}")
        totals = {"plan": float((contrib * dev).sum(axis=(1, 2)).mean())}
        totals |= {name: float((contrib * v).sum(axis=(1, 2)).mean()) for name, v in a["vdev"].items()}
        print("  sum over groups of c*d, mean over steps: " + ", ".join(f"{k} {v:.2f}" for k, v in totals.items()))
        look = leave if leave is not None and leave < len(out) else None
        top = []
        if look is not None:
            order = np.argsort(-src[look].ravel())[: args.top]
            print(f"  step {look}: groups by src mass (layer.group g budget: mass, read, dev, c, unread)")
            for flat in order:
                layer, h = divmod(int(flat), src.shape[2])
                gp = plan.groups[layer][h]
                kind = "stream" if gp.streaming else f"g{gp.g} b{gp.budget:g}{' long' if gp.long_only else ''}"
                row = {"layer": layer, "group": h, "plan": kind, "src_mass": float(src[look, layer, h]),
                       "read": bool(read[look, layer, h]), "dev": float(dev[look, layer, h]),
                       "contrib": float(contrib[look, layer, h]), "unread": float(a["unread"][look, layer, h])}
                top.append(row)
                print(f"    {layer:2d}.{h} {kind:>16}: {row['src_mass']:.3f} {'read' if row['read'] else 'MISS':>4} "
                      f"dev {row['dev']:.3f} c {row['contrib']:.3f} unread {row['unread']:.3f}")
        results.append({"sample": spec, "line": args.line, "prompt_tokens": len(prompts[k]), "offset": a["offset"],
                        "leaves_at": leave, "steps": steps, "top_at_leave": top, "cd_totals": totals,
                        "src": src.tolist(), "read": read.tolist(), "dev": dev.tolist(), "contrib": contrib.tolist()})
    Path(args.out).write_text(json.dumps({"gguf": tag, "length": args.length, "plan": args.plan,
                                          "reference": args.reference, "candidate": args.candidate,
                                          "samples": results}))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
