"""research/ruler_diverge.py's pieces that need no model: the first differing token and the answer-file lookup."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "research"))

from ruler_diverge import answer_outputs, first_difference  # noqa: E402


def test_first_difference() -> None:
    assert first_difference([5, 6, 7], [5, 6, 8]) == 2
    assert first_difference([5, 6, 7], [9]) == 0
    assert first_difference([5, 6], [5, 6, 7, 8]) == 2  # a prefix: where the shorter one ends
    assert first_difference([], [1]) == 0


def test_answer_outputs_picks_the_mode_and_length_and_names_what_is_missing(tmp_path: Path) -> None:
    f = tmp_path / "answers.json"
    runs = [{"mode": "full", "length": 4096, "outputs": [[1, 2]]}, {"mode": "fluxion", "length": 4096,
                                                                    "outputs": [[1, 3]]},
            {"mode": "full", "length": 8192, "outputs": [[4]]}]
    f.write_text(json.dumps({"runs": runs}))
    assert answer_outputs(f"{f}:fluxion", 4096) == [[1, 3]]
    assert answer_outputs(f"{f}:full", 8192) == [[4]]
    with pytest.raises(SystemExit, match="no fixed run at 4096 .*full@4096"):
        answer_outputs(f"{f}:fixed", 4096)
    with pytest.raises(SystemExit, match="FILE:MODE"):
        answer_outputs(str(f), 4096)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit, match="not a ruler_split answer file"):
        answer_outputs(f"{tmp_path / 'bad.json'}:full", 4096)
