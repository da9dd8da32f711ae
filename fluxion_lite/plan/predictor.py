"""Head-property predictor: per-(layer, KV group) prefill features -> P(streaming is enough) and the predicted
effective error of every (g, budget) configuration; and the per-sequence selector that turns those into a plan.

A small MLP (19 features + 21 prior log-errors -> 288 -> 288 -> 1 + 21 outputs, 101,398 parameters) trained offline
with torch, run online in numpy (a few [Hkv, 288] matmuls per layer: microseconds, no torch dispatch). Weights ship as
models/<model>.predictor.npz (no pickles) next to a card, models/<model>.predictor.md.

Why a prior: a head's behaviour is mostly a property of the head (which is why a static per-model plan works at all),
and a first predictor without the head's identity lost to the static plan on held-out prompts. So each (layer, group)
also feeds in its calibrated mean error per configuration (the static plan's own labels, a [L, Hkv, 21] table shipped
in the same file) and the regression head predicts a *correction* to that prior from what this prompt's prefill
shows. In training the prior of a prompt's sample is the mean over the *other* training prompts (leave-one-out), so
the network cannot learn to trust a prior that already contains its target.

Why two heads: the streaming decision is the one that matters most (a wrongly-streamed retrieval group loses the
needle), so it gets its own classifier trained at the selector's epsilon; the regression head predicts log(c*d) for
all 21 configurations so the selector can pick the cheapest (g, budget) that stays under epsilon, as it does with
calibrated labels.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fluxion_lite.plan.space import Config, all_configs
from fluxion_lite.errors import ModelFileError
from fluxion_lite.plan.head_features import FEATURE_NAMES, N_FEATURES
from fluxion_lite.plan.cost import bytes_per_step

HIDDEN = 288
LOG_FLOOR = 1e-4  # errors below this are "exact enough": regress log(e + floor) so tiny errors don't dominate the loss
FORMAT = "fluxion-lite-predictor-2"


N_CONFIGS = len(all_configs())
N_INPUTS = N_FEATURES + N_CONFIGS  # features, then log(prior error + floor) per configuration


def param_count(n_in: int = N_INPUTS, hidden: int = HIDDEN, n_out: int = 1 + N_CONFIGS) -> int:
    return (n_in * hidden + hidden) + (hidden * hidden + hidden) + (hidden * n_out + n_out)


@dataclass
class Predictor:
    weights: dict[str, np.ndarray]  # w1 [F+C, H], b1, w2 [H, H], b2, w3 [H, 1+C], b3, mu, sd [F+C], prior [L, Hkv, C]
    meta: dict[str, object] = field(default_factory=dict)  # epsilon, sink, window, n_layers, n_groups, ...

    @property
    def n_params(self) -> int:
        """Trainable parameters (the prior table is calibration data, counted separately in the card)."""
        return sum(int(self.weights[k].size) for k in ("w1", "b1", "w2", "b2", "w3", "b3"))

    @property
    def epsilon(self) -> float:
        return float(self.meta["epsilon"])  # type: ignore[arg-type]

    def forward(self, features: np.ndarray, prior: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """features [..., F], prior errors [..., C] -> (P(streaming ok) [...], predicted effective error [..., C] in
        all_configs() order)."""
        w = self.weights
        log_prior = np.log(prior.astype(np.float32) + LOG_FLOOR)
        x = (np.concatenate([features.astype(np.float32), log_prior], axis=-1) - w["mu"]) / w["sd"]
        h = np.maximum(x @ w["w1"] + w["b1"], 0.0)
        h = np.maximum(h @ w["w2"] + w["b2"], 0.0)
        out = h @ w["w3"] + w["b3"]
        p_stream = 1.0 / (1.0 + np.exp(-np.clip(out[..., 0], -50.0, 50.0)))
        # the head predicts a correction to the prior; clipped so out-of-distribution inputs cannot overflow
        err = np.exp(np.clip(log_prior + out[..., 1:], -20.0, 5.0)) - LOG_FLOOR
        return p_stream, np.maximum(err, 0.0)

    def predict_layer(self, features: np.ndarray, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Online: features [Hkv, F] of one layer, with that layer's shipped prior."""
        return self.forward(features, self.weights["prior"][layer])

    def save(self, path: Path) -> None:
        np.savez(path, meta=np.array(json.dumps(self.meta)), **{k: v.astype(np.float32) for k, v in self.weights.items()})

    @classmethod
    def load(cls, path: Path) -> "Predictor":
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                weights = {k: z[k] for k in z.files if k != "meta"}
        except (OSError, ValueError, KeyError) as exc:
            raise ModelFileError(f"{path}: unreadable predictor ({exc})") from exc
        if meta.get("format") != FORMAT or weights["w1"].shape[0] != N_INPUTS:
            raise ModelFileError(f"{path}: predictor format {meta.get('format')!r} / {weights['w1'].shape[0]} inputs; "
                                 f"this build expects {FORMAT!r} / {N_INPUTS}: retrain with `calibrate --train`")
        return cls(weights, meta)


