"""The test matrix shared by the native kernel tests: SIMD paths the machine has, GQA ratios, thread counts, and one
case of the matrix (printed as the pytest id); and the ragged host store they run on."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from fluxion_lite.hostkv import native
from fluxion_lite.hostkv.store import HostKVStore

PATHS = native.simd_supported()
RATIOS = (1, 3, 4, 7, 8)
N_THREADS = max(2, native.physical_cores())
LENGTHS = (1000, 37, 513)  # ragged; every one ends in a partial block for every g
N_KV = 2


@dataclass(frozen=True)
class Case:
    simd: str
    ratio: int
    head_dim: int
    g: int
    dtype: torch.dtype
    threads: int

    def __str__(self) -> str:
        dt = "bf16" if self.dtype == torch.bfloat16 else "fp16"
        return f"{self.simd}-r{self.ratio}-d{self.head_dim}-g{self.g}-{dt}-t{self.threads}"


def rotated_cases() -> list[Case]:
    """Every SIMD path with every GQA ratio, head_dim / g / dtype / threads rotating across them (so each path also
    sees most of those); a test adds its own fixed cases for what it must cover on every path."""
    rot = itertools.cycle(itertools.product((64, 128), (16, 32, 64, 128), (torch.float16, torch.bfloat16),
                                            (1, N_THREADS)))
    return [Case(simd, ratio, *next(rot)) for simd in PATHS for ratio in RATIOS]


def ragged_store(head_dim: int, dtype: torch.dtype, rng: np.random.Generator, value_sums: bool = False
                 ) -> tuple[HostKVStore, list[int], list[np.ndarray], list[np.ndarray]]:
    """Sequences of LENGTHS tokens of random K/V offset from zero, each written as a prefill chunk plus five single
    decode tokens (partial-block summary updates), in pages allocated one at a time. -> store, slots, and the
    stored keys and values as float64 [n, Hkv, D] (the exact stored values)."""
    store = HostKVStore(1, N_KV, head_dim, dtype=dtype, max_seqs=4, page_tokens=256, initial_pages_per_seq=1,
                        value_sums=value_sums)
    slots, keys, values = [], [], []
    for n in LENGTHS:
        slot = store.allocate()
        k = torch.from_numpy(rng.standard_normal((n, N_KV, head_dim), dtype=np.float32) + 0.3).to(dtype)
        v = torch.from_numpy(rng.standard_normal((n, N_KV, head_dim), dtype=np.float32) - 0.2).to(dtype)
        split = n - 5
        store.append(0, slot, k[:split], v[:split])
        for i in range(split, n):
            store.append_batch(0, [slot], k[i:i + 1], v[i:i + 1])
        slots.append(slot)
        keys.append(k.float().numpy().astype(np.float64))
        values.append(v.float().numpy().astype(np.float64))
    return store, slots, keys, values


def excluded_ranges(g: int) -> list[list[tuple[int, int]]]:
    """Per ragged_store sequence, the top-k's excluded token ranges: a block-aligned sink + window; an unaligned
    range; two overlapping ranges."""
    return [[(0, g), (LENGTHS[0] - 2 * g, LENGTHS[0])], [(5, 9)], [(40, 200), (100, 300)]]


@dataclass
class TopkSetup:
    """A top-k test's inputs on the ragged store: one task row per (sequence, KV head), q [S, Hkv r, D] fp32 drawn
    right after the store from `rng` (which the test may keep drawing from), and excluded_ranges(g)."""
    case: Case
    store: HostKVStore
    view: native.KVView
    slots: list[int]
    keys: list[np.ndarray]
    q: np.ndarray
    excludes: list[list[tuple[int, int]]]
    rows: list[tuple[int, int]]  # (sequence index, KV head)
    rng: np.random.Generator

    def tasks(self, k: int) -> np.ndarray:
        """The task table asking every row for k blocks."""
        return np.concatenate([native.make_tasks(self.slots[si], si, h, self.case.g, k, exclude=self.excludes[si])
                               for si, h in self.rows])


def topk_setup(case: Case, seed: object) -> TopkSetup:
    """Select the case's SIMD path and threads, build the ragged store and q from a generator seeded by `seed`."""
    native.set_simd(case.simd)
    native.set_threads(case.threads)
    rng = np.random.default_rng(hash(seed) % 2**32)
    store, slots, keys, _ = ragged_store(case.head_dim, case.dtype, rng)
    q = rng.standard_normal((len(slots), N_KV * case.ratio, case.head_dim), dtype=np.float32)
    rows = [(si, h) for si in range(len(slots)) for h in range(N_KV)]
    return TopkSetup(case, store, store.view(0), slots, keys, q, excluded_ranges(case.g), rows, rng)
