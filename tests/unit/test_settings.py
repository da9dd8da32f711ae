"""fluxion_lite.settings: the one module that reads FLUXION_* variables, its parsing and checks, where each value came
from, the objects it is handed to, the `fluxion-lite settings` command and docs/configuration.md."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fluxion_lite import settings as settings_module
from fluxion_lite.cli import main
from fluxion_lite.errors import RequestError, SettingError
from fluxion_lite.settings import (ARGUMENT, DEFAULT, ENV, FLAG, KNOBS, ExperimentalSettings, Settings, knob_for,
                                   parse_assignments, reference_markdown)
from subprocess_env import repo_env

REPO = Path(__file__).resolve().parents[2]  # tests/unit/ -> the repository
PACKAGE = REPO / "fluxion_lite"
EXPERIMENTAL = {"FLUXION_BA_DOT", "FLUXION_BA_WARPS", "FLUXION_BA_ENTRIES", "FLUXION_EARLY_PRIORITY", "FLUXION_PDL",
                "FLUXION_L2_HINTS", "FLUXION_GEMV_FUSE", "FLUXION_GEMV_CONFIG", "FLUXION_REUSE_SHARE",
                "FLUXION_DEVICE_TOPK", "FLUXION_DEVICE_GRAPHS", "FLUXION_MIXED_SELECT", "FLUXION_STREAM_STORES"}
# a value each knob refuses (the free-text ones, a path, a token, a directory, take anything)
BAD = {"FLUXION_THREADS": "0", "FLUXION_AUTO_DENSE_TOKENS": "-1", "FLUXION_SIMD": "sse2", "FLUXION_CUDA_GRAPHS": "off", "FLUXION_ZERO_COPY": "yes",
       "FLUXION_HUGEPAGES": "2", "FLUXION_BACKGROUND": "some", "FLUXION_TOPK": "perhead", "FLUXION_SELECTION": "fast",
       "FLUXION_TRITON": "true", "FLUXION_PIN_CACHE": "no", "FLUXION_REUSE_CACHE": "-1", "FLUXION_STEP_OVERLAP": "on",
       "FLUXION_STREAM_BRANCH": "x", "FLUXION_EARLY_SELECT": "01", "FLUXION_DENSE_KERNELS": "True",
       "FLUXION_GEMV": "2", "FLUXION_ASYNC_DECODE": "auto", "FLUXION_BA_DOT": "yes", "FLUXION_BA_WARPS": "3",
       "FLUXION_BA_ENTRIES": "0", "FLUXION_EARLY_PRIORITY": "high", "FLUXION_PDL": "maybe", "FLUXION_L2_HINTS": "off",
       "FLUXION_GEMV_FUSE": "norm", "FLUXION_GEMV_CONFIG": "16,128", "FLUXION_REUSE_SHARE": "17",
       "FLUXION_DEVICE_TOPK": "sort", "FLUXION_DEVICE_GRAPHS": "graph", "FLUXION_MIXED_SELECT": "gpu",
       "FLUXION_STREAM_STORES": "2"}
FREE_TEXT = {"FLUXION_NATIVE_SO", "FLUXION_API_KEY", "FLUXION_CACHE_DIR"}


# ---- one module reads the environment's FLUXION_* variables ---------------------------------------------------------

def _environment_reads(tree: ast.AST, constants: dict[str, str]) -> list[tuple[int, str]]:
    """(line, what) for every read of the environment in a module: os.environ / os.environb / os.getenv / os.putenv
    (and environ / getenv imported from os), each with its key where one is given (a literal, or a module constant
    resolved through `constants`), '?' where the key is an expression, '*' for the whole mapping."""
    env_names = {"environ", "environb", "getenv", "getenvb"}
    imported = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module == "os" for alias in node.names if alias.name in env_names}
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def is_env(node: ast.AST) -> bool:
        return ((isinstance(node, ast.Attribute) and node.attr in env_names and isinstance(node.value, ast.Name)
                 and node.value.id == "os") or (isinstance(node, ast.Name) and node.id in imported))

    def key_of(node: ast.AST | None) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name) and node.id in constants:
            return constants[node.id]
        return "?"

    found = []
    for node in ast.walk(tree):
        if not is_env(node):
            continue
        parent = parents.get(node)
        name = node.attr if isinstance(node, ast.Attribute) else node.id
        if name.startswith("getenv") and isinstance(parent, ast.Call) and parent.func is node:
            found.append((node.lineno, key_of(parent.args[0] if parent.args else None)))
        elif isinstance(parent, ast.Attribute) and isinstance(parents.get(parent), ast.Call):
            call = parents[parent]  # os.environ.get(key) / .pop / .setdefault / .copy() / .items() ...
            found.append((node.lineno, key_of(call.args[0]) if call.args else "*"))
        elif isinstance(parent, ast.Subscript):
            found.append((node.lineno, key_of(parent.slice)))
        elif isinstance(parent, ast.Compare):  # "KEY" in os.environ
            found.append((node.lineno, key_of(parent.left)))
        else:  # the mapping as a whole: {**os.environ, ...}, dict(os.environ), iteration
            found.append((node.lineno, "*"))
    return sorted(found)


def _module_constants(tree: ast.Module) -> dict[str, str]:
    return {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for t in node.targets if isinstance(t, ast.Name)}


def test_only_the_settings_module_reads_fluxion_variables() -> None:
    """Every read of the environment under fluxion_lite/ outside settings.py names a key that is not FLUXION_*; a
    whole-mapping use (a child process's environment) is allowed only where the module never spells FLUXION_."""
    offenders = []
    files = sorted(PACKAGE.rglob("*.py"))
    assert PACKAGE / "settings.py" in files and len(files) > 50
    for path in files:
        if path == PACKAGE / "settings.py":
            continue
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text, filename=str(path))
        for line, key in _environment_reads(tree, _module_constants(tree)):
            whole = key == "*" and "FLUXION_" not in text.replace("FLUXION_*", "")
            if key.startswith("FLUXION_") or key == "?" or (key == "*" and not whole):
                offenders.append(f"{path.relative_to(REPO)}:{line}: reads {key}")
    assert not offenders, "FLUXION_* variables are read outside fluxion_lite/settings.py:\n" + "\n".join(offenders)


