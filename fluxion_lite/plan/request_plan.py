"""Per-request sparse plans: a request's own error bound (epsilon), or the head-property predictor run on a
sequence's own prefill.

assign(seq, plan) gives a sequence a plan of its own (the engine's, for a request that sets epsilon: the selector's
plan at that epsilon from the model's calibration labels). With a predictor, the hooks below plan the others:

SparseAttention calls three hooks (and nothing else changes for it):
  record(layer, seq, q_chunk)          every prefill chunk: keep the last FEATURE_QUERIES queries of the layer
  prefill_done(layer, seq, views)      the sequence's first decode step, per layer, while the dense scratch still holds
                                       every layer's prompt K/V: at the first call, features of all layers at once ->
                                       predictor -> selector -> every layer's plan rows
  rows(step)                           the step's [L, B, Hkv] plan arrays, or None when no row has its own plan
A sequence without a per-request plan (no predictor file, or a prompt too short to matter) keeps the static plan.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fluxion_lite.model.config import ModelConfig
from fluxion_lite.plan.head_features import FEATURE_QUERIES, prompt_features
from fluxion_lite.plan import files as plan_files
from fluxion_lite.plan.predictor import Predictor, config_costs, select_groups
from fluxion_lite.plan.sparse_plan import GroupPlan, SparsePlan
from fluxion_lite.sparse.step import group_rows
from fluxion_lite.settings import Settings


@dataclass
class RowPlan:
    """Plan arrays of one decode step's rows: [L, B, Hkv] each."""

    retrieval: np.ndarray
    g: np.ndarray  # 1 for streaming groups
    budget: np.ndarray
    gidx: np.ndarray  # row of the step's per-g arrays (sparse_step.group_rows)
    gidx_dev: torch.Tensor
    long_only: np.ndarray | None = None  # the static plan's long-only flags where rows keep them; None: none