# ---- selection ----------------------------------------------------------------------------------------------------
def config_costs(n: int, sink: int, window: int, head_dim: int) -> np.ndarray:
    """Bytes touched per step for each configuration at context n (all_configs() order), as the static selector counts."""
    return np.array([bytes_per_step(c, n, sink, window, head_dim) for c in all_configs()])


def select_groups(p_stream: np.ndarray, err: np.ndarray, costs: np.ndarray, epsilon: float
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per group: streaming if P(streaming ok) >= 0.5, else the cheapest (g, budget) whose predicted error is <= epsilon,
    or the lowest predicted error where none is. p_stream [G], err [G, C], costs [C] -> (streaming [G] bool,
    g [G] int (16 for streaming groups, as GroupPlan does), budget [G] float)."""
    configs = all_configs()
    retr = np.array([not c.streaming for c in configs])
    g_of = np.array([c.g for c in configs])
    b_of = np.array([c.budget for c in configs])
    streaming = p_stream >= 0.5
    feasible = (err <= epsilon) & retr[None, :]
    # lexicographic (cost, error, position): cost rank first, predicted error as the tie-break
    big = np.where(feasible, costs[None, :], np.inf)
    best_cost = big.min(axis=1, keepdims=True)
    tie = np.where(big == best_cost, err, np.inf)
    pick_feasible = tie.argmin(axis=1)
    pick_lowest = np.where(retr[None, :], err, np.inf).argmin(axis=1)
    pick = np.where(feasible.any(axis=1), pick_feasible, pick_lowest)
    g = np.where(streaming, 16, g_of[pick]).astype(np.int64)
    budget = np.where(streaming, 0.0, b_of[pick])
    return streaming, g, budget


# ---- training -----------------------------------------------------------------------------------------------------
def split_prompts(n_prompts: int, n_kinds: int) -> tuple[np.ndarray, np.ndarray]:
    """Held-out = the last full rotation of prompt kinds (one prompt of each kind), by prompt, never by group."""
    n_test = n_kinds if n_prompts >= 2 * n_kinds else max(1, n_prompts // 4)
    idx = np.arange(n_prompts)
    return idx[: n_prompts - n_test], idx[n_prompts - n_test :]


def loo_prior(errors: np.ndarray) -> np.ndarray:
    """errors [P, ...] -> for each prompt the mean of the *other* prompts' errors (its training-time prior)."""
    n = errors.shape[0]
    if n < 2:
        return errors.copy()
    return (errors.sum(0, keepdims=True) - errors) / (n - 1)


def train(features: np.ndarray, errors: np.ndarray, prior: np.ndarray, *, epsilon: float, seed: int = 0,
          epochs: int = 100, lr: float = 5e-4, weight_decay: float = 1e-3, prior_table: np.ndarray | None = None,
          meta: dict[str, object] | None = None) -> Predictor:
    """Fit on features [S, F], effective errors [S, C] and prior errors [S, C]; deterministic for a given seed (CPU,
    full batch). prior_table [L, Hkv, C] is stored for online use (default: none, tests)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is ~7x faster than two contended ones (and deterministic)
    try:
        pred = _train(features, errors, prior, epsilon=epsilon, seed=seed, epochs=epochs, lr=lr,
                      weight_decay=weight_decay, meta=meta)
    finally:
        torch.set_num_threads(threads)
    if prior_table is not None:
        pred.weights["prior"] = prior_table.astype(np.float32)
    return pred


def _train(features: np.ndarray, errors: np.ndarray, prior: np.ndarray, *, epsilon: float, seed: int, epochs: int,
           lr: float, weight_decay: float, meta: dict[str, object] | None) -> Predictor:
    import torch

    torch.manual_seed(seed)
    log_prior = torch.log(torch.from_numpy(prior.reshape(-1, N_CONFIGS).astype(np.float32)) + LOG_FLOOR)
    x = torch.cat([torch.from_numpy(features.reshape(-1, N_FEATURES).astype(np.float32)), log_prior], dim=1)
    e = torch.from_numpy(errors.reshape(x.shape[0], -1).astype(np.float32))
    mu, sd = x.mean(0), x.std(0).clamp(min=1e-3)
    xn = (x - mu) / sd
    y_cls = (e[:, 0] <= epsilon).float()
    y_reg = torch.log(e + LOG_FLOOR)
    n_out = 1 + e.shape[1]
    net = torch.nn.Sequential(torch.nn.Linear(N_INPUTS, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                              torch.nn.ReLU(), torch.nn.Linear(HIDDEN, n_out))
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs)
    for _ in range(epochs):
        opt.zero_grad()
        out = net(xn)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(out[:, 0], y_cls) + \
            torch.nn.functional.mse_loss(log_prior + out[:, 1:], y_reg)
        loss.backward()
        opt.step()
        sched.step()
    lin = [m for m in net if isinstance(m, torch.nn.Linear)]
    weights = {"mu": mu.numpy(), "sd": sd.numpy()}
    for i, m in enumerate(lin, 1):
        weights[f"w{i}"] = m.weight.detach().numpy().T.copy()
        weights[f"b{i}"] = m.bias.detach().numpy().copy()
    full_meta = {"format": FORMAT, "epsilon": epsilon, "features": list(FEATURE_NAMES), "hidden": HIDDEN,
                 "configs": [c.key for c in all_configs()], "seed": seed, "epochs": epochs, "lr": lr,
                 "weight_decay": weight_decay, **(meta or {})}
    return Predictor(weights, full_meta)


# ---- evaluation (held-out prompts) ----------------------------------------------------------------------------------
def evaluate(pred: Predictor, features: np.ndarray, errors: np.ndarray, lengths: np.ndarray, train_errors: np.ndarray,
             sink: int, window: int, head_dim: int) -> dict[str, float]:
    """Metrics on held-out prompts. features [P, L, G, F], errors [P, L, G, C], lengths [P] (prefix tokens);
    train_errors [P', L, G, C] gives the static baselines (what a per-model plan from the same data would do)."""
    eps = pred.epsilon
    static_mean = train_errors.mean(0)  # [L, G, C]: the static plan's label (and the predictor's prior)
    p, err_hat = pred.forward(features, np.broadcast_to(static_mean, errors.shape))
    y = errors[..., 0] <= eps
    static_stream = static_mean[..., 0] <= eps
    res: dict[str, float] = {
        "heldout_groups": float(y.size),
        "stream_ok_rate": float(y.mean()),
        "accuracy": float(((p >= 0.5) == y).mean()),
        "accuracy_static": float((np.broadcast_to(static_stream, y.shape) == y).mean()),
        "accuracy_majority": float(max(y.mean(), 1 - y.mean())),
        "stream_precision": float(y[p >= 0.5].mean()) if (p >= 0.5).any() else float("nan"),
    }
    # calibration of P(streaming): expected calibration error over 10 equal-width bins
    bins = np.clip((p * 10).astype(int), 0, 9)
    res["ece_stream"] = float(sum(abs(p[bins == b].mean() - y[bins == b].mean()) * (bins == b).mean()
                                  for b in range(10) if (bins == b).any()))
    # deviation prediction: errors in log10, and the reliability at the epsilon boundary
    le, lh = np.log10(errors + LOG_FLOOR), np.log10(err_hat + LOG_FLOOR)
    ls = np.log10(np.broadcast_to(static_mean, errors.shape) + LOG_FLOOR)
    res["mae_log10"] = float(np.abs(lh - le).mean())
    res["bias_log10"] = float((lh - le).mean())
    res["mae_log10_static"] = float(np.abs(ls - le).mean())
    res["ece_dev"] = float(_dev_ece(err_hat, errors))
    fe, fa = err_hat <= eps, errors <= eps
    res["feasible_agreement"] = float((fe == fa).mean())
    res["feasible_false_rate"] = float((fe & ~fa).sum() / max(1, fe.sum()))  # predicted under eps but not
    # the plans themselves: per-sequence (predicted) vs static, judged by the held-out labels
    tot = {"pred_err": 0.0, "pred_viol": 0.0, "pred_bytes": 0.0, "static_err": 0.0, "static_viol": 0.0,
           "static_bytes": 0.0, "oracle_bytes": 0.0}
    n_l, n_g = features.shape[1], features.shape[2]
    from fluxion_lite.plan.selector import select_plan

    for i in range(features.shape[0]):
        n = int(lengths[i])
        costs = config_costs(n, sink, window, head_dim)
        full_bytes = n * 2 * head_dim * 2
        s, g, b = select_groups(p[i].reshape(-1), err_hat[i].reshape(-1, err_hat.shape[-1]), costs, eps)
        lab = {(layer, h, c.key): (float(static_mean[layer, h, j]), 0.0) for layer in range(n_l) for h in range(n_g)
               for j, c in enumerate(all_configs())}
        static = select_plan(lab, n_l, n_g, eps, n, sink, window, head_dim)
        oracle = {(layer, h, c.key): (float(errors[i, layer, h, j]), 0.0) for layer in range(n_l) for h in range(n_g)
                  for j, c in enumerate(all_configs())}
        best = select_plan(oracle, n_l, n_g, eps, n, sink, window, head_dim)
        for k in range(n_l * n_g):
            layer, h = divmod(k, n_g)
            for name, cfg in (("pred", Config(bool(s[k]), int(g[k]), float(b[k]))),
                              ("static", _cfg(static.groups[layer][h]))):
                j = _index(cfg)
                tot[f"{name}_err"] += errors[i, layer, h, j]
                tot[f"{name}_viol"] += errors[i, layer, h, j] > eps
                tot[f"{name}_bytes"] += costs[j] / full_bytes
            tot["oracle_bytes"] += costs[_index(_cfg(best.groups[layer][h]))] / full_bytes
    denom = features.shape[0] * n_l * n_g
    res |= {k: float(v) / denom for k, v in tot.items()}
    return res


def _dev_ece(err_hat: np.ndarray, errors: np.ndarray, n_bins: int = 10) -> float:
    """Calibration error of the deviation prediction: held-out (group, config) cells binned by predicted log10 error
    (equal-count bins); mean |mean log10 predicted - mean log10 actual| over bins, weighted by bin size."""
    lh, le = np.log10(err_hat + LOG_FLOOR).ravel(), np.log10(errors + LOG_FLOOR).ravel()
    order = np.argsort(lh, kind="stable")
    total = 0.0
    for chunk in np.array_split(order, n_bins):
        if len(chunk):
            total += abs(lh[chunk].mean() - le[chunk].mean()) * len(chunk) / len(order)
    return total


def reliability_table(err_hat: np.ndarray, errors: np.ndarray, edges: tuple[float, ...] = (0, 0.01, 0.03, 0.1, 0.3, math.inf)
                      ) -> list[tuple[str, int, float, float]]:
    """(bin, cells, mean predicted, mean actual) of the deviation prediction, bins of the predicted error."""
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (err_hat >= lo) & (err_hat < hi)
        if sel.any():
            rows.append((f"[{lo:g}, {hi:g})", int(sel.sum()), float(err_hat[sel].mean()), float(errors[sel].mean())))
    return rows


def _cfg(gp: object) -> Config:
    return Config(bool(gp.streaming), int(gp.g), float(gp.budget))  # type: ignore[attr-defined]


def _index(cfg: Config) -> int:
    keys = [c.key for c in all_configs()]
    return keys.index(cfg.key)