def test_the_scan_finds_the_usual_spellings() -> None:
    """The scan above is only as good as what it recognises: each way of reading a variable is found."""
    code = """
import os
from os import environ as env, getenv
KEY = "FLUXION_A"
a = os.environ.get("FLUXION_B", "1")
b = os.environ["FLUXION_C"]
c = getenv(KEY)
d = "FLUXION_D" in env
e = os.getenv(name)
f = {**os.environ}
g = os.environ.get("HOME")
"""
    tree = ast.parse(code)
    keys = [key for _, key in _environment_reads(tree, _module_constants(tree))]
    assert keys == ["FLUXION_B", "FLUXION_C", "FLUXION_A", "FLUXION_D", "?", "*", "HOME"]


# ---- the knobs ----------------------------------------------------------------------------------------------------

def test_every_knob_is_declared_once_with_its_reference() -> None:
    envs = [k.env for k in KNOBS]
    assert len(envs) == len(set(envs)) == 34 and all(e.startswith("FLUXION_") for e in envs)
    assert {k.env for k in KNOBS if k.experimental} == EXPERIMENTAL
    assert set(BAD) | FREE_TEXT == set(envs)
    for k in KNOBS:
        assert k.doc and k.values and k.shown_default, k.env
        assert knob_for(k.env) is knob_for(k.name) is k
        group = ExperimentalSettings if k.experimental else Settings
        assert k.name in group.__dataclass_fields__
    # the settings' lists of values are the code's
    from fluxion_lite.hostkv import native
    from fluxion_lite.model import gemv_kernels
    from fluxion_lite.plan import sparse_plan

    assert settings_module.BACKGROUNDS == sparse_plan.BACKGROUNDS
    assert settings_module.TOPK_SCORINGS == native.SCORINGS
    assert settings_module.SIMD_PATHS == ("auto", *native.SIMD_PATHS)
    assert settings_module.GEMV_FUSE_MODES == gemv_kernels.FUSE_MODES


def test_defaults_are_the_code_defaults() -> None:
    s = Settings.load({})
    assert s == Settings() and all(s.source(k.name) == DEFAULT for k in KNOBS)
    assert (s.threads, s.simd, s.selection, s.topk, s.background, s.zero_copy, s.triton, s.async_decode) == (
        None, "auto", "auto", None, None, None, None, None)
    assert s.cuda_graphs and s.hugepages and s.pin_cache and s.reuse_cache and s.step_overlap and s.stream_branch
    assert s.early_select and s.dense_kernels and s.gemv and s.api_key is None and s.cache_dir is None
    x = s.experimental
    assert (x.ba_dot, x.ba_warps, x.ba_entries, x.early_priority, x.pdl, x.l2_hints, x.gemv_fuse, x.gemv_config,
            x.reuse_share, x.device_topk, x.device_graphs, x.mixed_select, x.stream_stores) == (
        False, 4, 1, -1, False, True, "rope", None, 0.5, "select", "step", "host", True)


