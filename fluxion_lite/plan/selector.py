"""Selector: per KV group, the cheapest configuration whose calibrated effective error stays under epsilon.

Cost is bytes touched per decode step for one group (plan/cost.py): small blocks select precisely but scan more
summaries; large blocks scan little but read more KV: the selector trades the two per group.
"""
from __future__ import annotations

import json
from pathlib import Path

from fluxion_lite.plan.cost import bytes_per_step
from fluxion_lite.plan.space import all_configs
from fluxion_lite.plan.sparse_plan import GroupPlan, SparsePlan

Labels = dict[tuple[int, int, str], tuple[float, float]]
DEFAULT_EPSILON = 0.1  # bench/policy_sweep.py: at 4K on qwen2.5-coder-0.5b this beats `fixed` on KL and bytes touched


def select_plan(labels: Labels, n_layers: int, n_groups: int, epsilon: float, n_ref: int, sink: int, window: int,
                head_dim: int, source: str = "", summary_weight: float = 1.0) -> SparsePlan:
    """Cheapest feasible configuration per group; where none meets epsilon, the lowest-error one."""
    configs = all_configs()
    groups: list[list[GroupPlan]] = []
    for layer in range(n_layers):
        row = []
        for h in range(n_groups):
            scored = [(labels[(layer, h, c.key)][0], bytes_per_step(c, n_ref, sink, window, head_dim, summary_weight), c)
                      for c in configs]
            feasible = [s for s in scored if s[0] <= epsilon]
            # ties in bytes go to the lower error, then to the configuration listed first (deterministic)
            err, _, best = min(feasible, key=lambda s: (s[1], s[0])) if feasible else min(scored, key=lambda s: (s[0], s[1]))
            row.append(GroupPlan(best.streaming, best.g if not best.streaming else 16, best.budget))
        groups.append(row)
    return SparsePlan(sink, window, groups, source=source or f"calibrated epsilon={epsilon}")


def save_labels(path: Path, labels: Labels, meta: dict[str, object]) -> None:
    rows = [{"layer": k[0], "group": k[1], "config": k[2], "error": v[0], "read_fraction": v[1]} for k, v in labels.items()]
    path.write_text(json.dumps({"meta": meta, "labels": rows}))


def load_labels(path: Path) -> tuple[Labels, dict[str, object]]:
    data = json.loads(Path(path).read_text())
    labels = {(r["layer"], r["group"], r["config"]): (r["error"], r["read_fraction"]) for r in data["labels"]}
    return labels, data["meta"]

