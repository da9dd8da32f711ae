"""RULER-style generator: prompts reach their target length, answers are planted as stated, seeds are stable, scoring.

Length checks use the real smollm2-135m tokenizer (vocab-only load) when the model is in the cache and a whitespace
word counter otherwise: the generator only sees a `count_tokens` function, so both exercise the same search.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from fluxion_lite.hub.catalog import cache_dir
from fluxion_lite.errors import FluxionError
from fluxion_lite.offline.ruler import (
    TASK_SPECS,
    TASKS,
    Sample,
    chat_prompt,
    default_tolerance,
    generate_sample,
    sample_seed,
    score_output,
    string_match_all,
    string_match_any,
)

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = cache_dir() / "smollm2-135m.gguf"


def count_words(text: str) -> int:
    return len(text.split())


@pytest.fixture(scope="module")
def count_tokens():
    if not SMOLLM2.is_file():
        pytest.skip("smollm2-135m is not in the model cache (fluxion-lite pull smollm2-135m)")
    from fluxion_lite.model.tokenizer import Tokenizer

    tok = Tokenizer(SMOLLM2, {})
    return lambda text: len(tok.encode(text, add_special=True))


def assert_fits(sample: Sample, count) -> None:
    budget = sample.target_tokens - sample.max_new_tokens
    assert sample.prompt_tokens == count(sample.prompt)
    assert budget - default_tolerance(budget) <= sample.prompt_tokens <= budget


# ---- length ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [1024, 4096])
@pytest.mark.parametrize("task", TASKS)
def test_prompt_reaches_target_with_real_tokenizer(task: str, length: int, count_tokens) -> None:
    sample = generate_sample(task, length, 0, count_tokens)
    assert_fits(sample, count_tokens)
    assert sample.filler_units > 0


@pytest.mark.parametrize("task", TASKS)
def test_prompt_reaches_target_with_word_counter(task: str) -> None:
    sample = generate_sample(task, 3000, 1, count_words)
    assert_fits(sample, count_words)


def test_chat_renderer_is_counted_in_the_budget(count_tokens) -> None:
    template = lambda msgs: f"<|user|>\n{msgs[0]['content']}<|end|>\n<|assistant|>\n"  # noqa: E731
    sample = generate_sample("niah_single_2", 1024, 0, count_tokens, render=chat_prompt(template))
    assert sample.prompt.startswith("<|user|>\n")
    assert sample.prompt.endswith("<|assistant|>\nThe special magic number for " + sample.prompt.split(" for ")[-1])
    assert_fits(sample, count_tokens)


# ---- planted answers -----------------------------------------------------------------------------------------------
NEEDLE = re.compile(r"One of the special magic (numbers|uuids) for (\S+) is: (\S+)\.")


def needles(prompt: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for _, key, value in NEEDLE.findall(prompt):
        found.setdefault(key, []).append(value)
    return found


def asked_keys(prompt: str) -> list[str]:
    question = re.findall(r"What (?:is|are all) the special magic \w+ for (.+) mentioned in the provided text\?", prompt)
    assert len(question) == 1
    return re.split(r", | and ", question[0])


@pytest.mark.parametrize("task", [t for t in TASKS if t.startswith("niah")])
@pytest.mark.parametrize("index", [0, 1, 2])
def test_niah_answers_are_the_values_planted_for_the_asked_keys(task: str, index: int) -> None:
    sample = generate_sample(task, 2000, index, count_words)
    found = needles(sample.prompt)
    keys = asked_keys(sample.prompt)
    planted = [v for k in keys for v in found[k]]
    assert sorted(planted) == sorted(sample.answers)
    expected = {"niah_multivalue": (1, 4), "niah_multiquery": (4, 4)}.get(task, (1, 1))
    assert (len(keys), len(sample.answers)) == expected
    for value in sample.answers:
        assert sample.prompt.count(value) == 1  # planted once, never leaked into the question or elsewhere
        if task in ("niah_single_3", "niah_multikey_3"):
            assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", value)
        else:
            assert re.fullmatch(r"[1-9]\d{6}", value)
    n_lines = sum(len(v) for v in found.values())
    if task == "niah_multikey_1":
        assert n_lines == 4 and len(found) == 4
    if task in ("niah_multikey_2", "niah_multikey_3"):
        assert n_lines == len(found) > 20  # the haystack is distractor lines, every key distinct
    if task == "niah_single_1":
        haystack = NEEDLE.sub("", sample.prompt.split("\n\n")[1])
        assert set(re.findall(r"[A-Z][^.]*\.", haystack)) <= {
            "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again."
        }


@pytest.mark.parametrize("index", [0, 1, 2])
def test_vt_answers_are_exactly_the_variables_holding_the_value(index: int) -> None:
    sample = generate_sample("vt", 2000, index, count_words)
    value = re.search(r"assigned the value (\d+) in the text above", sample.prompt).group(1)
    holds: dict[str, str] = {}
    for name, rhs in re.findall(r"VAR ([A-Z]{5}) = (\d+|VAR [A-Z]{5})\.", sample.prompt):
        holds[name] = rhs if rhs.isdigit() else holds[rhs[4:]]  # KeyError: a variable used before its assignment
    assert sorted(n for n, v in holds.items() if v == value) == sorted(sample.answers)
    assert len(sample.answers) == 5


@pytest.mark.parametrize("length", [1024, 2000, 8000])
def test_cwe_answers_are_the_ten_most_common_words(length: int) -> None:
    sample = generate_sample("cwe", length, 0, count_words)
    listing = sample.prompt.split("\n\n")[1]
    entries = re.findall(r"(\d+)\. ([a-z]+)", listing)
    assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
    counts = Counter(w for _, w in entries)
    assert len(sample.answers) == 10
    least_common_answer = min(counts[w] for w in sample.answers)
    most_common_other = max(c for w, c in counts.items() if w not in sample.answers)
    assert least_common_answer > most_common_other


@pytest.mark.parametrize("length", [1024, 4096])
def test_fwe_answers_are_the_three_most_frequent_coded_words(length: int) -> None:
    sample = generate_sample("fwe", length, 0, count_words)
    ranked = Counter(sample.prompt.split("\n\n")[1].split()).most_common(4)
    assert [w for w, _ in ranked[:3]] == list(sample.answers)
    assert ranked[2][1] > ranked[3][1]


@pytest.mark.parametrize("index", [0, 1, 2, 3])
def test_qa_gold_context_and_question_are_in_the_prompt(index: int) -> None:
    squad = generate_sample("qa_1", 2000, index, count_words)
    assert any(answer in squad.prompt for answer in squad.answers)  # SQuAD answers are spans of the gold paragraph
    hotpot = generate_sample("qa_2", 2000, index, count_words)
    docs = re.findall(r"^Document (\d+):$", hotpot.prompt, flags=re.M)
    assert [int(d) for d in docs] == list(range(1, len(docs) + 1)) and len(docs) >= 3
    for sample in (squad, hotpot):
        assert sample.metric == "any"
        assert sample.prompt.rstrip().endswith("Answer:")
        assert re.search(r"\nQuestion: \S.*\?\n", sample.prompt)


# ---- seeds -------------------------------------------------------------------------------------------------------
def test_samples_are_deterministic_and_differ_by_index_length_and_seed() -> None:
    a = generate_sample("niah_multikey_1", 2000, 3, count_words)
    assert a == generate_sample("niah_multikey_1", 2000, 3, count_words)
    assert a.prompt != generate_sample("niah_multikey_1", 2000, 4, count_words).prompt
    assert a.prompt != generate_sample("niah_multikey_1", 2000, 3, count_words, seed=1).prompt
    assert a.answers != generate_sample("niah_multikey_1", 2001, 3, count_words).answers
    assert len({sample_seed("vt", 4096, i) for i in range(100)}) == 100


def test_samples_are_identical_across_processes() -> None:
    """Python's str hash is salted per process: the generator must not depend on it (every mode runs separately)."""
    code = (
        "import hashlib; from fluxion_lite.offline.ruler import generate_sample, TASKS\n"
        "h = hashlib.sha256()\n"
        "for t in TASKS: h.update(generate_sample(t, 1500, 2, lambda s: len(s.split())).prompt.encode())\n"
        "print(h.hexdigest())"
    )
    digests = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                       env={"PYTHONHASHSEED": str(salt), "PATH": "/usr/bin:/bin"}).stdout.strip()
        for salt in (1, 2)
    }
    assert len(digests) == 1 and len(next(iter(digests))) == 64


