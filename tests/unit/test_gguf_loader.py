"""GGUF loader on tiny files written here: every supported tensor type decodes to the values the test put in, the
metadata becomes the right ModelConfig, and every kind of bad file is a ModelFileError naming the file and the reason."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fluxion_lite.errors import ModelFileError
from fluxion_lite.model.gguf_loader import load_gguf, read_metadata
from gguf_fixtures import ALL_TYPES, QTYPE, TinySpec, make_weights, spec_metadata, write_gguf, write_tiny_model

MATRICES = ("token_embd.weight", "output.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
            "attn_output.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


def uniform_spec(type_name: str) -> TinySpec:
    """One layer where every matrix has `type_name`; all inner dims are 256 so K-quants fit everywhere."""
    return TinySpec(arch="llama", n_heads=8, n_kv_heads=2, head_dim=32, d_ff=256, vocab=64, n_layers=1, tied=False,
                    types={m: type_name for m in MATRICES})


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_every_tensor_type_decodes_to_the_encoded_values(tmp_path: Path, type_name: str) -> None:
    path = tmp_path / f"uniform-{type_name}.gguf"
    expected = write_tiny_model(path, uniform_spec(type_name), seed=ALL_TYPES.index(type_name))
    model = load_gguf(path, torch.float32)
    assert set(model.tensors) == set(expected)
    for name, want in expected.items():
        got = model.tensors[name]
        assert got.dtype == torch.float32
        assert tuple(got.shape) == want.shape, name
        assert np.abs(want).max() > 0, f"{name}: fixture must not be all zeros"
        # Every decode formula is exact in fp32 except the final subtraction/addition of a min: 1 ulp of the largest
        # operand at most, so 2 ulp of the tensor's max is a strict bound.
        tol = 2 * np.finfo(np.float32).eps * np.abs(want).max()
        err = np.abs(got.double().numpy() - want).max()
        assert err <= tol, f"{type_name} {name}: max error {err:.3g} > {tol:.3g}"


def test_bf16_dtype_request_rounds_the_decoded_values(tmp_path: Path) -> None:
    path = tmp_path / "q8.gguf"
    expected = write_tiny_model(path, uniform_spec("Q8_0"))
    model = load_gguf(path, torch.bfloat16)
    got = model.tensors["blk.0.attn_q.weight"]
    assert got.dtype == torch.bfloat16
    want = torch.from_numpy(expected["blk.0.attn_q.weight"]).to(torch.bfloat16)
    assert torch.equal(got, want)


def test_metadata_becomes_model_config(tmp_path: Path) -> None:
    spec = TinySpec(arch="qwen2", n_heads=6, n_kv_heads=2, head_dim=32, d_ff=384, vocab=77, tied=False, qkv_bias=True,
                    rope_theta=1e6, rms_eps=1e-6, rope_linear_factor=4.0, write_rope_dim=True, context_length=4096)
    path = tmp_path / "qwen.gguf"
    write_tiny_model(path, spec)
    cfg = load_gguf(path).config
    assert (cfg.arch, cfg.n_layers, cfg.d_model, cfg.d_ff) == ("qwen2", 2, 192, 384)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.gqa_ratio) == (6, 2, 32, 3)
    assert (cfg.vocab_size, cfg.context_length, cfg.rope_dim) == (77, 4096, 32)
    assert cfg.rope_theta == 1e6 and cfg.rms_eps == pytest.approx(1e-6, rel=1e-6)
    assert (cfg.rope_style, cfg.rope_scaling, cfg.rope_scale) == ("neox", "linear", 4.0)
    assert cfg.qkv_bias and not cfg.tied_embeddings

    llama = TinySpec(arch="llama", n_heads=3, n_kv_heads=3, head_dim=32, d_ff=256, vocab=64)
    write_tiny_model(tmp_path / "llama.gguf", llama)
    cfg = load_gguf(tmp_path / "llama.gguf").config
    assert (cfg.rope_style, cfg.rope_scaling, cfg.rope_scale) == ("interleaved", "none", 1.0)
    assert cfg.tied_embeddings and not cfg.qkv_bias and cfg.gqa_ratio == 1
    md, _ = read_metadata(tmp_path / "llama.gguf")
    assert md["general.architecture"] == "llama" and md["llama.block_count"] == 2


# ---------------------------------------------------------------- bad files


def small_spec() -> TinySpec:
    return TinySpec(arch="llama", n_heads=2, n_kv_heads=1, head_dim=32, d_ff=256, vocab=64, n_layers=1,
                    types={"ffn_down.weight": "Q4_K", "attn_q.weight": "Q8_0"})


def valid_file(tmp_path: Path) -> Path:
    path = tmp_path / "valid.gguf"
    write_tiny_model(path, small_spec())
    load_gguf(path)  # the unbroken file loads
    return path


def expect_error(path: Path, *reason_words: str) -> str:
    with pytest.raises(ModelFileError) as info:
        load_gguf(path)
    message = str(info.value)
    assert str(path) in message, message
    for word in reason_words:
        assert word.lower() in message.lower(), f"{word!r} not in {message!r}"
    return message


def test_wrong_magic(tmp_path: Path) -> None:
    path = valid_file(tmp_path)
    data = bytearray(path.read_bytes())
    data[:4] = b"GGML"
    path.write_bytes(bytes(data))
    expect_error(path, "not a GGUF file")
    text = tmp_path / "notes.gguf"
    text.write_text("hello, this is not a model\n")
    expect_error(text, "not a GGUF file")


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    expect_error(path, "not a GGUF file")


def test_missing_path(tmp_path: Path) -> None:
    expect_error(tmp_path / "nope.gguf", "no such file")
    expect_error(tmp_path, "no such file")  # a directory is not a model file either


def test_truncated_in_tensor_data(tmp_path: Path) -> None:
    path = valid_file(tmp_path)
    data = path.read_bytes()
    for keep in (len(data) - 100, len(data) // 2):
        cut = tmp_path / f"cut-{keep}.gguf"
        cut.write_bytes(data[:keep])
        expect_error(cut, "truncated", "tensor data")


def test_truncated_in_header(tmp_path: Path) -> None:
    """Cuts inside the version/count fields, the metadata key/values, the tensor-info table and the padding."""
    path = valid_file(tmp_path)
    data = path.read_bytes()
    _, reader = read_metadata(path)
    header_end = min(t.offset for t in reader.tensors)  # first byte of tensor data
    cuts = [4, 6, 10, 17, 24] + [int(header_end * f) for f in (0.05, 0.1, 0.2, 0.35, 0.5, 0.65, 0.8, 0.95)]
    cuts.append(header_end - 1)
    for keep in cuts:
        cut = tmp_path / f"head-{keep}.gguf"
        cut.write_bytes(data[:keep])
        expect_error(cut, "truncated", "header" if keep < header_end - 1 else "")


def test_unknown_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    write_tiny_model(path, small_spec(), arch_override="gpt2")
    message = expect_error(path, "unsupported architecture", "gpt2")
    assert "llama" in message and "qwen2" in message  # says what is supported


@pytest.mark.parametrize("type_name,block,type_size", [("Q2_K", 256, 84), ("IQ4_NL", 32, 18), ("Q3_K", 256, 110)])
def test_unsupported_tensor_type(tmp_path: Path, type_name: str, block: int, type_size: int) -> None:
    spec = small_spec()
    rows, cols = spec.d_model, spec.d_ff  # blk.0.ffn_down.weight: [d_model, d_ff]
    payload = np.random.default_rng(0).integers(0, 256, (rows, cols // block * type_size), dtype=np.uint8)
    path = tmp_path / f"{type_name}.gguf"
    write_tiny_model(path, spec, type_override={"blk.0.ffn_down.weight": (payload, QTYPE[type_name])})
    expect_error(path, "unsupported type", type_name, "blk.0.ffn_down.weight")


@pytest.mark.parametrize("missing", ["blk.0.ffn_up.weight", "token_embd.weight", "output_norm.weight"])
def test_missing_tensor(tmp_path: Path, missing: str) -> None:
    path = tmp_path / "missing.gguf"
    write_tiny_model(path, small_spec(), drop=(missing,))
    expect_error(path, "missing tensor", missing)


def test_missing_qkv_bias_of_a_later_layer(tmp_path: Path) -> None:
    spec = TinySpec(arch="qwen2", n_heads=2, n_kv_heads=1, head_dim=32, d_ff=256, vocab=64, qkv_bias=True)
    path = tmp_path / "bias.gguf"
    write_tiny_model(path, spec, drop=("blk.1.attn_k.bias",))
    expect_error(path, "missing tensor", "blk.1.attn_k.bias")


def test_wrong_tensor_shape(tmp_path: Path) -> None:
    spec = small_spec()
    payload = np.ones((spec.d_ff, spec.d_model + 32), dtype=np.float32)  # ffn_gate with a wrong inner dim
    path = tmp_path / "shape.gguf"
    write_tiny_model(path, spec, type_override={"blk.0.ffn_gate.weight": (payload, None)})  # type: ignore[dict-item]
    expect_error(path, "blk.0.ffn_gate.weight", "shape")


@pytest.mark.parametrize("change,reason", [
    ({"block_count": None}, "missing metadata key 'llama.block_count'"),
    ({"attention.layer_norm_rms_epsilon": None}, "missing metadata key 'llama.attention.layer_norm_rms_epsilon'"),
    ({"attention.head_count": "two"}, "'llama.attention.head_count' is 'two', expected a number"),
    ({"rope.freq_base": "high"}, "'llama.rope.freq_base' is 'high', expected a number"),
    ({"attention.head_count_kv": 3}, "inconsistent head counts"),
    ({"rope.scaling.type": "yarn"}, "unsupported rope scaling 'yarn'"),
])
def test_bad_metadata(tmp_path: Path, change: dict[str, object], reason: str) -> None:
    spec = small_spec()
    metadata = spec_metadata(spec)
    for key, value in change.items():
        if value is None:
            del metadata[key]
        else:
            metadata[key] = value  # type: ignore[assignment]
    tensors = {n: (payload, raw) for n, (payload, raw, _) in make_weights(spec, 0).items()}
    path = write_gguf(tmp_path / "meta.gguf", "llama", metadata, tensors)
    expect_error(path, reason)
