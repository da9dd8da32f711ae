"""Every FLUXION_* knob in one frozen object, parsed and checked once.

This is the only module that reads FLUXION_* environment variables (tests/test_settings.py checks it). Everything
else receives a `Settings` from its owner: the engine makes one at construction (or takes the caller's), hands it to
the model, the attention backend and, through them, to the kernels; the CLI and the server make one from the
environment and their flags. A component built without one calls `Settings.load()`, i.e. reads the environment at
that moment, as the code did before this object existed.

Precedence: flags (the command line) > keyword overrides (the caller's code) > environment > default. An empty
variable counts as unset. A bad value raises SettingError naming the variable and the values it takes.

Knobs come in two groups: the product's (`Settings`' own fields) and the experimental ones (`settings.experimental`,
an `ExperimentalSettings`): switches that exist to compare two ways of doing one thing on a GPU host (A/B runs in
bench/ and docs/hybrid.md), with no reason to touch them otherwise. `fluxion-lite settings` prints the effective
values and where each came from; `fluxion-lite settings --markdown` prints docs/configuration.md.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from fluxion_lite.errors import SettingError

DEFAULT, ENV, ARGUMENT, FLAG = "default", "env", "argument", "flag"  # where a value came from (Settings.source)


@dataclass(frozen=True)
class Knob:
    """What the reference says about one setting. name: the field (in `settings` or `settings.experimental`)."""

    name: str
    env: str
    default: Any
    values: str  # the values it takes, in words
    doc: str
    parse: Callable[[str], Any]  # non-empty text -> value; raises SettingError naming env
    experimental: bool
    shown_default: str  # the default as the reference shows it (what None means, for the optional ones)
    secret: bool = False  # printed as "(set)", never the value

    def coerce(self, value: Any) -> Any:
        """A value given in code (or text, as the environment gives it) -> the checked value."""
        text = _text(value)
        return self.default if text == "" else self.parse(text)

    def show(self, value: Any) -> str:
        """The value as `fluxion-lite settings` prints it (the environment's spelling)."""
        if self.secret:
            return "(unset)" if value is None else "(set)"
        if value is None:
            return self.shown_default
        return _text(value)


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    return str(value)


# ---- parsers: text -> value, SettingError naming the variable ------------------------------------------------------

def _switch(env: str, message: str | None = None) -> Callable[[str], bool]:
    def parse(text: str) -> bool:
        if text not in ("0", "1"):
            raise SettingError(message.format(text=text) if message else f"{env}={text!r}: use 0 or 1")
        return text == "1"
    return parse


def _choice(env: str, choices: tuple[str, ...], aliases: Mapping[str, str] | None = None,
            message: str | None = None) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = (aliases or {}).get(text, text)
        if value not in choices:
            raise SettingError(f"{env}={text!r}: " + (message or f"use one of {', '.join(choices)}"))
        return value
    return parse


def _integer(env: str, check: Callable[[int], bool] = lambda n: True, message: str | None = None
             ) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = None
        if n is None or not check(n):
            raise SettingError(message.format(text=text) if message else f"{env}={text!r}: use an integer")
        return n
    return parse


def _text_value(text: str) -> str:
    return text


def _reuse_share(text: str) -> float:
    try:
        share = float(text)
    except ValueError:
        share = -1.0
    if not 0.0 < share <= 16.0:  # also refuses nan
        raise SettingError(f"FLUXION_REUSE_SHARE must be a number in (0, 16], got {text!r}")
    return share


def _tiling(text: str) -> tuple[int, int, int]:
    parts = text.split(",")
    try:
        bn, bk, warps = (int(p) for p in parts)
    except ValueError:
        bn = bk = warps = 0
    if min(bn, bk, warps) < 1:
        raise SettingError(f"FLUXION_GEMV_CONFIG={text!r}: use BLOCK_N,BLOCK_K,WARPS (three positive integers, "
                           f"e.g. 4,512,4)")
    return bn, bk, warps


def _power_of_two(n: int) -> bool:
    return 1 <= n <= 32 and n & (n - 1) == 0


def _knob(env: str, default: Any, values: str, doc: str, parse: Callable[[str], Any], *,
          shown: str | None = None, secret: bool = False) -> Any:
    """A dataclass field carrying its reference entry (Knob; name and group filled in by _collect)."""
    meta = {"env": env, "values": values, "doc": doc, "parse": parse, "shown": shown, "secret": secret}
    return field(default=default, metadata={"knob": meta})


SIMD_PATHS = ("auto", "portable", "avx2", "avx512", "avx512bf16")  # hostkv/native.py's SIMD_PATHS and "auto"
SELECTIONS = ("auto", "cpu", "gpu")
BACKGROUNDS = ("off", "retrieval", "all")  # plan/sparse_plan.py's BACKGROUNDS
TOPK_SCORINGS = ("group", "per-head", "midrange")  # hostkv/native.py's SCORINGS ("native": group's old name)
GEMV_FUSE_MODES = ("none", "rope", "all")  # model/gemv_kernels.py's FUSE_MODES


def _validate(obj: Any) -> None:
    """__post_init__ of both groups: every field through its knob's check (values given in code are normalised)."""
    for f in fields(obj):
        meta = f.metadata.get("knob")
        if meta is None:
            continue
        knob = _KNOBS_BY_NAME[f.name]
        value = knob.coerce(getattr(obj, f.name))
        object.__setattr__(obj, f.name, value)


@dataclass(frozen=True)
class ExperimentalSettings:
    """A/B knobs: each keeps a second way of doing something that a measurement decided against (or has not decided
    yet), so a later run on a GPU host can compare the two again. Product code reads them only to pick that way."""

    ba_dot: bool = _knob(
        "FLUXION_BA_DOT", False, "0 or 1",
        "block_attention: tl.dot padded to 16 rows for every query-head count instead of products in registers for "
        "groups of <= 8 heads.", _switch("FLUXION_BA_DOT"))
    ba_warps: int = _knob(
        "FLUXION_BA_WARPS", 4, "1, 2, 4, 8, 16 or 32",
        "block_attention: warps per program.",
        _integer("FLUXION_BA_WARPS", _power_of_two, "FLUXION_BA_WARPS={text!r}: use 1, 2, 4, 8, 16 or 32"))
    ba_entries: int = _knob(
        "FLUXION_BA_ENTRIES", 1, "a positive integer",
        "block_attention: flat entries per program, one after another (2 and 4 measured slower).",
        _integer("FLUXION_BA_ENTRIES", lambda n: n >= 1, "FLUXION_BA_ENTRIES={text!r}: use a positive integer"))
    early_priority: int = _knob(
        "FLUXION_EARLY_PRIORITY", -1, "an integer (CUDA stream priority; lower runs first)",
        "Priority of the early block choice's CUDA stream.",
        _integer("FLUXION_EARLY_PRIORITY"))
    pdl: bool = _knob(
        "FLUXION_PDL", False, "0 or 1",
        "Programmatic dependent launch between the one-row weight kernels, the RMS norm and combine (sm_90 and a "
        "Triton with gdc_wait; a tie so far).", _switch("FLUXION_PDL"))
    l2_hints: bool = _knob(
        "FLUXION_L2_HINTS", True, "0 or 1",
        "L2 eviction hints on the batch-1 weight reads (the early query's q rows evict_last, the rest "
        "evict_first).", _switch("FLUXION_L2_HINTS"))
    gemv_fuse: str = _knob(
        "FLUXION_GEMV_FUSE", "rope", "none, rope or all (0 = none, 1 = all)",
        "What the one-row weight kernels take in besides the product: RoPE after q/k/v (rope), also the RMS norm "
        "before (all, slower on large weights), or neither.",
        _choice("FLUXION_GEMV_FUSE", GEMV_FUSE_MODES, {"0": "none", "1": "all"}, "use none, rope or all (or 0 / 1)"))
    gemv_config: tuple[int, int, int] | None = _knob(
        "FLUXION_GEMV_CONFIG", None, "BLOCK_N,BLOCK_K,WARPS",
        "One tiling for every one-row weight kernel (bench/gemv.py's sweep) instead of the tuned table "
        "model/gemv_configs.json.", _tiling, shown="the tuned table")
    reuse_share: float = _knob(
        "FLUXION_REUSE_SHARE", 0.5, "a number in (0, 16]",
        "Reuse cache entries per (layer, row, group) as a share of the layer's widest top-k.", _reuse_share)
    device_topk: str = _knob(
        "FLUXION_DEVICE_TOPK", "select", "select or torch",
        "How the device step chooses its blocks: the Triton select without a sort, or torch.topk (which also "
        "turns the reuse cache and the early block choice off).",
        _choice("FLUXION_DEVICE_TOPK", ("select", "torch")))
    device_graphs: str = _knob(
        "FLUXION_DEVICE_GRAPHS", "step", "step or layer",
        "The device-selection step captured as one CUDA graph per step, or one per layer.",
        _choice("FLUXION_DEVICE_GRAPHS", ("step", "layer")))
    mixed_select: str = _knob(
        "FLUXION_MIXED_SELECT", "host", "host or device",
        "With device selection, where the decode rows of a step that also holds a prompt chunk choose their "
        "blocks: the native top-k and the CPU/GPU split (host), or the device top-k (device).",
        _choice("FLUXION_MIXED_SELECT", ("host", "device"), message="use host or device"))
    stream_stores: bool = _knob(
        "FLUXION_STREAM_STORES", True, "0 or 1",
        "Native gather: non-temporal stores into the staging buffer (1) or plain cached stores (0).",
        _switch("FLUXION_STREAM_STORES", "FLUXION_STREAM_STORES must be 0 or 1, got {text!r}"))

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True)
class Settings:
    """The engine's knobs (see the module docstring). Build with `Settings.load()`; `Settings()` is every default.

    `sources` maps each field name (both groups) to where its value came from: DEFAULT, ENV, ARGUMENT (a keyword of
    load) or FLAG (the command line); `source(name)` reads it."""

    threads: int | None = _knob(
        "FLUXION_THREADS", None, "a positive integer",
        "Threads of the native CPU kernels' pool (the calling thread counts as one).",
        _integer("FLUXION_THREADS", lambda n: n >= 1, "FLUXION_THREADS must be a positive integer, got {text!r}"),
        shown="physical cores")
    simd: str = _knob(
        "FLUXION_SIMD", "auto", ", ".join(SIMD_PATHS),
        "SIMD path of the native kernels (avx512bf16: q.k by bf16 dot products when q is exactly bf16); auto "
        "picks the best this CPU runs.", _choice("FLUXION_SIMD", SIMD_PATHS))
    native_so: str | None = _knob(
        "FLUXION_NATIVE_SO", None, "a path",
        "Load this build of the native extension instead of fluxion_lite/_native*.so (the AddressSanitizer build "
        "of native/asan_check.py); read when the extension is first imported.", _text_value,
        shown="the package's build")
    cuda_graphs: bool = _knob(
        "FLUXION_CUDA_GRAPHS", True, "0 or 1",
        "Pure decode steps on CUDA replay captured CUDA graphs (0: eager).", _switch("FLUXION_CUDA_GRAPHS"))
    zero_copy: bool | None = _knob(
        "FLUXION_ZERO_COPY", None, "0 or 1",
        "The GPU reads selected host KV blocks through a zero-copy alias of the pinned store instead of staging "
        "copies. Unset: wherever the alias check passes on CUDA; 0: never; 1: also on a CPU device (tests).",
        _switch("FLUXION_ZERO_COPY"), shown="auto")
    hugepages: bool = _knob(
        "FLUXION_HUGEPAGES", True, "0 or 1",
        "Transparent huge pages for the host KV slabs (unpinned stores).", _switch("FLUXION_HUGEPAGES"))
    background: str | None = _knob(
        "FLUXION_BACKGROUND", None, "off, retrieval or all",
        "The unread-background term (one softmax term per 128-token block a step leaves unread) in place of the "
        "plan's own `background`.", _choice("FLUXION_BACKGROUND", BACKGROUNDS), shown="the plan's")
    topk: str | None = _knob(
        "FLUXION_TOPK", None, "group, per-head or midrange (native = group)",
        "Block scoring of the retrieval groups' top-k in place of the plan's `scoring` (per-head: CPU selection "
        "only).", _choice("FLUXION_TOPK", TOPK_SCORINGS, {"native": "group"}), shown="the plan's, else group")
    auto_dense_tokens: int | None = _knob(
        "FLUXION_AUTO_DENSE_TOKENS", None, "a non-negative integer",
        "Attention mode `auto`: prompts of up to this many tokens run dense attention, longer ones fluxion (0: "
        "every prompt fluxion).",
        _integer("FLUXION_AUTO_DENSE_TOKENS", lambda n: n >= 0,
                 "FLUXION_AUTO_DENSE_TOKENS must be an integer >= 0, got {text!r}"),
        shown="the crossover measured for the device kind (sparse/auto_mode.py)")
    selection: str = _knob(
        "FLUXION_SELECTION", "auto", "auto, cpu or gpu",
        "Where attention mode `fluxion` selects blocks: auto picks the GPU when the whole decode step can run "
        "there (CUDA, zero-copy, one retrieval block size, group or midrange scoring, the static plan, no "
        "background term), else the CPU.",
        _choice("FLUXION_SELECTION", SELECTIONS, message="use auto, cpu or gpu"))
    triton: bool | None = _knob(
        "FLUXION_TRITON", None, "0 or 1",
        "The device decode step's Triton kernels. Unset: on CUDA once a probe kernel ran; 0: torch ops; 1: on any "
        "device (with TRITON_INTERPRET=1 on the CPU: how the tests check them).", _switch("FLUXION_TRITON"),
        shown="auto")
    pin_cache: bool = _knob(
        "FLUXION_PIN_CACHE", True, "0 or 1",
        "The device step keeps each sequence's pinned blocks in GPU memory (0: every block over PCIe, no KV on "
        "the GPU beyond sink + window, and no reuse cache either).", _switch("FLUXION_PIN_CACHE"))
    reuse_cache: bool = _knob(
        "FLUXION_REUSE_CACHE", True, "0 or 1",
        "The device step keeps the dynamic blocks it read for the next steps.", _switch("FLUXION_REUSE_CACHE"))
    step_overlap: bool = _knob(
        "FLUXION_STEP_OVERLAP", True, "0 or 1",
        "The device step appends K/V to the host store and plans the next step while the GPU runs.",
        _switch("FLUXION_STEP_OVERLAP"))
    stream_branch: bool = _knob(
        "FLUXION_STREAM_BRANCH", True, "0 or 1",
        "The device step runs each layer's streaming attention on a side stream beside the retrieval kernels.",
        _switch("FLUXION_STREAM_BRANCH"))
    early_select: bool = _knob(
        "FLUXION_EARLY_SELECT", True, "0 or 1",
        "Batch-1 device steps choose layer l's blocks (and start their PCIe reads) during layer l - 1's MLP, from "
        "a predicted query.", _switch("FLUXION_EARLY_SELECT"))
    dense_kernels: bool = _knob(
        "FLUXION_DENSE_KERNELS", True, "0 or 1",
        "On CUDA: RMSNorm, RoPE and silu(gate) * up as one Triton kernel each (0: torch's ops).",
        _switch("FLUXION_DENSE_KERNELS"))
    gemv: bool = _knob(
        "FLUXION_GEMV", True, "0 or 1",
        "On CUDA: a one-row forward (batch-1 decode) runs its weight products as Triton matrix-vector kernels "
        "(0: cuBLAS).", _switch("FLUXION_GEMV"))
    async_decode: bool | None = _knob(
        "FLUXION_ASYNC_DECODE", None, "0 or 1",
        "The engine queues each pure decode step before reading the previous step's tokens. Unset: on with CUDA, "
        "off on the CPU.", _switch("FLUXION_ASYNC_DECODE"), shown="on with CUDA")
    api_key: str | None = _knob(
        "FLUXION_API_KEY", None, "a token",
        "`fluxion-lite serve` requires this bearer token (--api-key sets it too).", _text_value, shown="none",
        secret=True)
    cache_dir: str | None = _knob(
        "FLUXION_CACHE_DIR", None, "a directory",
        "Where pulled models live.", _text_value, shown="$XDG_CACHE_HOME/fluxion-lite/models or "
                                                         "~/.cache/fluxion-lite/models")
    experimental: ExperimentalSettings = field(default_factory=ExperimentalSettings)
    sources: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.experimental, ExperimentalSettings):
            raise TypeError(f"experimental must be an ExperimentalSettings, got {type(self.experimental).__name__}")
        _validate(self)

    @classmethod
    def load(cls, environ: Mapping[str, str] | None = None, *, flags: Mapping[str, Any] | None = None,
             **overrides: Any) -> Settings:
        """Parse and check every knob: flags (the command line; source FLAG), else overrides (keyword arguments,
        by field name of either group; source ARGUMENT), else environ (os.environ when not given; empty counts as
        unset), else the default. Raises SettingError for a bad value, TypeError for an unknown name."""
        env = os.environ if environ is None else environ
        given = {**overrides}
        given_flags = dict(flags or {})
        for name in [*given, *given_flags]:
            if name not in _KNOBS_BY_NAME:
                raise TypeError(f"Settings.load(): no setting named {name!r}")
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for knob in KNOBS:
            if knob.name in given_flags:
                values[knob.name], sources[knob.name] = knob.coerce(given_flags[knob.name]), FLAG
            elif knob.name in given:
                values[knob.name], sources[knob.name] = knob.coerce(given[knob.name]), ARGUMENT
            elif env.get(knob.env):
                values[knob.name], sources[knob.name] = knob.parse(env[knob.env]), ENV
            else:
                values[knob.name], sources[knob.name] = knob.default, DEFAULT
        experimental = ExperimentalSettings(**{k.name: values[k.name] for k in KNOBS if k.experimental})
        return cls(**{k.name: values[k.name] for k in KNOBS if not k.experimental}, experimental=experimental,
                   sources=MappingProxyType(sources))

    def value(self, name: str) -> Any:
        """A field of either group by name."""
        knob = knob_for(name)
        return getattr(self.experimental if knob.experimental else self, knob.name)

    def source(self, name: str) -> str:
        """Where the value of field `name` came from: DEFAULT, ENV, ARGUMENT or FLAG (for an object built directly
        rather than by load: DEFAULT where the value is the default, else ARGUMENT)."""
        knob = knob_for(name)
        if knob.name in self.sources:
            return self.sources[knob.name]
        return DEFAULT if self.value(knob.name) == knob.default else ARGUMENT

    def rows(self) -> list[tuple[Knob, str, str]]:
        """(knob, the value as printed, its source as printed) for every knob, product ones first."""
        out = []
        for knob in KNOBS:
            source = self.source(knob.name)
            shown = {ENV: f"env {knob.env}", FLAG: "flag", ARGUMENT: "argument"}.get(source, DEFAULT)
            out.append((knob, knob.show(self.value(knob.name)), shown))
        return out