# ---- scoring -----------------------------------------------------------------------------------------------------
def test_string_match_all_counts_the_fraction_of_references_found() -> None:
    refs = ["4412345", "7654321", "ABCDE"]
    assert string_match_all("The numbers are 4412345 and abcde.", refs) == pytest.approx(2 / 3)
    assert string_match_all("nothing here", refs) == 0.0
    assert string_match_all("ABCDE 7654321 ... 4412345", refs) == 1.0
    assert string_match_all("441234", ["4412345"]) == 0.0  # a prefix of the value is not the value


def test_string_match_any_takes_the_best_alternative() -> None:
    refs = ["the United Nations", "UN"]
    assert string_match_any("It was the united nations.", refs) == 1.0
    assert string_match_any("It was NATO.", refs) == 0.0
    assert score_output("un", refs, "any") == 1.0
    assert score_output("un", refs, "all") == 0.5


def test_scoring_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="metric"):
        score_output("x", ["x"], "mean")
    with pytest.raises(ValueError, match="no references"):
        string_match_all("x", [])


def test_every_task_has_a_metric_and_an_allowance() -> None:
    assert set(TASK_SPECS) == set(TASKS) and len(TASKS) == 13
    assert {s.metric for s in TASK_SPECS.values()} == {"all", "any"}


