"""Read a GGUF file: architecture metadata -> ModelConfig, tensors -> dequantised torch tensors.

Every failure becomes a ModelFileError that names the file and the reason, so the CLI and server never show a raw
traceback for a bad model file.
"""
from __future__ import annotations

import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fluxion_lite.model.config import ModelConfig
from fluxion_lite.errors import ModelFileError
from fluxion_lite.hostkv import quant
from fluxion_lite.model.gguf_file import GGUFFile, GGUFFormatError, TensorInfo

SUPPORTED_ARCHS = ("llama", "qwen2")
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
GGUF_MAGIC = b"GGUF"
NUMERIC_KEYS = ("block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
                "attention.head_count_kv", "attention.key_length", "attention.layer_norm_rms_epsilon", "vocab_size",
                "rope.freq_base", "rope.dimension_count", "rope.scaling.factor")


@dataclass
class GGUFModel:
    path: Path
    config: ModelConfig
    metadata: dict[str, Any]
    # name -> dequantised tensor, row-major ([out, in] for matrices); with load_gguf(quantized=True) the matrices are
    # QuantWeight views of the file's blocks instead (memory-mapped, nothing dequantised)
    tensors: dict[str, Any]

    def n_weights(self) -> int:
        """Elements of the model's tensors: what they hold once dequantized (blocks counted by their shape)."""
        return sum(t.numel() if isinstance(t, torch.Tensor) else t.n_out * t.k for t in self.tensors.values())


def _import_gguf() -> Any:
    import gguf  # deferred: importing gguf pulls in numpy-heavy modules; keep `import fluxion_lite` light

    return gguf


