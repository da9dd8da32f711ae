"""Calibration: how much each (layer, KV group) output deviates under each sparse configuration.

For calibration prompts (essay haystacks with planted facts and a question at the end) we run the dense model once,
capture q for the last M positions and all K/V per layer, and for every (layer, group) and configuration
(streaming-only, or top-k blocks of size g with budget b) recompute that group's attention output exactly as the sparse
backend would (same sink/window alignment, Quest-bound block scores summed over the group's query heads):

  deviation   d = ||o_sparse - o_full|| / ||o_full||          per query position, over the group's heads
  contribution c = ||W_o[:, group] o_full|| / sum_groups(...)  the group's share of the layer's attention output
  label       e = c * d                                        averaged over positions and prompts

The selector (policy.py) turns these labels into a plan.
"""
from __future__ import annotations

import random

import torch

from fluxion_lite.model.attention import DenseAttention, SeqChunk
from fluxion_lite.model.config import ModelConfig
from fluxion_lite.model.transformer import Transformer
from fluxion_lite.plan.space import Config, all_configs

class CaptureAttention(DenseAttention):
    """Dense attention that records q of the last `m` positions and the full K/V of every layer (one sequence)."""

    def __init__(self, cfg: ModelConfig, device: torch.device, total: int, m: int):
        super().__init__(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, torch.float32, device)
        self.total, self.m = total, m
        self.q: dict[int, list[torch.Tensor]] = {}
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: list[SeqChunk]) -> torch.Tensor:
        out = super().attend(layer, q, k, v, chunks)
        (c,) = chunks
        first = self.total - self.m
        lo = max(first, c.start)
        if lo < c.start + c.length:
            self.q.setdefault(layer, []).append(q[lo - c.start :].detach().float().clone())
        return out

    def capture_kv(self, seq_id: int) -> None:
        """After the last chunk: keep every layer's full K/V ([Hkv, N, D], fp32 copies) before the slot is freed."""
        for layer in range(self.cache.n_layers):
            keys, values = self.cache.view(layer, seq_id)
            self.kv[layer] = (keys.float().clone(), values.float().clone())


def planted_fact_prompt(words: list[str], essay_ids: list[int], tokenizer_encode, n_tokens: int, rng: random.Random) -> list[int]:
    """An essay slice of ~n_tokens with 3 planted facts and a question about one of them at the end."""
    keys = rng.sample(words, 3)
    values = [rng.randrange(1_000_000, 9_999_999) for _ in keys]
    facts = [tokenizer_encode(f" The special magic number for {k} is {v}. ") for k, v in zip(keys, values)]
    ask = rng.randrange(3)
    question = tokenizer_encode(f"\nQuestion: What is the special magic number for {keys[ask]}? Answer: The special "
                                f"magic number for {keys[ask]} is {values[ask]}.")
    budget = n_tokens - len(question) - sum(len(f) for f in facts)
    start = rng.randrange(0, max(1, len(essay_ids) - budget))
    body = essay_ids[start : start + budget]
    for f in facts:
        at = rng.randrange(0, len(body))
        body = body[:at] + f + body[at:]
    return body + question


