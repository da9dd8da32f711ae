"""Random-weight GGUF files of the benchmark shapes (bench/model_shapes.py), in the formats llama.cpp ships models in,
so that the 8B and 7B shapes can be timed as real files by our engine and by llama.cpp alike.

Types (--type):
  f16      every matrix F16 (std 0.02), norms F32
  q8_0     every matrix Q8_0
  q4_k_m   llama.cpp's Q4_K_M recipe (its llama-quant.cpp): Q4_K everywhere, Q6_K for output.weight and for
           attn_v.weight / ffn_down.weight in the layers where llama.cpp gives them more bits (the first and last
           eighth of the layers and every third one between)

Block contents are random bytes with valid fp16 scales, chosen so that values are zero-mean with a spread of a few
hundredths, as trained weights have: only speed and memory are meaningful. One random block pattern per type is
tiled over each tensor (a 4.9 GB Q4_K_M 8B file is written in seconds). The tokenizer is a SentencePiece-style
vocabulary of the shape's size (unk, bos, eos, the 256 byte tokens, plain pieces): enough for llama.cpp to load the
file, not to tokenise text.

Usage: python bench/random_gguf.py --shape llama3.1-8b --type q4_k_m /tmp/llama3.1-8b-q4_k_m.gguf
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TYPES = ("f16", "q8_0", "q4_k_m")
BLOCK_ELEMS = {"Q8_0": 32, "Q4_K": 256, "Q6_K": 256}
BLOCK_BYTES = {"Q8_0": 34, "Q4_K": 144, "Q6_K": 210}
TILE_BLOCKS = 1 << 16  # random blocks per pattern (a few MB), repeated over a tensor


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's rule for the layers whose attn_v / ffn_down get Q6_K under Q4_K_M."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def tensor_type(name: str, n_layers: int, ftype: str) -> str:
    """The GGML type of a matrix under a file type (norms and biases are F32 everywhere)."""
    if ftype == "f16":
        return "F16"
    if ftype == "q8_0":
        return "Q8_0"
    if name == "output.weight":
        return "Q6_K"
    if name.startswith("blk.") and name.endswith(("attn_v.weight", "ffn_down.weight")):
        return "Q6_K" if use_more_bits(int(name.split(".")[1]), n_layers) else "Q4_K"
    return "Q4_K"


def random_blocks(type_name: str, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """n_blocks random blocks of a quantized type [n_blocks, block bytes] uint8, every fp16 scale field valid:
    Q8_0 x = d q (d ~ 2.7e-4); Q4_K x = d sc q - dmin m with dmin = 7.5 d (zero mean over random 6-bit sc, m and
    4-bit q); Q6_K x = d sc (q - 32) (random int8 sc)."""
    blocks = rng.integers(0, 256, size=(n_blocks, BLOCK_BYTES[type_name]), dtype=np.uint8)

    def put_f16(offset: int, values: np.ndarray) -> None:
        blocks[:, offset : offset + 2] = values.astype("<f2").view(np.uint8).reshape(n_blocks, 2)

    jitter = rng.uniform(0.5, 1.5, n_blocks)
    if type_name == "Q8_0":
        put_f16(0, 2.7e-4 * jitter)
    elif type_name == "Q4_K":
        put_f16(0, 5e-5 * jitter)
        put_f16(2, 7.5 * 5e-5 * jitter)
    elif type_name == "Q6_K":
        put_f16(208, 1e-5 * jitter)
    else:
        raise ValueError(f"no random blocks for {type_name}")
    return blocks


def write(shape_name: str, out: Path, ftype: str = "f16", seed: int = 0) -> None:
    import gguf

    from fluxion_lite.model.config import ModelConfig
    from fluxion_lite.model.gguf_loader import tensor_shapes

    sys.path.insert(0, str(HERE))
    from model_shapes import SHAPES

    if ftype not in TYPES:
        raise SystemExit(f"--type {ftype}: use one of {', '.join(TYPES)}")
    s = SHAPES[shape_name]
    if s["arch"] != "llama":
        raise SystemExit(f"--shape {shape_name}: only llama-arch shapes are written (got {s['arch']})")
    cfg = ModelConfig(**s, context_length=131072, rms_eps=1e-5, rope_dim=s["head_dim"])
    d, vocab, n_layers = s["d_model"], s["vocab_size"], s["n_layers"]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_context_length(131072)
    w.add_embedding_length(d)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(s["d_ff"])
    w.add_head_count(s["n_heads"])
    w.add_head_count_kv(s["n_kv_heads"])
    w.add_rope_dimension_count(s["head_dim"])
    w.add_rope_freq_base(s["rope_theta"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    file_types = {"f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                  "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M}
    w.add_file_type(file_types[ftype])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    tokens += [f"tok{i}" for i in range(len(tokens), vocab)]
    types += [gguf.TokenType.NORMAL] * (vocab - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(seed)
    plan: list[tuple[str, tuple[int, ...], str]] = []
    for name, shp in tensor_shapes(cfg).items():  # [out, in] as numpy writes it; gguf reverses for ggml
        kind = tensor_type(name, n_layers, ftype) if len(shp) == 2 else "F32"
        plan.append((name, shp, kind))
        if kind == "F32":
            w.add_tensor_info(name, shp, np.dtype(np.float32), int(np.prod(shp)) * 4)
        elif kind == "F16":
            w.add_tensor_info(name, shp, np.dtype(np.float16), int(np.prod(shp)) * 2)
        else:
            rows, k = shp
            row_bytes = k // BLOCK_ELEMS[kind] * BLOCK_BYTES[kind]
            w.add_tensor_info(name, (rows, row_bytes), np.dtype(np.uint8), rows * row_bytes,
                              raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    patterns = {kind: random_blocks(kind, TILE_BLOCKS, rng) for kind in BLOCK_BYTES}
    half = (rng.standard_normal(1 << 24) * 0.02).astype(np.float16)
    t0 = time.time()
    for name, shp, kind in plan:
        n = int(np.prod(shp))
        if kind == "F32":
            w.write_tensor_data(np.ones(n, dtype=np.float32))
        elif kind == "F16":
            w.write_tensor_data(np.resize(half, n).reshape(shp))
        else:
            rows, k = shp
            n_blocks = rows * (k // BLOCK_ELEMS[kind])
            data = np.resize(patterns[kind], (n_blocks, BLOCK_BYTES[kind]))
            w.write_tensor_data(data.reshape(rows, -1))
    w.close()
    print(f"wrote {out}: {out.stat().st_size / 2**30:.2f} GiB ({ftype}) in {time.time() - t0:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sys.path.insert(0, str(HERE))
    from model_shapes import SHAPES

    ap.add_argument("--shape", default="llama3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--type", default="q4_k_m", choices=TYPES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    write(args.shape, args.out, args.type, args.seed)


if __name__ == "__main__":
    main()