def user_cache_base() -> str | None:
    """$XDG_CACHE_HOME (None when unset or empty): where the model cache goes when FLUXION_CACHE_DIR is not set
    (hub/catalog.py). Read here with the knobs, so the environment has one reader."""
    return os.environ.get("XDG_CACHE_HOME") or None


def triton_interpreter() -> bool:
    """Whether Triton's own switch TRITON_INTERPRET=1 is on (its kernels then run on CPU tensors, as the tests run
    them; model/qgemv_kernels.py accepts CPU tensors only then). Read at each call, here with the knobs."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def child_environment(**extra: str) -> dict[str, str]:
    """The environment for a child process: this one's, with `extra` set (hub/pull.py points pip's TMPDIR at a
    folder it watches for download progress)."""
    return {**os.environ, **extra}


def _collect() -> tuple[Knob, ...]:
    knobs = []
    for cls, experimental in ((Settings, False), (ExperimentalSettings, True)):
        for f in fields(cls):
            meta = f.metadata.get("knob")
            if meta is None:
                continue
            shown = meta["shown"] if meta["shown"] is not None else _text(f.default)
            knobs.append(Knob(f.name, meta["env"], f.default, meta["values"], meta["doc"], meta["parse"],
                              experimental, shown, meta["secret"]))
    return tuple(knobs)


_KNOBS_BY_NAME: dict[str, Knob] = {}
KNOBS: tuple[Knob, ...] = _collect()
_KNOBS_BY_NAME.update({k.name: k for k in KNOBS})
_KNOBS_BY_ENV: dict[str, Knob] = {k.env: k for k in KNOBS}


def knob_for(name: str) -> Knob:
    """The knob of a field name (either group) or an environment variable name; KeyError if there is none."""
    knob = _KNOBS_BY_NAME.get(name) or _KNOBS_BY_ENV.get(name)
    if knob is None:
        raise KeyError(name)
    return knob


def parse_assignments(pairs: Iterable[str]) -> dict[str, str]:
    """Command-line `--set NAME=VALUE` pairs -> {field name: text} for Settings.load(flags=...). NAME is a field
    name (threads, pdl) or the variable (FLUXION_THREADS); an unknown name or a pair without '=' is a
    SettingError."""
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        name = name.strip()
        if not sep or not name:
            raise SettingError(f"--set {pair!r}: use NAME=VALUE (e.g. FLUXION_THREADS=4)")
        knob = _KNOBS_BY_NAME.get(name) or _KNOBS_BY_ENV.get(name) or _KNOBS_BY_ENV.get(name.upper())
        if knob is None:
            raise SettingError(f"--set {name}: no such setting (`fluxion-lite settings` lists them)")
        out[knob.name] = text
    return out


# ---- the reference (docs/configuration.md) -------------------------------------------------------------------------

REFERENCE_INTRO = """\
# Configuration