# ---- errors ------------------------------------------------------------------------------------------------------
def test_unknown_task_and_too_short_target_are_clear_errors() -> None:
    with pytest.raises(FluxionError, match="unknown RULER task 'niah_single_9'"):
        generate_sample("niah_single_9", 4096, 0, count_words)
    with pytest.raises(FluxionError, match="no room for a prompt"):
        generate_sample("cwe", 200, 0, count_words)
    with pytest.raises(FluxionError, match="without any haystack"):
        generate_sample("qa_2", 300, 0, lambda s: 10 * count_words(s))


# ---- bench/fidelity.py helpers ---------------------------------------------------------------------------------------
def _load_fidelity():
    spec = importlib.util.spec_from_file_location("bench_fidelity", ROOT / "bench" / "fidelity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fidelity_prefill_never_uses_a_one_token_chunk() -> None:
    fid = _load_fidelity()
    for n in (2, 3, 511, 512, 513, 1025, 4032):
        pieces = fid.prefill_chunks(n, 512)
        assert all(length > 1 for _, length in pieces)
        assert [s for s, _ in pieces] == sorted(s for s, _ in pieces)
        assert sum(length for _, length in pieces) == n and pieces[0][0] == 0
        assert all(s + length == nxt for (s, length), (nxt, _) in zip(pieces, pieces[1:]))


def test_fidelity_compare_is_zero_on_identical_and_positive_on_different_distributions() -> None:
    fid = _load_fidelity()
    g = torch.Generator().manual_seed(0)
    ref = torch.log_softmax(torch.randn(8, 50, generator=g), -1)
    same = fid.compare(ref, ref.clone(), [1, 2, 3])
    assert same["kl_mean"] == pytest.approx(0.0, abs=1e-6) and same["top1_agreement"] == 1.0
    other = fid.compare(ref, torch.log_softmax(torch.randn(8, 50, generator=g), -1), [1, 2, 3])
    assert other["kl_mean"] > 0.1 and other["kl_max"] >= other["kl_p90"] >= 0
    assert same["nll_mean"] == pytest.approx(float(-(ref[0, 1] + ref[1, 2] + ref[2, 3]) / 3))
