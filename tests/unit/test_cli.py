"""The real CLI (main([...]) in-process, and the installed console script as a subprocess): exit codes and messages.

Model-backed tests use the cached smollm2-135m (`fluxion-lite pull smollm2-135m`; the Makefile's test set-up does it).
"""

from __future__ import annotations

import io
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fluxion_lite.hub import catalog
from fluxion_lite.cli import main

REPO = Path(__file__).resolve().parents[2]
CONSOLE_SCRIPT = Path(sys.executable).with_name("fluxion-lite")
SMOLLM = Path.home() / ".cache" / "fluxion-lite" / "models" / "smollm2-135m.gguf"


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def smollm(monkeypatch: pytest.MonkeyPatch) -> Path:
    """The pulled default model; the test reads the real (default) cache even if another test moved the env."""
    monkeypatch.delenv("FLUXION_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    if not catalog.is_present(catalog.get_model("smollm2-135m")):
        pytest.skip("smollm2-135m is not pulled; run `fluxion-lite pull smollm2-135m`")
    return SMOLLM


# --- bad input: each must exit non-zero with a message that says what is wrong --------------------------------------


def test_unknown_model_name_lists_known_names(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(capsys, "generate", "-m", "gpt-17", "hello")
    assert code == 2 and out == ""
    assert err.startswith("error: unknown model 'gpt-17'; known models: smollm2-135m, qwen2.5-coder-0.5b")


def test_missing_model_path(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run_main(capsys, "generate", "-m", str(tmp_path / "nothing.gguf"), "hello")
    assert code == 2 and f"{tmp_path / 'nothing.gguf'}" in err and "does not exist" in err


def test_file_that_is_not_gguf(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 this is a zip, not a model" * 10)
    code, _, err = run_main(capsys, "generate", "-m", str(bogus), "hello")
    assert code == 2 and str(bogus) in err and "not a GGUF file" in err
    assert "Traceback" not in err


def test_truncated_gguf(capsys: pytest.CaptureFixture[str], tmp_path: Path, smollm: Path) -> None:
    truncated = tmp_path / "cut.gguf"
    with open(smollm, "rb") as f:
        truncated.write_bytes(f.read(3_000_000))  # header and metadata intact, tensor data cut off
    code, _, err = run_main(capsys, "generate", "-m", str(truncated), "hello")
    assert code == 2 and str(truncated) in err and ("truncated" in err or "corrupt" in err), err


def test_empty_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(capsys, "generate", "")
    assert (code, out) == (2, "") and err == "error: empty prompt\n"


def test_no_prompt_and_both_prompts(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run_main(capsys, "generate")
    assert code == 2 and "no prompt" in err
    prompt_file = tmp_path / "p.txt"
    prompt_file.write_text("hi")
    code, _, err = run_main(capsys, "generate", "hi", "--prompt-file", str(prompt_file))
    assert code == 2 and "not both" in err


def test_prompt_file_problems_name_the_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "missing.txt"
    code, _, err = run_main(capsys, "generate", "--prompt-file", str(missing))
    assert code == 2 and err == f"error: {missing}: No such file or directory\n"
    binary = tmp_path / "blob.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    code, _, err = run_main(capsys, "generate", "--prompt-file", str(binary))
    assert code == 2 and f"prompt file '{binary}' is not UTF-8 text" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-tokens", "0"], "max_tokens=0: must be an integer >= 1"),
        (["--max-tokens", "-5"], "max_tokens=-5"),
        (["--temperature", "-1"], "temperature=-1.0"),
        (["--top-p", "0"], "top_p=0.0"),
    ],
)
def test_bad_sampling_values_fail_before_loading(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    started = time.monotonic()
    code, _, err = run_main(capsys, "generate", "hello", *flags)
    assert code == 2 and message in err
    assert time.monotonic() - started < 5  # rejected up front, not after loading weights


def test_non_numeric_flag_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", "--max-tokens", "lots"])
    assert exit_info.value.code == 2
    assert "argument --max-tokens: invalid int value: 'lots'" in capsys.readouterr().err


def test_cuda_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, err = run_main(capsys, "generate", "hi", "--device", "cuda")
    assert code == 2 and "CUDA" in err


@pytest.mark.parametrize("switch,value", [("FLUXION_BACKGROUND", "bogus"), ("FLUXION_TOPK", "bogus")])
def test_bad_environment_switch_is_a_clean_error(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                                 smollm: Path, switch: str, value: str) -> None:
    monkeypatch.setenv(switch, value)
    code, out, err = run_main(capsys, "generate", "hello", "--attention", "fluxion", "--max-tokens", "2")
    assert code == 2 and out == "" and f"error: {switch}='{value}'" in err and "Traceback" not in err


def test_huge_max_tokens(capsys: pytest.CaptureFixture[str], smollm: Path) -> None:
    code, out, err = run_main(capsys, "generate", "hello", "--max-tokens", "1000000")
    assert code == 2 and out == ""
    assert "max_tokens (1000000)" in err and "exceeds the context length 8192" in err


def test_prompt_longer_than_context(capsys: pytest.CaptureFixture[str], tmp_path: Path, smollm: Path) -> None:
    long_prompt = tmp_path / "long.txt"
    long_prompt.write_text("the quick brown fox jumps over the lazy dog. " * 1200)  # ~12K tokens > 8192
    code, out, err = run_main(capsys, "generate", "--prompt-file", str(long_prompt), "--max-tokens", "4")
    assert code == 2 and out == ""
    assert "but the context length is 8192" in err


# --- working commands --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_generate_streams_greedy_text_and_honours_stop(capsys: pytest.CaptureFixture[str], smollm: Path) -> None:
    code, out, err = run_main(
        capsys, "generate", "-m", str(smollm), "The capital of France is", "--temperature", "0",
        "--max-tokens", "12", "--stop", ".",
    )  # fmt: skip
    assert code == 0, err
    assert "Paris" in out and "." not in out and out.endswith("\n")


@pytest.mark.slow
def test_chat_keeps_history_and_survives_a_rejected_turn(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, smollm: Path
) -> None:
    """Turn 1 fits a 600-token context; turn 2 only overflows because turn 1 is still in the history (so history is
    sent); the REPL reports it, drops that turn, answers turn 3, and stops at /exit."""
    long_message = "the quick brown fox jumps over the lazy dog. " * 40  # ~400 tokens
    script = f"{long_message}\n{long_message}\nSay hi.\n/exit\nnever read\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(script))
    code, out, err = run_main(capsys, "chat", "--max-context", "600", "--max-tokens", "8", "--temperature", "0")
    assert code == 0, err
    assert err.count("error:") == 1 and re.search(r"context length (is )?600", err), err
    replies = [line for line in out.split("\n") if line.strip()]
    assert len(replies) == 2  # turns 1 and 3


def test_chat_ends_on_eof(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, smollm: Path) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    code, out, err = run_main(capsys, "chat")
    assert (code, out) == (0, ""), err


def test_models_lists_catalog_and_local_files_via_console_script(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "extra.gguf").write_bytes(b"GGUF")
    env = {**os.environ, "FLUXION_CACHE_DIR": str(cache)}
    proc = subprocess.run([str(CONSOLE_SCRIPT), "models"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["NAME", "ARCH", "SIZE", "CONTEXT", "LOCAL", "PATH"]
    smol = next(line for line in lines if line.startswith("smollm2-135m *"))
    assert smol.split()[2:7] == ["llama", "98.4", "MB", "8192", "no"] and str(cache / "smollm2-135m.gguf") in smol
    assert any(line.startswith("qwen2.5-coder-1.5b") and "1.12 GB" in line and "32768" in line for line in lines)
    assert any(line.startswith("extra.gguf") and "local" in line for line in lines)


def test_pull_already_present_is_instant(capsys: pytest.CaptureFixture[str], smollm: Path) -> None:
    started = time.monotonic()
    code, out, err = run_main(capsys, "pull", "smollm2-135m")
    assert code == 0 and out.strip() == str(smollm)
    assert "already present and verified" in err
    assert time.monotonic() - started < 1.0


def test_pull_unknown_and_local_path(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run_main(capsys, "pull", "mistral-7b")
    assert code == 2 and "unknown model 'mistral-7b'" in err
    local = tmp_path / "mine.gguf"
    local.write_bytes(b"GGUF")
    code, out, err = run_main(capsys, "pull", str(local))
    assert code == 0 and out.strip() == str(local) and "nothing to pull" in err


def test_serve_checks_before_starting(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    code, _, err = run_main(capsys, "serve", "--port", "70000")
    assert code == 2 and "--port 70000" in err
    code, _, err = run_main(capsys, "serve", "-m", "nope")
    assert code == 2 and "unknown model 'nope'" in err
    code, _, err = run_main(capsys, "serve", "--replicas", "0")
    assert code == 2 and "--replicas 0: must be >= 1" in err
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a host with one GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    code, _, err = run_main(capsys, "serve", "--replicas", "2", "--device", "cuda")
    assert code == 2 and "each replica needs a GPU of its own, and this host has 1" in err
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray Serve were not installed
    code, _, err = run_main(capsys, "serve", "--replicas", "2")
    assert code == 2 and "pip install 'fluxion-lite[cluster]'" in err
    monkeypatch.setitem(sys.modules, "fluxion_lite.server.app", None)  # as if the server module were not installed
    code, _, err = run_main(capsys, "serve")
    assert code == 2 and "server is not available" in err


def test_ctrl_c_exits_130_without_traceback() -> None:
    # --prompt-file - waits on stdin, so the interrupt lands in a known place, before any model loads.
    proc = subprocess.Popen(
        [str(CONSOLE_SCRIPT), "generate", "--prompt-file", "-"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # a test run started in the background (`make test &`) inherits SIGINT ignored, and so would the CLI (as
        # any program there should): give the child the default disposition, as a terminal's foreground job has
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    _wait_for_stdin_read(proc.pid)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and out == ""


def _wait_for_stdin_read(pid: int, timeout: float = 30.0) -> None:
    """Until the process blocks in read(0, ...) (Linux: /proc/PID/syscall starts with syscall 0 on fd 0), or 1.5 s
    where that file cannot be read (a fixed sleep raced the CLI's start-up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/syscall") as f:
                if f.read().startswith("0 0x0 "):
                    return
        except OSError:
            time.sleep(1.5)
            return
        time.sleep(0.05)
