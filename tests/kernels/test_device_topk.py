"""device_topk.select_top against a float64 numpy reference: per row exactly the k best blocks (ties to the lower
block index), their scores, -inf past k. Runs the Triton kernel through the interpreter (conftest sets
TRITON_INTERPRET=1) and the torch.topk fallback for rows too long for registers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fluxion_lite.sparse.device import topk as device_topk
from fluxion_lite.sparse.device.summaries import PINNED_SCORE

pytestmark = pytest.mark.skipif(device_topk.triton is None, reason="Triton not installed")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # compiled kernels on a GPU, else interpreted


def reference_top(row: np.ndarray, k: int) -> set[int]:
    """The k best blocks of one row: score descending (float64), then block index ascending."""
    return set(np.lexsort((np.arange(row.size), -row.astype(np.float64)))[:k].tolist())


def random_scores(gen: torch.Generator, b: int, h: int, nb: int) -> torch.Tensor:
    s = torch.randn(b, h, nb, generator=gen) * 40.0  # bounds of real queries span tens
    s[..., : min(3, nb)] = float("-inf")  # sink blocks: never eligible
    s[..., -min(2, nb):] = float("-inf")  # window blocks
    pins = torch.rand(b, h, nb, generator=gen) < 0.1
    s = torch.where(pins & torch.isfinite(s), torch.full_like(s, PINNED_SCORE), s)
    if nb > 8:  # exact ties between ordinary scores, and signed zeros
        s[..., 5] = s[..., 6]
        s[..., 7] = -0.0
        s[..., 8] = 0.0
    return s


def check(scores: torch.Tensor, k_row: torch.Tensor, width: int) -> None:
    b, h, _ = scores.shape
    ids = torch.full((b, h, width), -7, dtype=torch.long, device=DEV)
    vals = torch.full((b, h, width), 123.0, device=DEV)
    device_topk.select_top(scores.to(DEV), k_row.to(DEV), ids, vals)
    ids, vals = ids.cpu(), vals.cpu()
    for i in range(b):
        for j in range(h):
            k = min(int(k_row[i, j]), width)
            got = ids[i, j, :k].tolist()
            assert len(set(got)) == k, "a block chosen twice"
            want = reference_top(scores[i, j].numpy(), k)
            if set(got) != want:  # ties (score equal) may pick either block only at the threshold...
                row = scores[i, j].double().numpy()
                assert sorted(row[got]) == sorted(row[list(want)]), (i, j, k)
                pytest.fail(f"row ({i}, {j}): ties resolved to other blocks than the lower indices")
            assert torch.equal(vals[i, j, :k], scores[i, j, ids[i, j, :k]])
            assert (vals[i, j, k:] == float("-inf")).all() and (ids[i, j, k:] == 0).all()


@pytest.mark.parametrize("b,h,nb,width", [(1, 1, 1, 1), (1, 2, 37, 5), (2, 3, 200, 40), (1, 8, 2048, 90),
                                           (3, 2, 513, 513), (2, 2, 4100, 300)])
def test_select_top_matches_reference(b: int, h: int, nb: int, width: int) -> None:
    gen = torch.Generator().manual_seed(nb * 31 + width)
    scores = random_scores(gen, b, h, nb)
    k_row = torch.randint(0, width + 4, (b, h), generator=gen)  # some rows ask for more than width
    k_row[0, 0] = 0  # a streaming group: nothing chosen
    check(scores, k_row, width)


def test_signed_zeros_tie_by_block_index() -> None:
    scores = torch.tensor([[[-1.0, 0.0, -0.0, 2.0, -0.0, 0.0]]])
    for k in range(1, 7):  # the threshold falls among the zeros for k = 2..5
        check(scores, torch.tensor([[k]]), 6)


def test_rows_with_fewer_eligible_blocks_than_k() -> None:
    gen = torch.Generator().manual_seed(5)
    scores = torch.full((2, 2, 64), float("-inf"))
    scores[..., 10:14] = torch.randn(2, 2, 4, generator=gen)  # four eligible blocks, eight wanted
    ids = torch.empty(2, 2, 8, dtype=torch.long, device=DEV)
    vals = torch.empty(2, 2, 8, device=DEV)
    device_topk.select_top(scores.to(DEV), torch.full((2, 2), 8, device=DEV), ids, vals)
    ids, vals = ids.cpu(), vals.cpu()
    finite = torch.isfinite(vals)
    assert (finite.sum(-1) == 4).all()
    assert torch.equal(ids[finite].view(2, 2, 4).sort(-1).values, torch.arange(10, 14).expand(2, 2, 4))


def test_long_rows_fall_back_to_torch_topk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_topk, "MAX_BLOCKS", 100)
    gen = torch.Generator().manual_seed(9)
    scores = torch.randn(2, 3, 300, generator=gen) * 10.0  # distinct scores: the fallback's ties are torch's
    check(scores, torch.randint(0, 50, (2, 3), generator=gen), 40)
