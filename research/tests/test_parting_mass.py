"""research/parting_mass.py's pieces: the recorded attention mass at the target position, the region split, and the
split of the mass between sink and window into what a step's blocks read and the rest."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "research"))

from parting_mass import LastRowMass, read_split, regions  # noqa: E402

from fluxion_lite.model.attention import DenseAttention, SeqChunk  # noqa: E402


def test_last_row_mass_is_the_group_mean_of_the_softmax_and_attention_is_unchanged() -> None:
    gen = torch.Generator().manual_seed(3)
    hkv, r, d, n = 2, 3, 8, 37
    q = torch.randn(n, hkv * r, d, generator=gen)
    k, v = torch.randn(n, hkv, d, generator=gen), torch.randn(n, hkv, d, generator=gen)
    target = 29
    rec = LastRowMass(1, hkv, d, torch.float32, torch.device("cpu"), target=target)
    plain = DenseAttention(1, hkv, d, torch.float32, torch.device("cpu"))
    outs = []
    for backend in (rec, plain):
        backend.allocate(0)
        outs.append(torch.cat([backend.attend(0, q[s:e], k[s:e], v[s:e], [SeqChunk(0, s, e - s)])
                               for s, e in ((0, 20), (20, n))]))  # the target lies in the second chunk
    torch.testing.assert_close(outs[0], outs[1])
    qd, kd = q[target].double().view(hkv, r, d), k[: target + 1].double().transpose(0, 1)  # [Hkv, r, D], [Hkv, L, D]
    want = torch.softmax(torch.einsum("hrd,hld->hrl", qd, kd) * d**-0.5, dim=-1).mean(1)  # [Hkv, target + 1]
    torch.testing.assert_close(rec.mass[0].double(), want, rtol=1e-5, atol=1e-6)


def test_regions_split_the_mass_with_window_over_sink_over_head_over_needles() -> None:
    args = argparse.Namespace(sink=4, head=8, window=6, g=4, tail=5)
    mass = torch.arange(1, 31, dtype=torch.float64)  # 30 positions, distinct weights
    got = regions(mass.float(), n_prompt=26, needles={1, 3, 5}, args=args)
    pos = torch.arange(30)
    sink, head = pos < 4, (pos >= 4) & (pos < 8)
    window = pos >= 24
    tail = (pos >= 21) & (pos < 26) & ~window  # the prompt's last 5 tokens not in the window: 21-23
    needles = ((pos // 4 == 3) | (pos // 4 == 5)) & ~window & ~tail  # block 1 lies in sink and head
    rest = ~(sink | head | window | needles | tail)
    assert int(tail.sum()) == 3
    for name, m in (("sink", sink), ("head", head), ("needles", needles), ("window", window), ("rest", rest),
                    ("tail", tail)):
        assert abs(got[name] - float(mass[m].sum())) < 1e-3, name
    assert abs(sum(got.values()) - float(mass.sum())) < 1e-3


def test_read_split_counts_the_read_blocks_between_sink_and_window_only() -> None:
    gen = torch.Generator().manual_seed(5)
    mass = torch.rand(50, generator=gen, dtype=torch.float64)  # 50 positions; g 8: blocks 0-6, the last partial
    sink, window, g = 5, 9, 8
    read = {0, 2, 5, 6}  # block 0 lies partly in the sink, 5 partly and 6 wholly in the window (positions 41-49)
    middle, got = read_split(mass.float(), read, g, sink, window)
    pos = torch.arange(50)
    mid = (pos >= sink) & (pos < 50 - window)
    in_read = torch.tensor([int(i) // g in read for i in pos])
    assert abs(middle - float(mass[mid].sum())) < 1e-5
    assert abs(got - float(mass[mid & in_read].sum())) < 1e-5
    assert 0 < got < middle
    assert read_split(mass.float(), set(), g, sink, window)[1] == 0.0