Every knob of fluxion-lite is a `FLUXION_*` environment variable, parsed once into one frozen
`fluxion_lite.settings.Settings` object and handed down from the engine to the components that use it. In code:

```python
from fluxion_lite import LLM, Settings

settings = Settings.load(threads=8, selection="cpu")  # the environment, with these fields overridden
llm = LLM("smollm2-135m", settings=settings)          # Engine(..., settings=...) likewise; None: Settings.load()
```

On the command line, `generate`, `chat` and `serve` take `--set NAME=VALUE` (NAME: the variable or the field, e.g.
`--set FLUXION_THREADS=4` or `--set threads=4`), which wins over the environment. `fluxion-lite settings` prints
every effective value and where it came from (default, env FLUXION_X or flag); `fluxion-lite settings --markdown`
prints this page. An empty variable counts as unset; a bad value stops the command with
`error: FLUXION_X=...: use ...` (exit code 2).

Experimental knobs keep a second way of doing one thing so that a later A/B run can compare the two again
(docs/hybrid.md has the measurements); they live in `settings.experimental`.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def reference_markdown() -> str:
    """docs/configuration.md: the intro and one table per group (variable, field, values, default, what it does)."""
    lines = [REFERENCE_INTRO]
    for title, experimental, prefix in (("Product settings", False, "settings."),
                                        ("Experimental settings (A/B comparisons)", True, "settings.experimental.")):
        lines += [f"## {title}", "", "| Variable | Field | Values | Default | What it does |", "|---|---|---|---|---|"]
        for k in KNOBS:
            if k.experimental == experimental:
                lines.append(f"| `{k.env}` | `{prefix}{k.name}` | {_cell(k.values)} | {_cell(k.shown_default)} | "
                             f"{_cell(k.doc)} |")
        lines.append("")
    return "\n".join(lines)
