"""bench/llamacpp_peer.py off the GPU host: the sdist trim keeps what the library build reads and nothing of the other
backends or tools, and the random GGUF it writes is a model both our loader and llama.cpp accept, of the shape asked."""
from __future__ import annotations

import io
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import llamacpp_peer  # noqa: E402
from model_shapes import SHAPES  # noqa: E402


def _fake_sdist(path: Path) -> None:
    files = {
        "CMakeLists.txt": b"project(llama)\n", "src/llama.cpp": b"//\n", "include/llama.h": b"//\n",
        "ggml/src/ggml.c": b"//\n", "ggml/src/ggml-cuda/fattn.cu": b"//\n", "ggml/src/ggml-cpu/ops.cpp": b"//\n",
        "ggml/src/ggml-vulkan/vk.cpp": b"//\n", "ggml/src/ggml-metal/m.m": b"//\n", "tools/server/server.cpp": b"//\n",
        "tests/test-rope.cpp": b"//\n", "docs/build.md": b"#\n", "vendor/nlohmann/json.hpp": b"//\n",
        "vendor/stb/stb_image.h": b"//\n",
        "vendor/CMakeLists.txt": b"add_subdirectory(hash)\nadd_subdirectory(miniaudio)\nadd_subdirectory(stb)\n",
    }
    with tarfile.open(path, "w:gz") as t:
        for rel, data in {**files, "../llama_cpp/llama.py": b"#\n"}.items():
            name = ("pkg-0.3.36/vendor/llama.cpp/" + rel) if not rel.startswith("..") else "pkg-0.3.36/llama_cpp/llama.py"
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))


def test_trim_keeps_the_library_sources_only(tmp_path: Path) -> None:
    _fake_sdist(tmp_path / "s.tar.gz")
    llamacpp_peer.trim(tmp_path / "s.tar.gz", tmp_path / "t.tgz")
    with tarfile.open(tmp_path / "t.tgz") as t:
        names = {m.name for m in t.getmembers()}
        vendor = t.extractfile("llama.cpp/vendor/CMakeLists.txt").read().decode()  # type: ignore[union-attr]
    assert names == {f"llama.cpp/{n}" for n in ("CMakeLists.txt", "src/llama.cpp", "include/llama.h", "ggml/src/ggml.c",
                                                "ggml/src/ggml-cuda/fattn.cu", "ggml/src/ggml-cpu/ops.cpp",
                                                "vendor/nlohmann/json.hpp", "vendor/CMakeLists.txt")}
    assert vendor.split() == ["add_subdirectory(hash)"]  # the dropped libraries are no longer asked for


def test_random_gguf_is_the_shape_asked_and_loads(tmp_path: Path) -> None:
    from fluxion_lite.model.gguf_loader import load_gguf

    out = tmp_path / "tiny.gguf"
    llamacpp_peer.write_gguf("tiny", out, seed=3)
    model = load_gguf(out)
    for key, value in SHAPES["tiny"].items():
        assert getattr(model.config, key) == value, key
    w = model.tensors["blk.1.ffn_down.weight"].numpy()
    assert w.shape == (512, 1024) and 0.015 < w.std() < 0.025 and np.isfinite(w).all()
    assert (model.tensors["output_norm.weight"].numpy() == 1).all()

    llama_cpp = pytest.importorskip("llama_cpp")
    vocab_only = llama_cpp.Llama(model_path=str(out), vocab_only=True, verbose=False)
    assert vocab_only.n_vocab() == SHAPES["tiny"]["vocab_size"]


def test_gguf_refuses_a_shape_of_another_architecture(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="only llama-arch"):
        llamacpp_peer.write_gguf("qwen2.5-7b", tmp_path / "q.gguf", seed=0)
