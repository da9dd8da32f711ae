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

--like FILE writes a random-weight twin of a real GGUF instead: the file's own header (every metadata key, the
real tokenizer, each tensor's name, shape and type) with random blocks of those types as the data. FILE may be the
whole model or just its header (`--header-of MODEL OUT` writes the first bytes up to the tensor data, a few MB), so a
model's twin can be made on a machine that the model itself would take many transfers to reach; speed and memory of
the twin are the model's.

Usage: python bench/random_gguf.py --shape llama3.1-8b --type q4_k_m /tmp/llama3.1-8b-q4_k_m.gguf
       python bench/random_gguf.py --header-of ~/.cache/fluxion-lite/models/qwen2.5-coder-1.5b.gguf q15.header
       python bench/random_gguf.py --like q15.header /tmp/qwen2.5-coder-1.5b.gguf
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TYPES = ("f16", "q8_0", "q4_k_m")
BLOCK_ELEMS = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
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
    """n_blocks random blocks of a quantized type [n_blocks, block bytes] uint8, every fp16 scale field valid and
    values of mean ~0 (Q4_0 and Q5_0: -d / 2, their formats' offset) and spread ~0.02: Q4_0 / Q5_0 / Q8_0
    x = d (q - offset); Q4_1 / Q5_1 x = d q + m with m = -d (mean q); Q4_K / Q5_K x = d sc q - dmin m with
    dmin = d (mean q) (random 6-bit sc and m); Q6_K x = d sc (q - 32) (random int8 sc)."""
    blocks = rng.integers(0, 256, size=(n_blocks, BLOCK_BYTES[type_name]), dtype=np.uint8)

    def put_f16(offset: int, values: np.ndarray) -> None:
        blocks[:, offset : offset + 2] = values.astype("<f2").view(np.uint8).reshape(n_blocks, 2)

    jitter = rng.uniform(0.5, 1.5, n_blocks)
    if type_name == "Q4_0":
        put_f16(0, 4.3e-3 * jitter)
    elif type_name == "Q5_0":
        put_f16(0, 2.2e-3 * jitter)
    elif type_name in ("Q4_1", "Q5_1"):
        d, mean_q = (4.3e-3, 7.5) if type_name == "Q4_1" else (2.2e-3, 15.5)
        put_f16(0, d * jitter)
        put_f16(2, -mean_q * d * jitter)
    elif type_name == "Q8_0":
        put_f16(0, 2.7e-4 * jitter)
    elif type_name == "Q4_K":
        put_f16(0, 5e-5 * jitter)
        put_f16(2, 7.5 * 5e-5 * jitter)
    elif type_name == "Q5_K":
        put_f16(0, 2.5e-5 * jitter)
        put_f16(2, 15.5 * 2.5e-5 * jitter)
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


def header_bytes(path: Path) -> int:
    """Where a GGUF file's tensor data starts (its header, metadata and tensor infos come before)."""
    import gguf

    return int(gguf.GGUFReader(str(path)).data_offset)


def write_header_of(model: Path, out: Path) -> None:
    """The first bytes of a GGUF file, up to its tensor data: the input of --like."""
    n = header_bytes(model)
    with open(model, "rb") as f:
        out.write_bytes(f.read(n))
    print(f"wrote {out}: the {n / 2**20:.1f} MiB header of {model}")


def write_like(source: Path, out: Path, seed: int = 0) -> None:
    """A twin of the GGUF file whose header (or whole file) is `source`: the same header, random tensor data."""
    import gguf

    with open(source, "rb") as f:
        head = f.read(64 << 20)
    with open(out, "wb") as f:
        f.write(head)
    # The reader maps tensor data past the header: give the file room (a sparse hole) before reading its infos.
    os.truncate(out, len(head) + (1 << 40))
    reader = gguf.GGUFReader(str(out), "r+")
    n_header = int(reader.data_offset)
    end = max(n_header + int(t.data_offset - reader.data_offset) + int(t.n_bytes) for t in reader.tensors)
    rng = np.random.default_rng(seed)
    patterns: dict[str, np.ndarray] = {}
    half = (rng.standard_normal(1 << 22) * 0.02).astype(np.float32)
    t0 = time.time()
    for t in reader.tensors:
        kind = t.tensor_type.name
        data = np.asarray(t.data).reshape(-1).view(np.uint8)  # the tensor's bytes in the file
        if kind in BLOCK_BYTES:
            if kind not in patterns:
                patterns[kind] = random_blocks(kind, TILE_BLOCKS, rng)
            data[:] = np.resize(patterns[kind], data.size // BLOCK_BYTES[kind] * BLOCK_BYTES[kind]).reshape(-1)
        elif kind in ("F32", "F16", "BF16"):
            n = int(t.n_elements)
            # vectors (norms, biases) of ones; matrices with the spread of trained weights
            values = np.ones(n, np.float32) if len(t.shape) == 1 else np.resize(half, n)
            if kind == "F32":
                data[:] = values.view(np.uint8)
            elif kind == "F16":
                data[:] = values.astype(np.float16).view(np.uint8)
            else:  # BF16: the upper half of each float32
                data[:] = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        else:
            raise SystemExit(f"{source}: tensor {t.name} has type {kind}, which this writer has no random blocks for")
    del reader
    os.truncate(out, end)
    print(f"wrote {out}: {end / 2**30:.2f} GiB, a random-weight twin of {source} in {time.time() - t0:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sys.path.insert(0, str(HERE))
    from model_shapes import SHAPES

    ap.add_argument("--shape", default="llama3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--type", default="q4_k_m", choices=TYPES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--like", type=Path, default=None,
                    help="a GGUF file or its header (--header-of): write its random-weight twin")
    ap.add_argument("--header-of", type=Path, default=None, help="write this GGUF file's header to OUT")
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    for flag, path in (("--like", args.like), ("--header-of", args.header_of)):
        if path is not None and not path.is_file():
            print(f"{flag} {path}: no such file", file=sys.stderr)
            raise SystemExit(2)
    if args.header_of is not None:
        write_header_of(args.header_of, args.out)
    elif args.like is not None:
        write_like(args.like, args.out, args.seed)
    else:
        write(args.shape, args.out, args.type, args.seed)


if __name__ == "__main__":
    main()
