"""Priority scheduler: queue order, exactly-once assignment, makespan-minimising splits, degenerate cases. No GPU."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from fluxion_lite.sparse.cost_model import Costs, CostModel, measure_costs, priority_order, split_tasks, task_bytes

MB = 1e6


def exactly_once(split: object, n: int) -> None:
    both = np.concatenate([split.cpu, split.gpu])  # type: ignore[attr-defined]
    assert sorted(both.tolist()) == list(range(n))


def best_by_brute_force(nbytes: list[float], costs: Costs) -> float:
    best = float("inf")
    for mask in itertools.product((0, 1), repeat=len(nbytes)):
        g = sum(b for b, m in zip(nbytes, mask) if m)
        best = min(best, costs.makespan(sum(nbytes) - g, g))
    return best


def test_task_bytes_and_largest_first_order() -> None:
    b = task_bytes(np.array([3, 1, 2, 3]), np.array([16, 128, 64, 16]), head_dim=128, elem_size=2)
    assert b.tolist() == [3 * 16 * 512, 128 * 512, 2 * 64 * 512, 3 * 16 * 512]
    assert priority_order(b).tolist() == [1, 2, 0, 3]  # ties keep submission order
    split = split_tasks(b, Costs(cpu_gbs=10, gather_gbs=40, h2d_gbs=20))
    for side in (split.cpu, split.gpu):  # each side pulls in queue order
        assert (np.diff(b[side]) <= 0).all()


def test_equal_speeds_split_the_volume_evenly() -> None:
    # no gather cost, CPU and PCIe equally fast: the best split halves the bytes
    costs = Costs(cpu_gbs=10, gather_gbs=1e9, h2d_gbs=10)
    nbytes = [8 * MB, 6 * MB, 5 * MB, 4 * MB, 3 * MB, 2 * MB]
    split = split_tasks(nbytes, costs)
    exactly_once(split, len(nbytes))
    assert split.cpu_bytes == pytest.approx(14 * MB) and split.gpu_bytes == pytest.approx(14 * MB)
    assert split.makespan_s == pytest.approx(best_by_brute_force(nbytes, costs))


def test_split_follows_bandwidth_ratio() -> None:
    # the GPU side is 3x as fast (cheap gather, fast PCIe): it should take about 3/4 of the volume
    costs = Costs(cpu_gbs=10, gather_gbs=1000, h2d_gbs=30)
    nbytes = [1 * MB] * 40
    split = split_tasks(nbytes, costs)
    exactly_once(split, 40)
    assert split.gpu_fraction == pytest.approx(0.75, abs=0.03)
    assert split.makespan_s <= costs.makespan(40 * MB, 0) / 3.5


def test_gather_on_the_cpu_pool_can_make_the_gpu_not_worth_it() -> None:
    # gather slower than CPU attention (the H200 host's measured kernels): every byte sent costs the CPU more
    costs = Costs(cpu_gbs=65, gather_gbs=53, h2d_gbs=55, cpu_fixed_s=2e-5, gather_fixed_s=2e-5, h2d_fixed_s=1e-5)
    split = split_tasks([4 * MB, 2 * MB, 1 * MB], costs)
    assert split.gpu.size == 0 and split.cpu.tolist() == [0, 1, 2]


def test_greedy_is_near_optimal_on_random_task_lists() -> None:
    rng = np.random.default_rng(0)
    for _ in range(30):
        costs = Costs(cpu_gbs=float(rng.uniform(5, 60)), gather_gbs=float(rng.uniform(30, 300)),
                      h2d_gbs=float(rng.uniform(5, 60)), cpu_fixed_s=float(rng.uniform(0, 5e-5)),
                      gather_fixed_s=float(rng.uniform(0, 5e-5)), h2d_fixed_s=float(rng.uniform(0, 5e-5)))
        nbytes = rng.uniform(0.05, 4, size=int(rng.integers(1, 11))) * MB
        split = split_tasks(nbytes, costs)
        exactly_once(split, len(nbytes))
        assert split.makespan_s <= costs.makespan(nbytes.sum(), 0) + 1e-12  # never worse than static placements
        assert split.makespan_s <= costs.makespan(0, nbytes.sum()) + 1e-12
        assert split.makespan_s <= best_by_brute_force(list(nbytes), costs) * 1.34  # LPT-style bound, 2 workers


def test_degenerate_cases() -> None:
    costs = Costs(cpu_gbs=10, gather_gbs=100, h2d_gbs=10)
    empty = split_tasks([], costs)
    assert empty.cpu.size == empty.gpu.size == 0 and empty.makespan_s == 0.0
    one = split_tasks([5 * MB], costs)
    exactly_once(one, 1)
    zeros = split_tasks([0.0, 0.0, 0.0], costs)  # empty selections: nothing to move, nothing to pay
    exactly_once(zeros, 3)
    assert zeros.makespan_s == 0.0
    no_gpu = Costs(cpu_gbs=10, gather_gbs=100, h2d_gbs=None)
    s = split_tasks([1 * MB, 2 * MB], no_gpu)
    assert s.gpu.size == 0 and s.cpu.tolist() == [1, 0]
    with pytest.raises(ValueError, match="GPU side"):
        split_tasks([1 * MB], no_gpu, placement="gpu")
    assert split_tasks([1 * MB, 2 * MB], costs, placement="cpu").gpu.size == 0  # static placements
    assert split_tasks([1 * MB, 2 * MB], costs, placement="gpu").cpu.size == 0
    with pytest.raises(ValueError, match="non-negative"):
        split_tasks([-1.0], costs)
    with pytest.raises(ValueError, match="placement"):
        split_tasks([1.0], costs, placement="both")  # type: ignore[arg-type]


def test_cost_model_follows_observed_rates() -> None:
    model = CostModel(Costs(cpu_gbs=10, gather_gbs=10, h2d_gbs=10), alpha=0.5)
    for _ in range(20):
        model.observe_cpu(40 * MB, 40 * MB / 40e9)  # the CPU turns out 4x faster
        model.observe_h2d(1e3, 1.0)  # too small to say anything: ignored
    assert model.costs.cpu_gbs == pytest.approx(40, rel=1e-3)
    assert model.costs.h2d_gbs == 10


def test_measured_costs_are_positive_and_cached() -> None:
    costs = measure_costs("cpu", probe_mib=16)
    assert costs.cpu_gbs > 0 and costs.gather_gbs > 0 and costs.h2d_gbs is None
    assert measure_costs("cpu", probe_mib=16) is costs


def test_zero_copy_model_drops_the_gather_term() -> None:
    # the H200 host's kernels: with staging the GPU side is never worth it; with zero-copy the CPU does no gather
    # and the two sides overlap, so the split follows the bandwidth ratio
    h200 = dict(cpu_gbs=65, gather_gbs=53, h2d_gbs=55, cpu_fixed_s=2e-5, gather_fixed_s=2e-5, h2d_fixed_s=1e-5)
    zc = Costs(**h200, zero_copy=True, pcie_read_gbs=40, gpu_attn_gbs=None, zc_fixed_s=3e-5)
    assert zc.has_gpu and zc.makespan(8 * MB, 0) == pytest.approx(2e-5 + 8 * MB / 65e9)
    assert zc.makespan(3 * MB, 5 * MB) == pytest.approx(max(2e-5 + 3 * MB / 65e9, 3e-5 + 5 * MB / 40e9))
    nbytes = [0.5 * MB] * 40
    split = split_tasks(nbytes, zc)
    exactly_once(split, 40)
    assert split.gpu_fraction == pytest.approx(40 / 105, abs=0.03)
    assert split_tasks(nbytes, Costs(**h200)).gpu.size == 0  # the staging model: all-CPU
    # the device attention adds to the GPU side: a slower one takes fewer bytes
    slow = Costs(**h200, zero_copy=True, pcie_read_gbs=40, gpu_attn_gbs=40, zc_fixed_s=3e-5)
    assert slow.zero_copy_time(4 * MB) == pytest.approx(3e-5 + 4 * MB / 40e9 + 4 * MB / 40e9)
    assert split_tasks(nbytes, slow).gpu_fraction < split.gpu_fraction


def test_zero_copy_without_a_probed_rate_has_no_gpu_side() -> None:
    costs = Costs(cpu_gbs=10, gather_gbs=10, h2d_gbs=10, zero_copy=True, pcie_read_gbs=None)
    assert not costs.has_gpu and costs.zero_copy_time(1.0) == float("inf")
    assert split_tasks([1 * MB, 2 * MB], costs).gpu.size == 0
    with pytest.raises(ValueError, match="GPU side"):
        split_tasks([1 * MB], costs, placement="gpu")


def test_cost_model_follows_the_zero_copy_rate() -> None:
    model = CostModel(Costs(cpu_gbs=10, gather_gbs=10, h2d_gbs=10, zero_copy=True, pcie_read_gbs=20,
                            gpu_attn_gbs=1000), alpha=0.5)
    for _ in range(30):
        model.observe_zero_copy(10 * MB, 10 * MB / 30e9 + 10 * MB / 1000e9)  # reads at 30 GB/s
    assert model.costs.pcie_read_gbs == pytest.approx(30, rel=1e-3)
    model.observe_zero_copy(1e3, 1.0)  # too small: ignored
    assert model.costs.pcie_read_gbs == pytest.approx(30, rel=1e-3)


def test_all_cpu_shortcut_when_the_gpu_fixed_cost_exceeds_the_cpu_time() -> None:
    """Small layers (batch 1) go all-CPU without the greedy loop, and only when no split could be faster: any use of
    the GPU costs at least makespan(0, smallest task)."""
    zc = Costs(cpu_gbs=60.0, gather_gbs=50.0, h2d_gbs=50.0, zero_copy=True, pcie_read_gbs=50.0, zc_fixed_s=5e-4)
    small = np.full(16, 600e3)  # 9.6 MB: 0.16 ms on the CPU < 0.5 ms fixed GPU cost
    s = split_tasks(small, zc)
    assert len(s.gpu) == 0 and s.makespan_s == pytest.approx(zc.makespan(small.sum(), 0.0))
    big = np.full(16, 20e6)  # 320 MB: the GPU side pays off again
    s = split_tasks(big, zc)
    assert len(s.gpu) > 0 and s.makespan_s < zc.makespan(big.sum(), 0.0)
    # the shortcut never gives a worse makespan than trying every split of a small case
    rng = np.random.default_rng(0)
    for _ in range(50):
        nb = rng.uniform(1e4, 2e6, size=5)
        best = min(zc.makespan(float(nb[list(m)].sum()), float(nb.sum() - nb[list(m)].sum()))
                   for r in range(6) for m in itertools.combinations(range(5), r))
        assert split_tasks(nb, zc).makespan_s <= best * 1.35  # greedy bound; equal to best where it shortcuts
        if zc.makespan(nb.sum(), 0.0) <= zc.makespan(0.0, nb.min()):
            assert split_tasks(nb, zc).makespan_s == pytest.approx(best)
