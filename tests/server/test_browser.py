"""The chat page in headless Chromium (Debian's chromium + chromedriver, driven by selenium).

tests/support/browser_setup.sh installs them when missing; the test skips (saying why) only if that install fails.
Loads /, sends a message, watches the reply stream in, checks the tokens/s readout and the Stop button, and saves a
screenshot: to FLUXION_SCREENSHOT when set (bench/results/browser_chat.png is made that way), else into the test's
temporary folder, so a test run leaves the tracked tree as it was.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "tests" / "browser_setup.sh"
SCREENSHOT_ENV = "FLUXION_SCREENSHOT"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1100,800"]


def _browser_ready() -> bool:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return False
    return shutil.which("chromium") is not None and shutil.which("chromedriver") is not None


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    if not _browser_ready():
        proc = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=900,
                              env={**os.environ, "PYTHON": sys.executable})
        if proc.returncode != 0 or not _browser_ready():
            pytest.skip(f"chromium/chromedriver/selenium could not be installed by {SETUP.name}: "
                        f"{(proc.stderr or proc.stdout).strip()[-400:]}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="fluxion-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in CHROMIUM_FLAGS + [f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    browser = webdriver.Chrome(options=options, service=Service(executable_path=shutil.which("chromedriver")))
    try:
        yield browser
    finally:
        browser.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "fluxion_lite.cli", "serve", "--port", str(port),
                             "--max-batch", "4", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, "server exited during start-up"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _assistant_texts(driver: Any) -> list[str]:
    return driver.execute_script(
        "return [...document.querySelectorAll('.msg.assistant .body')].map(e => e.textContent);")


def _meta(driver: Any) -> str:
    return driver.execute_script(
        "const m = document.querySelectorAll('.msg.assistant .meta'); return m.length ? m[m.length-1].textContent : '';")


def _send(driver: Any, text: str, max_tokens: int) -> None:
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.ID, "max-tokens")
    box.clear()
    box.send_keys(str(max_tokens))
    driver.find_element(By.ID, "input").send_keys(text)
    driver.find_element(By.ID, "send").click()


def test_chat_page_streams_a_reply(driver: Any, server_url: str, tmp_path: Path) -> None:
    driver.get(server_url + "/")
    _wait(lambda: driver.execute_script("return document.getElementById('status').textContent") == "ready", 30,
          "the page to report the server ready")
    assert "smollm2-135m" in driver.execute_script("return document.getElementById('model').textContent")

    _send(driver, "Write a short poem about the sea.", 48)
    # Streaming: the reply is seen at several intermediate lengths before the request finishes.
    lengths: set[int] = set()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        texts = _assistant_texts(driver)
        if texts and texts[-1]:
            lengths.add(len(texts[-1]))
        if driver.execute_script("return !document.getElementById('send').disabled") and lengths:
            break
        time.sleep(0.02)
    assert len(lengths) >= 3, f"reply did not arrive incrementally (lengths seen: {sorted(lengths)})"
    reply = _assistant_texts(driver)[-1]
    assert reply.strip()
    meta = _meta(driver)
    assert "tokens/s" in meta and "first token" in meta and ("stop" in meta or "length" in meta), meta

    # Second turn: multi-turn history is sent, and the server reuses the first turn's KV.
    _send(driver, "Now make it shorter.", 16)
    _wait(lambda: driver.execute_script("return !document.getElementById('send').disabled")
          and "prompt tokens cached" in _meta(driver), 90, "the second reply")
    assert len(_assistant_texts(driver)) == 2
    cached = int(_meta(driver).split("prompt tokens cached")[0].split("·")[-1].split("/")[0])
    assert cached > 0, _meta(driver)

    shot = Path(os.environ.get(SCREENSHOT_ENV) or tmp_path / "browser_chat.png")
    shot.parent.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000


def test_stop_button_aborts_the_request(driver: Any, server_url: str) -> None:
    from selenium.webdriver.common.by import By

    driver.get(server_url + "/")
    _wait(lambda: driver.execute_script("return document.getElementById('status').textContent") == "ready", 30,
          "the page to report the server ready")
    _send(driver, "Tell me a very long story about dragons.", 1000)
    _wait(lambda: (_assistant_texts(driver) or [""])[-1], 60, "the first streamed text")
    driver.find_element(By.ID, "stop").click()
    _wait(lambda: "stopped" in _meta(driver), 10, "the page to show the reply as stopped")

    def aborted() -> int:
        lines = httpx.get(f"{server_url}/metrics", timeout=5).text.splitlines()
        return int(next(line for line in lines if line.startswith("fluxion_requests_aborted_total ")).split()[1])

    _wait(lambda: aborted() >= 1, 10, "the server to abort the stopped request")