def test_environment_values_are_parsed() -> None:
    env = {"FLUXION_THREADS": "3", "FLUXION_TOPK": "native", "FLUXION_GEMV_FUSE": "1", "FLUXION_ZERO_COPY": "0",
           "FLUXION_TRITON": "1", "FLUXION_GEMV_CONFIG": "16,128,2", "FLUXION_REUSE_SHARE": "1.5",
           "FLUXION_EARLY_PRIORITY": "-2", "FLUXION_CUDA_GRAPHS": "0", "FLUXION_SELECTION": "",  # empty: unset
           "FLUXION_CACHE_DIR": "/tmp/models", "HOME": "/root"}
    s = Settings.load(env)
    assert (s.threads, s.topk, s.zero_copy, s.triton, s.cuda_graphs, s.selection, s.cache_dir) == (
        3, "group", False, True, False, "auto", "/tmp/models")
    x = s.experimental
    assert (x.gemv_fuse, x.gemv_config, x.reuse_share, x.early_priority) == ("all", (16, 128, 2), 1.5, -2)
    assert s.source("threads") == ENV and s.source("FLUXION_SELECTION") == DEFAULT
    assert s.value("gemv_config") == (16, 128, 2) and s.value("FLUXION_THREADS") == 3
    assert hash(s) == hash(Settings.load(env))  # frozen: usable as a key
    with pytest.raises(AttributeError):
        s.threads = 4  # type: ignore[misc]


@pytest.mark.parametrize("env", sorted(BAD))
def test_a_bad_value_names_the_variable_and_the_values(env: str) -> None:
    with pytest.raises(SettingError) as info:
        Settings.load({env: BAD[env]})
    message = str(info.value)
    assert message.startswith(env) and repr(BAD[env]) in message
    assert ("use" in message or "must be" in message), message
    assert isinstance(info.value, RequestError) and isinstance(info.value, ValueError)


def test_messages_the_code_gave_before_are_kept() -> None:
    cases = {"FLUXION_THREADS": ("lots", "FLUXION_THREADS must be a positive integer, got 'lots'"),
             "FLUXION_BACKGROUND": ("everything", "FLUXION_BACKGROUND='everything': use one of off, retrieval, all"),
             "FLUXION_SELECTION": ("fast", "FLUXION_SELECTION='fast': use auto, cpu or gpu"),
             "FLUXION_MIXED_SELECT": ("gpu", "FLUXION_MIXED_SELECT='gpu': use host or device"),
             "FLUXION_GEMV_FUSE": ("norm", "FLUXION_GEMV_FUSE='norm': use none, rope or all (or 0 / 1)"),
             "FLUXION_REUSE_SHARE": ("nan", "FLUXION_REUSE_SHARE must be a number in (0, 16], got 'nan'"),
             "FLUXION_STREAM_STORES": ("2", "FLUXION_STREAM_STORES must be 0 or 1, got '2'")}
    for env, (value, message) in cases.items():
        with pytest.raises(SettingError) as info:
            Settings.load({env: value})
        assert str(info.value) == message


def test_values_given_in_code_are_checked_too() -> None:
    s = Settings.load({}, threads=4, pdl=True, gemv_config=[8, 256, 4], topk="native", zero_copy=None)
    assert (s.threads, s.experimental.pdl, s.experimental.gemv_config, s.topk, s.zero_copy) == (
        4, True, (8, 256, 4), "group", None)
    assert s.source("threads") == s.source("pdl") == ARGUMENT
    with pytest.raises(SettingError, match="FLUXION_PDL='maybe'"):
        Settings.load({}, pdl="maybe")
    with pytest.raises(SettingError, match="FLUXION_THREADS must be a positive integer"):
        Settings(threads=0)
    with pytest.raises(SettingError, match="FLUXION_BA_WARPS"):
        ExperimentalSettings(ba_warps=6)
    with pytest.raises(TypeError, match="no setting named 'thread'"):
        Settings.load({}, thread=4)
    assert Settings(threads=4).source("threads") == ARGUMENT and Settings().source("threads") == DEFAULT