class RequestPlanner:
    def __init__(self, predictor: Predictor | None, static: SparsePlan, cfg: ModelConfig, wo: list[torch.Tensor],
                 min_context: int = 0):
        self.pred, self.static, self.cfg, self.wo = predictor, static, cfg, wo
        self.r = cfg.n_heads // cfg.n_kv_heads
        # below sink + window + a block everything is read anyway: no point predicting
        self.min_context = max(min_context, static.sink + static.window + 128)
        self._static = static.arrays()  # retrieval, g, budget, long-only: [L, Hkv] each
        # a step's rows follow the static plan's layout (SparseAttention.long_exact), whatever a request's plan is
        self._exact_long_rows = static.exact_long_rows
        self._q: dict[tuple[int, int], torch.Tensor] = {}  # (seq, layer) -> [<=Q, Hq, D]
        self._plans: dict[int, tuple[np.ndarray, ...]] = {}  # seq -> ([L,Hkv] x 4), as _static
        # assigned plans whose context scaling differs from the static plan's (a step scales every row's budgets by
        # the static plan's factor at its context; rows() corrects these rows to their own plan's)
        self._own: dict[int, SparsePlan] = {}
        self._done: set[int] = set()  # sequences whose first decode step planned them (or found nothing to plan)
        self._version = 0
        self._cache: tuple[object, int, RowPlan | None] | None = None
        self._costs: dict[int, np.ndarray] = {}
        self.seconds = 0.0  # total time in prefill_done (features + predictor + selector)
        self.layer_calls = 0
        self.last_seq: int | None = None
        self.last_plan: SparsePlan | None = None

    def assign(self, seq_id: int, plan: SparsePlan) -> None:
        """The sequence runs this plan (same shape and sink/window as the static plan) instead of the static one or
        the predictor's."""
        if (plan.sink, plan.window) != (self.static.sink, self.static.window):
            raise ValueError(f"a per-request plan keeps the static plan's sink {self.static.sink} and window "
                             f"{self.static.window}; got {plan.sink} and {plan.window}")
        self._plans[seq_id] = tuple(a.copy() for a in plan.arrays())  # type: ignore[assignment]
        self._own[seq_id] = plan
        self._done.add(seq_id)  # the predictor leaves it alone
        self._version += 1

    @property
    def predicts(self) -> bool:
        """Whether a predictor plans sequences (else only assigned plans differ from the static one)."""
        return self.pred is not None

    def active(self) -> bool:
        """Whether some live sequence has or may get a plan of its own (the decode step must run eagerly)."""
        return self.pred is not None or bool(self._plans)

    # ---- hooks ----------------------------------------------------------------------------------------------------
    def record(self, layer: int, seq_id: int, q: torch.Tensor) -> None:
        if self.pred is None or seq_id in self._done:
            return
        tail = q[-FEATURE_QUERIES:]
        prev = self._q.get((seq_id, layer))
        if prev is not None and tail.shape[0] < FEATURE_QUERIES:
            tail = torch.cat([prev, tail])[-FEATURE_QUERIES:]
        self._q[(seq_id, layer)] = tail.detach().clone()

    def prefill_done(self, layer: int, seq_id: int, views: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Called per layer at the sequence's first decode step (layer 0 first), views(l) giving layer l's prompt
        K/V [Hkv, N, D] from the dense scratch, which holds every layer until that step ends. The first call plans
        all layers at once (head_features.prompt_features: the features' tensor ops once per batch of layers, not
        per layer); the other calls return at once."""
        if self.pred is None or seq_id in self._done:
            return
        self._done.add(seq_id)
        c = self.cfg
        qs = [self._q.pop((seq_id, i), None) for i in range(c.n_layers)]
        layers = [i for i, q in enumerate(qs) if q is not None]
        kv = [views(i) for i in layers]  # views into the scratch: no copies
        n = kv[0][0].shape[1] if kv else 0
        if n < self.min_context:
            return
        t0 = time.perf_counter()
        feats = prompt_features([qs[i].view(qs[i].shape[0], c.n_kv_heads, self.r, c.head_dim) for i in layers],
                                [k for k, _ in kv], [v for _, v in kv], [self.wo[i] for i in layers], layers,
                                c.n_layers, self.static.sink, self.static.window)
        if n not in self._costs:
            self._costs = {n: config_costs(n, self.static.sink, self.static.window, c.head_dim)}
        if seq_id not in self._plans:
            self._plans[seq_id] = tuple(a.copy() for a in self._static)  # type: ignore[assignment]
        ret_a, g_a, b_a, long_a = self._plans[seq_id]
        for i, f in zip(layers, feats):
            p, err = self.pred.predict_layer(f.numpy(), i)
            streaming, g, budget = select_groups(p, err, self._costs[n], self.pred.epsilon)
            ret_a[i], g_a[i], b_a[i], long_a[i] = ~streaming, np.where(streaming, 1, g), budget, False
        self._version += 1
        self.last_seq = seq_id
        self.seconds += time.perf_counter() - t0
        self.layer_calls += len(layers)

    def forget(self, seq_id: int) -> None:
        if seq_id == self.last_seq:  # keep the latest per-request plan for explain()
            self.last_plan = self.plan_of(seq_id)
            self.last_seq = None
        self._plans.pop(seq_id, None)
        self._own.pop(seq_id, None)
        self._done.discard(seq_id)
        for key in [k for k in self._q if k[0] == seq_id]:
            del self._q[key]

    def rows(self, step: object, seq_ids: list[int], device: torch.device) -> RowPlan | None:
        """[L, B, Hkv] arrays for a step's rows (cached per step object and plan version)."""
        if self._cache is not None and self._cache[0] is step and self._cache[1] == self._version:
            return self._cache[2]
        rp = None
        if any(s in self._plans for s in seq_ids):
            per = [self._plans.get(s, self._static) for s in seq_ids]
            ret, g, bud, long_only = (np.stack([p[i] for p in per], axis=1) for i in range(4))
            n = getattr(step, "n", None)  # [B] each row's context (DecodeStep)
            for b, s in enumerate(seq_ids):
                own = self._own.get(s)
                if own is not None and n is not None:  # the step applies the static factor: make it this plan's
                    bud[:, b] *= float(own.budget_factor(int(n[b]))) / float(self.static.budget_factor(int(n[b])))
            gidx = group_rows(g, long_only, self._exact_long_rows)
            rp = RowPlan(ret, g, bud, gidx, torch.from_numpy(gidx).to(device), long_only if long_only.any() else None)
        self._cache = (step, self._version, rp)
        return rp

    # ---- reporting ------------------------------------------------------------------------------------------------
    def plan_of(self, seq_id: int) -> SparsePlan | None:
        if seq_id in self._own:
            return self._own[seq_id]
        if seq_id not in self._plans:
            return None
        ret, g, bud, long_only = self._plans[seq_id]
        groups = [[GroupPlan(not bool(ret[i, h]), int(g[i, h]) if ret[i, h] else 16,
                             float(bud[i, h]) if ret[i, h] else 0.0, bool(ret[i, h] and long_only[i, h]))
                   for h in range(ret.shape[1])] for i in range(ret.shape[0])]
        st = self.static  # its short-context scale applies to these budgets too (the step's budget_scale)
        return SparsePlan(st.sink, st.window, groups, source=f"predictor, sequence {seq_id}",
                          short_scale=st.short_scale, short_tokens=st.short_tokens, budget_curve=st.budget_curve)

    def describe(self) -> str:
        if self.pred is None:
            return ("per-request plans: a request that sets epsilon runs the selector's plan at that epsilon (from "
                    "the model's calibration labels); the others the plan below")
        m = self.pred.meta
        ho = m.get("heldout", {})
        line = (f"per-request plans: predictor {m.get('model')} ({self.pred.n_params:,} parameters, epsilon "
                f"{self.pred.epsilon:g}, held-out accuracy {ho.get('accuracy', float('nan')):.3f}) replaces the static "
                f"plan after each prompt of >= {self.min_context} tokens; the static plan below is the fallback")
        if self.layer_calls:
            line += f"\n  predictor time so far: {1e3 * self.seconds / self.layer_calls:.3f} ms per layer"
        last = self.plan_of(self.last_seq) if self.last_seq is not None else self.last_plan
        if last is not None:
            line += "\n" + last.explain()
        return line


def load_planner(model_name: str, cfg: ModelConfig, static: SparsePlan, wo: list[torch.Tensor],
                 settings: Settings | None = None) -> RequestPlanner | None:
    """The model's planner (the user's predictor first, else the shipped one), or None when there is none (the
    static plan is used alone). settings: whose cache_dir holds the user's files (None: Settings.load())."""
    path = plan_files.find(model_name, ".predictor.npz", settings)
    if path is None:
        return None
    pred = Predictor.load(path)
    m = pred.meta
    if (m.get("n_layers"), m.get("n_groups"), m.get("sink"), m.get("window")) != (cfg.n_layers, cfg.n_kv_heads,
                                                                                   static.sink, static.window):
        return None  # trained for another shape or another sink/window: the static plan is the safe choice
    return RequestPlanner(pred, static, cfg, wo)