def read_metadata(path: Path) -> tuple[dict[str, Any], GGUFFile]:
    """Open the file and return (metadata dict, the parsed file). Raises ModelFileError for non-GGUF or truncated
    files, naming the part that cannot be read."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{path}: no such file")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (magic bytes {magic!r}, expected b'GGUF')")
    try:
        reader = GGUFFile(path)
    except GGUFFormatError as exc:
        part = "tensor data" if exc.part == "tensor data" else "header (metadata and tensor table)"
        size = os.path.getsize(path)
        raise ModelFileError(
            f"{path}: truncated or corrupt GGUF file ({size:,} bytes): its {part} cannot be read ({exc})"
        ) from exc
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{path}: cannot read the GGUF file: {exc}") from exc
    return dict(reader.metadata), reader


def config_from_metadata(path: Path, md: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelFileError(f"{path}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")

    for key in NUMERIC_KEYS:  # a string or array where a number belongs must not escape as a raw ValueError below
        value = md.get(f"{arch}.{key}")
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise ModelFileError(f"{path}: metadata key '{arch}.{key}' is {value!r}, expected a number")

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in md:
            raise ModelFileError(f"{path}: missing metadata key {full!r}")
        return md[full]

    n_heads = int(need("attention.head_count"))
    n_kv = int(md.get(f"{arch}.attention.head_count_kv", n_heads))
    d_model = int(need("embedding_length"))
    if n_heads <= 0 or n_kv <= 0 or n_heads % n_kv != 0 or d_model % n_heads != 0:
        raise ModelFileError(f"{path}: inconsistent head counts (heads {n_heads}, kv heads {n_kv}, width {d_model})")
    head_dim = int(md.get(f"{arch}.attention.key_length", d_model // n_heads))
    vocab = md.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(md["tokenizer.ggml.tokens"]) if "tokenizer.ggml.tokens" in md else None
    scaling = str(md.get(f"{arch}.rope.scaling.type", "none"))
    if scaling not in ("none", "linear"):
        raise ModelFileError(f"{path}: unsupported rope scaling {scaling!r} (supported: none, linear)")
    scale = float(md.get(f"{arch}.rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
    return ModelConfig(
        arch=arch,
        n_layers=int(need("block_count")),
        d_model=d_model,
        d_ff=int(need("feed_forward_length")),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        vocab_size=int(vocab) if vocab is not None else -1,  # fixed up from token_embd's shape by the loader
        context_length=int(md.get(f"{arch}.context_length", 2048)),
        rms_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(md.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_dim=int(md.get(f"{arch}.rope.dimension_count", head_dim)),
        rope_style="neox" if arch == "qwen2" else "interleaved",
        rope_scaling=scaling,
        rope_scale=scale,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        tied_embeddings="output.weight" not in tensor_names,
    )


def _check_type(path: Path, tensor: TensorInfo) -> str:
    if tensor.type_name not in SUPPORTED_TYPES:
        raise ModelFileError(f"{path}: tensor {tensor.name!r} has unsupported type {tensor.type_name} "
                             f"(supported: {', '.join(SUPPORTED_TYPES)})")
    return tensor.type_name


def _dequantise(path: Path, tensor: TensorInfo) -> np.ndarray:
    type_name = _check_type(path, tensor)
    if type_name == "F32":
        arr = np.array(tensor.data, dtype=np.float32)  # copy: the mapping is read-only
    elif type_name == "F16":
        arr = np.asarray(tensor.data, dtype=np.float16).astype(np.float32)
    else:
        gguf = _import_gguf()
        arr = gguf.quants.dequantize(tensor.data, gguf.GGMLQuantizationType(tensor.type_id))
    return arr.reshape(tensor.shape)


def required_tensor_names(cfg: ModelConfig) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight"]
    if not cfg.tied_embeddings:
        names.append("output.weight")
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        names += [p + s for s in ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                                  "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
                                  "ffn_down.weight")]
        if cfg.qkv_bias:
            names += [p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias"]
    return names


def _blocks(path: Path, tensor: TensorInfo) -> Any:
    """A matrix as the file stores it: a QuantWeight over the memory-mapped blocks (nothing copied or converted)."""
    type_name = _check_type(path, tensor)
    n_out, k = tensor.shape
    return quant.QuantWeight(type_name, tensor.data, n_out, k)


def load_gguf(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32, quantized: bool = False) -> GGUFModel:
    """Load all weights dequantised to `dtype` (CPU tensors; the model moves them to its device), or with
    quantized=True keep every matrix in its block format (hostkv.quant.QuantWeight over the memory-mapped file;
    vectors such as norms and biases still become fp32 tensors)."""
    path = Path(path)
    md, reader = read_metadata(path)
    by_name = {t.name: t for t in reader.tensors}
    cfg = config_from_metadata(path, md, set(by_name))
    tensors: dict[str, Any] = {}
    for name in required_tensor_names(cfg):
        if name not in by_name:
            raise ModelFileError(f"{path}: missing tensor {name!r}")
        try:
            if quantized and len(by_name[name].dims) == 2:
                tensors[name] = _blocks(path, by_name[name])
                continue
            arr = _dequantise(path, by_name[name])
        except ModelFileError:
            raise
        except (ValueError, OSError) as exc:
            raise ModelFileError(f"{path}: cannot read tensor {name!r}: {exc}") from exc
        tensors[name] = torch.from_numpy(np.ascontiguousarray(arr)).to(torch.float32 if quantized else dtype)
    vocab = _shape(tensors["token_embd.weight"])[0]
    if cfg.vocab_size != vocab:
        cfg = ModelConfig(**{**cfg.__dict__, "vocab_size": vocab})
    _check_shapes(path, cfg, tensors)
    return GGUFModel(path=path, config=cfg, metadata=md, tensors=tensors)


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs (required_tensor_names, same order) with its shape in torch order ([out, in])."""
    q_out, kv_out = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    per_layer = {
        "attn_norm.weight": (cfg.d_model,), "ffn_norm.weight": (cfg.d_model,),
        "attn_q.weight": (q_out, cfg.d_model), "attn_k.weight": (kv_out, cfg.d_model),
        "attn_v.weight": (kv_out, cfg.d_model), "attn_output.weight": (cfg.d_model, q_out),
        "ffn_gate.weight": (cfg.d_ff, cfg.d_model), "ffn_up.weight": (cfg.d_ff, cfg.d_model),
        "ffn_down.weight": (cfg.d_model, cfg.d_ff),
        "attn_q.bias": (q_out,), "attn_k.bias": (kv_out,), "attn_v.bias": (kv_out,),
    }
    model = {"token_embd.weight": (cfg.vocab_size, cfg.d_model), "output_norm.weight": (cfg.d_model,),
             "output.weight": (cfg.vocab_size, cfg.d_model)}
    return {n: model[n] if n in model else per_layer[n.split(".", 2)[2]] for n in required_tensor_names(cfg)}


def _shape(tensor: Any) -> tuple[int, ...]:
    """[out, in] of a dequantised tensor or of a QuantWeight."""
    return tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else (tensor.n_out, tensor.k)


def _check_shapes(path: Path, cfg: ModelConfig, t: dict[str, Any]) -> None:
    for name, shape in tensor_shapes(cfg).items():
        if name.startswith("blk.") and len(shape) == 2 and _shape(t[name]) != shape:  # the layers' matrices
            raise ModelFileError(f"{path}: tensor {name!r} has shape {_shape(t[name])}, expected {shape}")