def test_flags_win_over_arguments_and_the_environment() -> None:
    env = {"FLUXION_THREADS": "2", "FLUXION_SIMD": "portable", "FLUXION_PDL": "1"}
    s = Settings.load(env, flags={"threads": "5"}, simd="avx2")
    assert (s.threads, s.simd, s.experimental.pdl) == (5, "avx2", True)
    assert (s.source("threads"), s.source("simd"), s.source("pdl"), s.source("gemv")) == (FLAG, ARGUMENT, ENV,
                                                                                          DEFAULT)
    rows = {knob.env: (value, source) for knob, value, source in s.rows()}
    assert rows["FLUXION_THREADS"] == ("5", "flag") and rows["FLUXION_PDL"] == ("1", "env FLUXION_PDL")
    assert rows["FLUXION_SIMD"] == ("avx2", "argument") and rows["FLUXION_GEMV"] == ("1", "default")
    assert rows["FLUXION_API_KEY"] == ("(unset)", "default")
    secret = Settings.load({"FLUXION_API_KEY": "s3cret"})
    assert {k.env: v for k, v, _ in secret.rows()}["FLUXION_API_KEY"] == "(set)" and secret.api_key == "s3cret"


def test_command_line_assignments() -> None:
    assert parse_assignments(["FLUXION_THREADS=4", "pdl=1", "fluxion_topk=midrange", "api_key=a=b"]) == {
        "threads": "4", "pdl": "1", "topk": "midrange", "api_key": "a=b"}
    with pytest.raises(SettingError, match="--set FLUXION_THREAD: no such setting"):
        parse_assignments(["FLUXION_THREAD=4"])
    with pytest.raises(SettingError, match="use NAME=VALUE"):
        parse_assignments(["FLUXION_THREADS"])


# ---- handed down --------------------------------------------------------------------------------------------------

def test_functions_without_settings_read_the_environment_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the code did before the settings object: a component built without one reads the variables then."""
    from fluxion_lite.hub import catalog
    from fluxion_lite.model import gemv_kernels
    from fluxion_lite.model.cuda_graphs import graphs_wanted
    from fluxion_lite.sparse.device import reuse_cache

    monkeypatch.setenv("FLUXION_GEMV_FUSE", "none")
    monkeypatch.setenv("FLUXION_REUSE_SHARE", "2")
    monkeypatch.setenv("FLUXION_CUDA_GRAPHS", "0")
    monkeypatch.setenv("FLUXION_CACHE_DIR", "/tmp/fluxion-models")
    assert gemv_kernels.fuse_mode() == "none" and reuse_cache.reuse_share() == 2.0
    assert not graphs_wanted(torch.device("cuda"), None) and catalog.cache_dir() == Path("/tmp/fluxion-models")
    explicit = Settings.load({})  # ... and one handed over wins over the environment
    assert gemv_kernels.fuse_mode(explicit) == "rope" and reuse_cache.reuse_share(explicit) == 0.5
    assert graphs_wanted(torch.device("cuda"), None, explicit) and catalog.cache_dir(explicit) != catalog.cache_dir()


def test_the_engine_hands_its_settings_down(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Engine(settings=...) is what the model, the sparse backend and its host store use, whatever the environment
    says; Engine() reads the environment when it is built."""
    from gguf_fixtures import TinySpec, write_tiny_model

    from fluxion_lite.engine.engine import Engine
    from fluxion_lite.sparse.backend import SparseAttention

    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, TinySpec("llama", n_heads=4, n_kv_heads=2, head_dim=16, d_ff=48, vocab=64, n_layers=2,
                                    context_length=1024), seed=3)
    for name, value in (("FLUXION_ASYNC_DECODE", "1"), ("FLUXION_HUGEPAGES", "0"), ("FLUXION_TOPK", "midrange"),
                        ("FLUXION_BACKGROUND", "all")):
        monkeypatch.setenv(name, value)
    mine = Settings.load({}, async_decode=False, topk="per-head")
    engine = Engine(str(path), attention="fixed", load_tokenizer=False, settings=mine)
    attn = engine.attn
    assert isinstance(attn, SparseAttention)
    assert engine.settings is mine and engine.model.settings is mine and attn.settings is mine
    assert not engine.async_decode and attn.store.hugepages
    assert attn.topk_scoring == "per-head" and attn.plan.background == "off"
    from_env = Engine(str(path), attention="fixed", load_tokenizer=False)
    attn = from_env.attn
    assert isinstance(attn, SparseAttention)
    assert from_env.settings == Settings.load() and from_env.settings.source("async_decode") == ENV
    assert from_env.async_decode and not attn.store.hugepages
    assert attn.topk_scoring == "midrange" and attn.plan.background == "all"
    monkeypatch.setenv("FLUXION_SELECTION", "fast")
    with pytest.raises(SettingError, match="FLUXION_SELECTION='fast'"):
        Engine(str(path), attention="fixed", load_tokenizer=False)


