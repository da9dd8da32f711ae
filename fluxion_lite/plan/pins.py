"""Blocks pinned at the end of prefill by the prompt's own attention, for the retrieval groups of a sparse plan.

The Quest bound ranks a block by the extremes of its keys. Among look-alike distractors (RULER's multi-key needles:
"the magic number for <key> is ...", hundreds of times with other keys) the extremes barely differ, and the needle's
block is lost. At the end of prefill the exact answer is at hand: the prompt's last tokens, which hold the question,
attend over the dense prompt KV that prefill kept on the compute device. So, per (layer, retrieval group), the blocks
with the most attention mass from the last `obs_window` prompt positions (summed over the group's query heads and
those positions) are kept for the whole decode: pinned. They take `pin_fraction` of the group's block budget; the
per-step top-k fills the rest with its best blocks that are not pinned, so a step reads as many blocks as without
pins (a group whose budget is fewer blocks than the plan's pin_min_blocks pins none). That union is made by the native
top-k itself (fluxion.h, PINNED BLOCKS), from the table() of a layer's tasks.
With the plan's pin_span s > 1, a block also scores by its predecessors' mass (x pin_decay per block), so a heavy
block's s - 1 successors are pinned too, within the same count (pick_pins); pin_span_tokens sets s per group from
its block size instead (SparsePlan.span_for). With pin_consensus a group ranks by its mass blended with the mean of
all retrieval groups' (consensus_masses), and a sequence's first pin() pins every layer.

Eligible blocks lie wholly between the sink and the recent window of the first decode step, block-aligned to the
group's g, as the top-k's own exclusion ranges are: the window only moves forward, so a pinned block never overlaps
the device-side streaming part later.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from fluxion_lite.plan.sparse_plan import GroupPlan, SparsePlan

_NONE = np.iinfo(np.int32).max  # sorts after every block id


def attention_mass(q_obs: torch.Tensor, keys: torch.Tensor, first_pos: int, scale: float) -> torch.Tensor:
    """Softmax attention mass per key, summed over the observation rows and the group's query heads.
    q_obs: [W, Hq, D], rows at positions first_pos .. first_pos + W - 1; keys: [Hkv, n, D] -> fp32 [Hkv, n]."""
    w, hq, d = q_obs.shape
    hkv, n, _ = keys.shape
    r = hq // hkv
    mass = torch.zeros(hkv, n, dtype=torch.float32, device=keys.device)
    # Only keys from first_pos on can lie in a row's future (row i sits at first_pos + i): the causal mask is a
    # [W, n - first_pos] triangle over the last columns, not a [W, n] mask over all of them (at 16K keys, building,
    # repeating and applying that full mask took a third of this function's time).
    tail = max(n - first_pos, 0)
    future = torch.ones(w, tail, dtype=torch.bool, device=keys.device).triu_(1).repeat(r, 1)  # [r W, tail]
    for h in range(hkv):  # one group at a time: [r W, n] scores, not [Hkv r W, n]
        qh = q_obs[:, h * r : (h + 1) * r].float().transpose(0, 1).reshape(r * w, d)  # [r W, D], head-major
        logits = (qh @ keys[h].float().T).mul_(scale)  # [r W, n]
        logits[:, n - tail :].masked_fill_(future, float("-inf"))
        mass[h] = torch.softmax(logits, dim=-1).sum(0)
    return mass


def aligned_sink_window(g: int, n: int, sink: int, window: int) -> tuple[int, int]:
    """Token bounds (sink end, window start) of a step with n tokens, the sink rounded up and the window's start
    rounded down to g, as a retrieval group of block size g reads them."""
    sink_hi = min(-(-sink // g) * g, n)
    return sink_hi, max((max(n - window, 0) // g) * g, sink_hi)


def eligible_blocks(g: int, n: int, sink: int, window: int) -> tuple[int, int]:
    """Block ids [first, last) of granularity g wholly between the sink (rounded up to g) and the recent window
    (its start rounded down to g) for a step with n tokens: the blocks pins may take."""
    sink_hi, win_lo = aligned_sink_window(g, n, sink, window)
    return sink_hi // g, win_lo // g


def spread_evenly(items: np.ndarray, count: int) -> np.ndarray:
    """`count` of `items` spread evenly over them: the middle item of each of count equal slices."""
    return items[((np.arange(count) + 0.5) * len(items) / count).astype(np.int64)]


def pick_pins(mass: np.ndarray, g: int, n: int, sink: int, window: int, count: int, span: int = 1,
              decay: float = 1.0, stride: float = 0.0) -> np.ndarray:
    """`count` blocks of granularity g picked by mass (mass: [n_prompt] per key), among blocks wholly inside
    [sink rounded up to g, (n - window) rounded down to g) for a step with n tokens. int32 ids, ascending.

    A block's score is the largest of its own mass and decay^j x the mass of its j-th predecessor, j < span (eligible
    predecessors only); the `count` best scores win. span 1: the heaviest blocks. The question's attention lands on
    a needle's key, but the value that answers it follows the key; a long value (a UUID is ~34 tokens) runs on over
    the next blocks at g=16, which draw little mass of their own and look alike to the per-step bound. decay 1: each
    heavy block comes with its span - 1 successors before any lighter block; decay < 1: a successor competes with
    the other needles' keys at a discount (a many-needle prompt keeps a pin per key).

    stride > 0: round(stride x count) of the pins are spread evenly over the eligible blocks the mass left out,
    whatever their mass: a top-k sees the extremes of the context, an even sample its proportions (how often a word
    occurs), which aggregate questions (RULER's cwe / fwe) need and no per-step bound ranks."""
    first, last = eligible_blocks(g, n, sink, window)
    if count <= 0 or last <= first:
        return np.zeros(0, np.int32)
    padded = np.zeros(last * g, np.float64)
    m = min(len(mass), last * g)
    padded[:m] = mass[:m]
    per_block = padded.reshape(last, g).sum(1)[first:]  # [eligible]
    score = per_block.copy()
    for j in range(1, min(span, len(per_block))):  # inherited from the j-th predecessor
        np.maximum(score[j:], decay**j * per_block[:-j], out=score[j:])
    take = min(count, len(score))
    spread = min(int(round(stride * count)), take)
    order = np.lexsort((np.arange(len(score)), -score))[: take - spread]  # best first, ties to the lower id
    if spread:
        rest = np.setdiff1d(np.arange(len(score)), order)  # ascending
        order = np.concatenate([order, spread_evenly(rest, spread)])
    return np.sort(order + first).astype(np.int32)


def group_pins(plan: SparsePlan, gp: GroupPlan, mass: np.ndarray, n: int) -> np.ndarray:
    """One group's pins under the plan's pin settings, from its observed mass [n_prompt], for a step with n tokens
    (none for a streaming group, or one whose budget is fewer blocks than pin_min_blocks)."""
    blocks = plan.block_count(gp, n)
    count = int(plan.pin_fraction * blocks) if blocks >= plan.pin_min_blocks else 0
    return pick_pins(mass, gp.g, n, plan.sink, plan.window, count, plan.span_for(gp.g), plan.pin_decay,
                     plan.pin_stride)


def consensus_masses(plan: SparsePlan, masses: dict[int, np.ndarray], n: int, share: float
                     ) -> dict[int, np.ndarray]:
    """Each retrieval group's mass with `share` of it replaced by the consensus of all retrieval groups of all
    layers: every group's mass ([Hkv, n_prompt] per layer) normalised over the positions pins may take (between the
    sink and the first step's window), then averaged. A needle sits at the same tokens for every group; one whose
    own prompt-end attention missed it still pins it when the others found it (bench/pin_recall.py --consensus:
    the 1.5b's multikey_3 UUID held whole by 0.30 of the groups at 8K, 0.66 with share 1). share 0: the masses."""
    if share == 0.0 or not masses:
        return masses
    lo, hi = plan.sink, max(n - plan.window, plan.sink + 1)
    norm = {layer: m / np.maximum(m[:, lo:hi].sum(1, keepdims=True), 1e-30) for layer, m in masses.items()}
    rows = [norm[layer][h] for layer in norm for h, gp in enumerate(plan.groups[layer]) if not gp.streaming]
    if not rows:
        return masses
    consensus = np.mean(rows, axis=0)  # [n_prompt]
    return {layer: (1.0 - share) * m + share * consensus[None, :] for layer, m in norm.items()}


class PinnedBlocks:
    """Per layer, the pinned block ids of each host-store slot's retrieval groups, and their use in decode steps."""

    def __init__(self, plan: SparsePlan):
        self.plan = plan  # its groups' g and budget, sink, window and pin settings (pin_fraction .. pin_consensus)
        n_layers, n_kv_heads = len(plan.groups), len(plan.groups[0])
        self.obs_window = plan.obs_window
        self.n_layers, self.n_kv_heads = n_layers, n_kv_heads
        self._q: dict[int, list[tuple[int, torch.Tensor] | None]] = {}  # seq -> per layer (first position, q rows)
        # int32 [L, slots, Hkv, P] pinned ids padded with _NONE (P: the most pins of any group), int32 [L, slots, Hkv]
        # counts: one array for all layers, so a step's pins for every layer's tasks are one gather (table())
        self._ids = np.full((n_layers, 0, n_kv_heads, 0), _NONE, np.int32)
        self._counts = np.zeros((n_layers, 0, n_kv_heads), np.int32)
        self.version = 0  # bumped whenever a slot's pins change (device_graph.py keeps a device copy)
        self._slot_version: dict[int, int] = {}  # slot -> self.version when its pins last changed

    def observe(self, layer: int, seq_id: int, start: int, q: torch.Tensor) -> None:
        """Keep the last obs_window rows of a prefill chunk's q ([n, Hq, D] at positions start..)."""
        per_layer = self._q.setdefault(seq_id, [None] * self.n_layers)
        prev = per_layer[layer]
        if prev is not None and prev[0] + len(prev[1]) == start:  # a short last chunk: keep the tail of the one before
            q = torch.cat([prev[1], q])
            start = prev[0]
        keep = min(len(q), self.obs_window)
        per_layer[layer] = (start + len(q) - keep, q[-keep:].detach().clone())

    def pin(self, layer: int, seq_id: int, slot: int, keys_of: Callable[[int], torch.Tensor], n: int,
            scale: float) -> None:
        """At a sequence's first decode step (n tokens incl. the new one): pin blocks for each retrieval group of the
        layer. keys_of(i): layer i's dense prompt keys [Hkv, n_prompt, D]. With the plan's pin_consensus the first
        call pins every layer (each group's mass blends with all groups' mean, consensus_masses), the later ones
        find nothing left to do."""
        per_layer = self._q.get(seq_id)
        if not per_layer or per_layer[layer] is None:
            return
        consensus = self.plan.pin_consensus
        masses = {}
        for i, obs in enumerate(per_layer):
            if obs is not None and (consensus or i == layer):
                per_layer[i] = None  # used once
                masses[i] = attention_mass(obs[1], keys_of(i), obs[0], scale).cpu().numpy()  # [Hkv, n_prompt]
        for i, mass in consensus_masses(self.plan, masses, n, consensus).items():
            self.pin_by_mass(i, slot, mass, n)

    def pin_by_mass(self, layer: int, slot: int, mass: np.ndarray, n: int) -> None:
        """Pin from a given attention mass per key ([Hkv, n_prompt]): pin()'s second half, also for benchmarks
        whose context was imported rather than prefilled (no observed queries)."""
        self._store(layer, slot, [group_pins(self.plan, gp, mass[h], n)
                                  for h, gp in enumerate(self.plan.groups[layer])])

    def _store(self, layer: int, slot: int, pins: list[np.ndarray]) -> None:
        ids, counts = self._ids, self._counts
        width = max(ids.shape[3], max(len(p) for p in pins))
        if slot >= ids.shape[1] or width > ids.shape[3]:
            rows = max(slot + 1, ids.shape[1])
            grown = np.full((self.n_layers, rows, self.n_kv_heads, width), _NONE, np.int32)
            grown[:, : ids.shape[1], :, : ids.shape[3]] = ids
            grown_counts = np.zeros((self.n_layers, rows, self.n_kv_heads), np.int32)
            grown_counts[:, : counts.shape[1]] = counts
            self._ids, self._counts = ids, counts = grown, grown_counts
        ids[layer, slot] = _NONE
        self.version += 1
        self._slot_version[slot] = self.version
        for h, p in enumerate(pins):
            ids[layer, slot, h, : len(p)] = p
            counts[layer, slot, h] = len(p)

    def forget(self, seq_id: int, slot: int | None) -> None:
        """A sequence ended: its observation rows and its slot's pins go."""
        self._q.pop(seq_id, None)
        if slot is None:
            return
        if slot < self._ids.shape[1]:
            self._ids[:, slot] = _NONE
            self._counts[:, slot] = 0
            self.version += 1
            self._slot_version[slot] = self.version

    def slot_version(self, slot: int) -> int:
        """Changes whenever the slot's pins do (0: never pinned): a device copy of one slot's pins is current while
        this stays the same, whatever happens to the other slots."""
        return self._slot_version.get(slot, 0)

    def slot_blocks(self, slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every pin of a slot as three int64 arrays [M]: layer, KV head, block id (layer-major, then head)."""
        if slot >= self._ids.shape[1]:
            empty = np.zeros(0, np.int64)
            return empty, empty, empty
        counts = self._counts[:, slot]  # [L, Hkv]
        live = np.arange(self._ids.shape[3]) < counts[..., None]  # [L, Hkv, P]
        layer, head, j = np.nonzero(live)
        return layer.astype(np.int64), head.astype(np.int64), self._ids[layer, slot, head, j].astype(np.int64)

    def mask(self, slots: np.ndarray, n_blocks: int, layer: int | None = None) -> np.ndarray:
        """The pinned blocks of the given slots as a bool mask for the device-side top-k (device_select.py):
        [L, B, Hkv, n_blocks], or [B, Hkv, n_blocks] for one layer. Blocks at or past n_blocks and slots never
        pinned stay False."""
        ids, counts = self._ids, self._counts
        layers = np.arange(self.n_layers) if layer is None else np.array([layer])
        slots = np.asarray(slots, np.int64)
        out = np.zeros((len(layers), len(slots), self.n_kv_heads, n_blocks), bool)
        known = np.flatnonzero(slots < ids.shape[1])  # rows whose slot has pin rows
        if len(known) and ids.shape[3]:
            sub = ids[layers][:, slots[known]]  # [L', B', Hkv, P]
            live = (np.arange(ids.shape[3]) < counts[layers][:, slots[known]][..., None]) & (sub < n_blocks)
            li, bi, h, j = np.nonzero(live)
            out[li, known[bi], h, sub[li, bi, h, j]] = True
        return out if layer is None else out[0]

    def any(self, layer: int) -> bool:
        return bool(self._counts[layer].any())

    def table(self, layer: int | np.ndarray, tasks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The pins of tasks in the native top-k's form (native.group_topk's pins / pin_counts): ids int32 [T, P]
        (row i: the pins of task i's layer, slot tasks[i, 0] and KV head tasks[i, 2], ascending; entries past its
        count are padding, never read) and counts int32 [T]; a slot never pinned has count 0. layer: one layer for
        all tasks, or each task's layer (int [T]: a whole step's table in the same two gathers)."""
        ids, counts = self._ids, self._counts
        slot, h, k = tasks[:, 0], tasks[:, 2], tasks[:, 4]
        # a task never gets more pins than its k: where the plan's budget factor falls with n (SparsePlan.budget_factor:
        # past short_tokens, or a budget curve's falling part) its blocks can shrink after the pins were counted
        if len(slot) and int(np.maximum.reduce(slot)) < ids.shape[1]:  # every slot has rows: the usual case
            return ids[layer, slot, h], np.minimum(counts[layer, slot, h], k)
        inside = slot < ids.shape[1]
        at = layer if np.isscalar(layer) else np.asarray(layer)[inside]
        table = np.full((len(slot), ids.shape[3]), _NONE, np.int32)  # [T, P]
        table_counts = np.zeros(len(slot), np.int32)
        table[inside] = ids[at, slot[inside], h[inside]]
        table_counts[inside] = counts[at, slot[inside], h[inside]]
        return table, np.minimum(table_counts, k)