def group_outputs(qg: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                  configs: list[Config], sink: int, window: int, scale: float,
                  masks: dict[str, torch.Tensor] | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One KV group's attention for M queries under each configuration (scores and block bounds computed once).

    qg: [M, r, D] at absolute `positions` [M]; keys/values: [N, D] (N >= max position + 1).
    Returns config key -> (output [M, r, D], fraction of the context read [M]); key "full" is dense attention.
    masks: if given, receives each configuration's tokens read (config key -> [M, N] bool).
    """
    m, r, d = qg.shape
    n_keys = keys.shape[0]
    pos = torch.arange(n_keys)
    n_ctx = positions + 1  # [M]
    scores = torch.einsum("mrd,nd->mrn", qg, keys) * scale  # [M, r, N]
    causal = pos[None, :] < n_ctx[:, None]  # [M, N]
    order_by_g: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def attend(allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(scores.masked_fill(~allowed[:, None, :], float("-inf")), dim=-1)
        return probs @ values, allowed.sum(1).double() / n_ctx.double()

    results = {"full": attend(causal)}
    for cfg in configs:
        g = cfg.g if not cfg.streaming else 1
        sink_hi = torch.clamp(torch.full_like(n_ctx, -(-sink // g) * g), max=n_ctx)
        win_lo = torch.maximum(((n_ctx - window).clamp(min=0) // g) * g, sink_hi)
        allowed = (pos[None, :] < sink_hi[:, None]) | ((pos[None, :] >= win_lo[:, None]) & causal)
        if not cfg.streaming:
            n_blocks = -(-n_keys // g)
            b_lo = torch.arange(n_blocks) * g
            eligible = (b_lo[None, :] >= sink_hi[:, None]) & (b_lo[None, :] + g <= win_lo[:, None])  # [M, nb]
            if g not in order_by_g:
                padded = torch.nn.functional.pad(keys, (0, 0, 0, n_blocks * g - n_keys))
                blocks = padded.view(n_blocks, g, d)
                kmin, kmax = blocks.amin(1), blocks.amax(1)  # [nb, D]
                # Quest bound summed over the group's query heads: [M, nb]
                bound = torch.maximum(qg[:, :, None, :] * kmin, qg[:, :, None, :] * kmax).sum(-1).sum(1)
                order_by_g[g] = (bound, eligible)
            bound = order_by_g[g][0].masked_fill(~eligible, float("-inf"))
            order = bound.argsort(dim=1, descending=True, stable=True)
            rank = torch.empty_like(order)
            rank.scatter_(1, order, torch.arange(n_blocks).expand(m, -1).contiguous())
            k_blocks = torch.ceil(cfg.budget * n_ctx.double() / g).long()  # [M]
            chosen = (rank < k_blocks[:, None]) & eligible
            allowed = allowed | chosen.repeat_interleave(g, dim=1)[:, :n_keys]
        if masks is not None:
            masks[cfg.key] = allowed
        results[cfg.key] = attend(allowed)
    return results


def capture_prompt(model: Transformer, tokens: list[int], m: int) -> CaptureAttention:
    """Dense forward over `tokens` (chunks of 512) recording q of the last m positions and every layer's K/V."""
    cap = CaptureAttention(model.cfg, model.device, len(tokens), m)
    cap.allocate(0)
    chunk = 512
    for s in range(0, len(tokens), chunk):
        n = min(chunk, len(tokens) - s)
        model.forward(torch.tensor(tokens[s : s + n]), torch.arange(s, s + n), [SeqChunk(0, s, n)], cap)
    cap.capture_kv(0)
    cap.free(0)
    return cap


def layer_errors(model: Transformer, layer: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 positions: torch.Tensor, configs: list[Config], sink: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group and configuration of one layer: (mean effective error c*d, mean fraction read), each [Hkv, C].

    q: [M, Hkv, r, D] at absolute `positions` [M]; keys/values: [Hkv, N, D] with N > max(positions).
    """
    m, hkv, r, d = q.shape
    wo = model.layers[layer].wo_dense()  # [d_model, Hq*D]
    outs = [group_outputs(q[:, h], keys[h], values[h], positions, configs, sink, window, d**-0.5) for h in range(hkv)]
    proj = torch.stack([(outs[h]["full"][0].reshape(m, r * d) @ wo[:, h * r * d : (h + 1) * r * d].T).norm(dim=-1)
                        for h in range(hkv)])  # [Hkv, M]
    contrib = proj / proj.sum(0, keepdim=True).clamp(min=1e-12)
    err = torch.zeros(hkv, len(configs), dtype=torch.float64)
    frac = torch.zeros_like(err)
    for h in range(hkv):
        full = outs[h]["full"][0]
        ref_norm = full.reshape(m, -1).norm(dim=-1).clamp(min=1e-12)
        for j, cfg in enumerate(configs):
            o, fr = outs[h][cfg.key]
            dev = (o - full).reshape(m, -1).norm(dim=-1) / ref_norm
            err[h, j], frac[h, j] = float((contrib[h] * dev).mean()), float(fr.mean())
    return err, frac


def calibrate_prompt(model: Transformer, tokens: list[int], m: int, sink: int, window: int,
                     configs: list[Config]) -> dict[tuple[int, int, str], tuple[float, float]]:
    """Labels for one prompt: (layer, group, config key) -> (mean effective error c*d, mean fraction read)."""
    cfgm = model.cfg
    cap = capture_prompt(model, tokens, m)
    r, d, hkv = cfgm.gqa_ratio, cfgm.head_dim, cfgm.n_kv_heads
    positions = torch.arange(len(tokens) - m, len(tokens))
    labels: dict[tuple[int, int, str], tuple[float, float]] = {}
    for layer in range(cfgm.n_layers):
        q = torch.cat(cap.q[layer]).view(m, hkv, r, d)  # [M, Hkv, r, D]
        keys, values = cap.kv[layer]
        err, frac = layer_errors(model, layer, q, keys, values, positions, configs, sink, window)
        for h in range(hkv):
            for j, cfg in enumerate(configs):
                labels[(layer, h, cfg.key)] = (float(err[h, j]), float(frac[h, j]))
    return labels


def mean_labels(per_prompt: list[dict[tuple[int, int, str], tuple[float, float]]]) -> dict[tuple[int, int, str], tuple[float, float]]:
    keys = per_prompt[0].keys()
    return {k: (sum(p[k][0] for p in per_prompt) / len(per_prompt), sum(p[k][1] for p in per_prompt) / len(per_prompt))
            for k in keys}


def calibrate_loaded(model: Transformer, tokenizer, model_name: str, *, samples: int, context: int, positions: int,  # type: ignore[no-untyped-def]
                     sink: int, window: int, seed: int = 0
                     ) -> tuple[dict[tuple[int, int, str], tuple[float, float]], dict[str, object]]:
    """run_calibration on a model already loaded (the engine's own, in whatever weights it runs), with a progress
    bar on stderr: labels per (layer, group, configuration) and the run's metadata."""
    import time

    from fluxion_lite.plan.calibration_text import essay_text
    from fluxion_lite.plan.progress import progress

    if tokenizer is None:
        raise ValueError("calibration needs the model's tokenizer")
    rng = random.Random(seed)
    essay_ids = tokenizer.encode(essay_text()[: context * 40], add_special=False)
    words = ["apple", "river", "falcon", "marble", "lantern", "cedar", "violet", "harbor", "meadow", "copper",
             "thistle", "orbit", "saffron", "glacier", "pepper", "quartz", "willow", "ember", "canyon", "basil"]
    per_prompt = []
    t0 = time.time()
    progress(0, samples, t0, "calibrating")
    for i in range(samples):
        ids = planted_fact_prompt(words, essay_ids, lambda s: tokenizer.encode(s, add_special=False), context, rng)
        per_prompt.append(calibrate_prompt(model, ids, positions, sink, window, all_configs()))
        progress(i + 1, samples, t0, "calibrating")
    cfg = model.cfg
    meta = {"model": model_name, "samples": samples, "context": context, "positions": positions, "sink": sink,
            "window": window, "seed": seed, "n_layers": cfg.n_layers, "n_groups": cfg.n_kv_heads,
            "head_dim": cfg.head_dim, "prompts": "essay haystack with 3 planted facts + question"}
    return mean_labels(per_prompt), meta
