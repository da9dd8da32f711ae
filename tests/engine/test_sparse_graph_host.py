"""The graphed sparse step's host fast path (sparse_graph.GraphedDecode.host): when the scheduler would put a whole
layer on the CPU, the decision is made before the selection from the sizes top-k will give (plan_tasks) and top-k
and attention run as one native call (native.PreparedSelection.select_attend). Checked here: the sizes predicted
equal the sizes selected, the fast path gives the eager backend's logits and counters, and expected_sizes."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from fluxion_lite.hostkv import native
from fluxion_lite.sparse.cost_model import Costs
from fluxion_lite.sparse.backend import SparseAttention
from fluxion_lite.sparse.host_capture import expected_sizes
from fluxion_lite.plan.sparse_plan import GroupPlan, SparsePlan
from decode_compare import decode_and_compare, eager_and_hooked, prefill
from tiny_model import make_cfg


def test_expected_sizes_per_layer() -> None:
    selected = np.array([32, 16, 64, 48, 0, 128], np.int64)
    ends = [0, 2, 2, 5, 6]  # layer 1 has no task; layer 2 holds an empty one
    assert expected_sizes(selected, ends) == [(48, 16), (0, 0), (112, 48), (128, 128)]
    assert expected_sizes(np.zeros(0, np.int64), [0, 0, 0]) == [(0, 0), (0, 0)]


@pytest.mark.parametrize("placement,zero_copy", [("auto", True), ("cpu", False)])
def test_fast_path_matches_eager_and_predicts_the_selection(monkeypatch: pytest.MonkeyPatch, placement: str,
                                                            zero_copy: bool) -> None:
    calls = []
    real = native.PreparedSelection.select_attend

    def counted(self: native.PreparedSelection, view: native.KVView, lo: int, hi: int,
                *rest: object) -> tuple[int, float, float]:  # rest: scoring, pins, pin_counts
        calls.append(hi - lo)
        return real(self, view, lo, hi, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(native.PreparedSelection, "select_attend", counted)
    cfg = make_cfg("llama", hq=6, hkv=3, d=32)
    eager, runner = eager_and_hooked(cfg, seed=6)
    # mixed granularities, budgets and streaming groups: some (row, group) have no task, layer 1 group 2 streams
    groups = [[GroupPlan(False, 16, 0.07), GroupPlan(False, 64, 0.3), GroupPlan(True)],
              [GroupPlan(False, 32, 0.02), GroupPlan(False, 128, 0.5), GroupPlan(False, 16, 1.0)]]
    plan = SparsePlan(sink=20, window=33, groups=groups, source="test")
    # a GPU side that never wins: every split is all-CPU, as on the H200 at small batches
    costs = Costs(cpu_gbs=10.0, gather_gbs=1000.0, h2d_gbs=None, zero_copy=True, pcie_read_gbs=1.0, zc_fixed_s=10.0)
    backends = [SparseAttention(cfg, plan, torch.float32, torch.device("cpu"), max_seqs=4, host_decode=False, placement=placement,
                                costs=costs, zero_copy=zero_copy) for _ in range(2)]  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(11)
    lengths = [250, 700, 180]  # the first crosses a 256-token page boundary while decoding
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths]
    prefill((eager, runner), backends, prompts)
    decode_and_compare(eager, runner, backends, lengths, 9, g, cfg.vocab_size)
    hooked = backends[1]
    assert len(calls) == 8 * cfg.n_layers  # every hooked layer took the one-call path (the first step ran eagerly)
    assert hooked.host_capture.mispredicted == 0
    s_eager, s_hooked = backends[0].stats(), hooked.stats()
    assert s_hooked["kv_read_fraction"] == pytest.approx(s_eager["kv_read_fraction"])
    assert s_hooked["gpu_byte_fraction"] == 0.0 and s_hooked["cpu_attn_ms"] > 0 and s_hooked["cpu_topk_ms"] > 0
    for a in backends:
        a.executor.close()