def test_native_configure_applies_only_changed_settings() -> None:
    from fluxion_lite.hostkv import native

    try:
        native.configure(Settings.load({}, threads=1, simd="portable"))
        assert (native.get_threads(), native.get_simd()) == (1, "portable")
        native.set_threads(2)  # a direct call stands while the settings stay the same
        native.configure(Settings.load({}, threads=1, simd="portable"))
        assert native.get_threads() == 2
    finally:
        native.configure(Settings.load({}))  # the defaults again: physical cores, the best SIMD path
    assert native.get_threads() == native.physical_cores() and native.get_simd() == native.simd_supported()[-1]


# ---- the command --------------------------------------------------------------------------------------------------

def test_settings_command_prints_values_and_sources(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    for knob in KNOBS:
        monkeypatch.delenv(knob.env, raising=False)
    monkeypatch.setenv("FLUXION_PDL", "1")
    monkeypatch.setenv("FLUXION_THREADS", "2")
    code = main(["settings", "--set", "FLUXION_THREADS=3", "--set", "selection=cpu"])
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    lines = out.splitlines()
    product, experimental = lines.index("settings:"), lines.index("experimental settings (A/B comparisons):")
    assert product < experimental
    row = {line.split()[0]: line.split(None, 1)[1] for line in lines if line.startswith("  FLUXION_")}
    assert len(row) == len(KNOBS)
    assert row["FLUXION_THREADS"].split() == ["3", "flag"]
    assert row["FLUXION_SELECTION"].split() == ["cpu", "flag"]
    assert row["FLUXION_PDL"].split() == ["1", "env", "FLUXION_PDL"]
    assert row["FLUXION_GEMV"].split() == ["1", "default"]
    for knob in KNOBS:  # each in its section
        index = next(i for i, line in enumerate(lines) if line.startswith(f"  {knob.env} "))
        assert (index > experimental) == knob.experimental, knob.env


@pytest.mark.parametrize("argv", [["settings"], ["generate", "-m", "no-such-model", "hello"]])
def test_a_bad_setting_is_a_clean_error(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                        argv: list[str]) -> None:
    """Checked before anything else: a model that does not exist is not even looked for."""
    monkeypatch.setenv("FLUXION_SELECTION", "fast")
    code, (out, err) = main(argv), capsys.readouterr()
    assert code == 2 and out == "" and err == "error: FLUXION_SELECTION='fast': use auto, cpu or gpu\n"
    monkeypatch.delenv("FLUXION_SELECTION")
    code, (out, err) = main([*argv, "--set", "FLUXION_PDL=2"]), capsys.readouterr()
    assert code == 2 and err == "error: FLUXION_PDL='2': use 0 or 1\n"


def test_console_command_with_a_bad_setting_exits_2_without_a_traceback() -> None:
    env = repo_env(REPO) | {"FLUXION_BA_WARPS": "3"}
    bad = subprocess.run([sys.executable, "-m", "fluxion_lite.cli", "settings"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and bad.stdout == "" and "Traceback" not in bad.stderr
    assert bad.stderr.strip() == "error: FLUXION_BA_WARPS='3': use 1, 2, 4, 8, 16 or 32"
    good = subprocess.run([sys.executable, "-m", "fluxion_lite.cli", "settings"], env=repo_env(REPO),
                          capture_output=True, text=True, timeout=120)
    assert good.returncode == 0 and "FLUXION_THREADS" in good.stdout


def test_docs_configuration_is_what_the_command_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/configuration.md is generated: `fluxion-lite settings --markdown > docs/configuration.md`."""
    assert main(["settings", "--markdown"]) == 0
    printed = capsys.readouterr().out
    assert printed == reference_markdown()
    committed = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == printed, ("docs/configuration.md is stale: regenerate it with "
                                  "`fluxion-lite settings --markdown > docs/configuration.md`")
    for knob in KNOBS:
        assert f"| `{knob.env}` |" in printed
