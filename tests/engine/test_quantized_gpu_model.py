"""The forward over weights kept in their blocks for the GPU (model/quantized_gpu.py: Triton products for decode
rows, dequantized weights into torch's GEMM for prefill rows): its logits are the dequantized model's, on tiny
models that use every block type the GPU reads, two types in one q/k/v product, and an F16 matrix (a plain tensor
there). In fp32 both sides hold the same weight values, so only the order of the sums differs. Runs on CUDA, else
in Triton's interpreter (slow: tiny shapes, few decode steps)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fluxion_lite.model import qgemv_kernels as qk
from fluxion_lite.model.attention import DenseAttention, SeqChunk
from fluxion_lite.model.gguf_loader import load_gguf
from fluxion_lite.model.quantized_gpu import GpuQuantLinear
from fluxion_lite.model.transformer import Transformer
from gguf_fixtures import TinySpec, write_tiny_model

needs_triton = [
    pytest.mark.skipif(qk.triton is None, reason="Triton not installed"),
    pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                       reason="no CUDA, and Triton's interpreter is off"),
]
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")

K_TYPES = TinySpec(  # d = 256: the 256-element super-blocks; llama.cpp's Q4_K_M recipe puts Q6_K on v and down
    arch="qwen2", n_heads=4, n_kv_heads=2, head_dim=64, d_ff=512, vocab=300, tied=False, qkv_bias=True,
    types={"attn_q.weight": "Q4_K", "attn_k.weight": "Q4_K", "attn_v.weight": "Q6_K", "attn_output.weight": "Q5_K",
           "ffn_gate.weight": "Q4_K", "ffn_up.weight": "Q4_K", "ffn_down.weight": "Q6_K",
           "token_embd.weight": "Q8_0", "output.weight": "Q6_K"})
B32_TYPES = TinySpec(  # the 32-element blocks, a tied Q4_0 embedding, an F16 down projection
    arch="llama", n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96, vocab=200,
    types={"attn_q.weight": "Q4_0", "attn_k.weight": "Q4_1", "attn_v.weight": "Q5_0", "attn_output.weight": "Q5_1",
           "ffn_gate.weight": "Q8_0", "ffn_up.weight": "Q8_0", "ffn_down.weight": "F16", "token_embd.weight": "Q4_0"})


def _logits(model: Transformer, tokens: list[int], n_prefill: int) -> torch.Tensor:
    """Logits [T, V]: a prefill of the first n_prefill tokens (every row), then one decode step per token."""
    cfg = model.cfg
    attn = DenseAttention(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, model.dtype, model.device)
    attn.allocate(0)
    out = [model.forward(torch.tensor(tokens[:n_prefill]), torch.arange(n_prefill), [SeqChunk(0, 0, n_prefill)],
                         attn, logit_rows=torch.arange(n_prefill))]
    for i in range(n_prefill, len(tokens)):
        out.append(model.forward(torch.tensor([tokens[i]]), torch.tensor([i]), [SeqChunk(0, i, 1)], attn))
    return torch.cat(out).cpu()


@needs_triton[0]
@needs_triton[1]
@pytest.mark.parametrize("spec", [K_TYPES, B32_TYPES], ids=["k-types", "32-blocks"])
def test_gpu_blocks_forward_is_the_dequantized_model(spec: TinySpec, tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, spec, seed=5)
    blocks = Transformer(load_gguf(path, quantized=True), device=DEV, dtype=torch.float32, cuda_graphs=False,
                         quant_kernels="triton")
    dense = Transformer(load_gguf(path), device=DEV, dtype=torch.float32, cuda_graphs=False)
    lw = blocks.layers[0]
    assert isinstance(lw.wqkv, GpuQuantLinear) and isinstance(blocks.embed, GpuQuantLinear)
    if spec is K_TYPES:
        assert [g.name for g in lw.wqkv.groups] == ["Q4_K", "Q6_K"]  # q and k one launch, v another
    else:
        assert isinstance(lw.w_down, torch.Tensor) and lw.w_down.dtype == torch.float32  # F16: a plain matrix
    tokens = [(17 * i + 3) % spec.vocab for i in range(qk.MAX_M + 3)]  # a prefill above MAX_M rows, two steps
    got, want = _logits(blocks, tokens, qk.MAX_M + 1), _logits(dense, tokens, qk.MAX_M + 1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_native_kernels_refuse_other_devices_and_dtypes(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, B32_TYPES, seed=1)
    with pytest.raises(ValueError, match="native kernels run on the CPU with float32"):
        Transformer(load_gguf(path, quantized=True), dtype=torch.bfloat16, quant_kernels="native")
    with pytest.raises(ValueError, match="quant_kernels='int4'"):
        Transformer(load_gguf(path, quantized=True), quant_kernels="int4")


@pytest.mark.parametrize("spec", [K_TYPES, B32_TYPES], ids=["k-types", "32-blocks"])
def test_named_dtype_from_blocks_is_the_dequantized_file(spec: TinySpec, tmp_path: Path) -> None:
    """quant_kernels="none" (what a named dtype runs): every matrix dequantized from the mapped blocks where the
    model runs holds exactly the values of gguf-py's dequantizers (the load that went through host fp32)."""
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, spec, seed=2)
    for dtype in (torch.float32, torch.bfloat16):
        from_blocks = Transformer(load_gguf(path, quantized=True), device=DEV, dtype=dtype, cuda_graphs=False,
                                  quant_kernels="none", prepack=False)  # unpacked: compared as plain tensors
        reference = Transformer(load_gguf(path), device=DEV, dtype=dtype, cuda_graphs=False, prepack=False)
        assert not from_blocks.quantized
        for a, b in zip(from_blocks.layers, reference.layers):
            for name in ("wqkv", "bqkv", "wo", "w_gate_up", "w_down", "attn_norm"):
                x, y = getattr(a, name), getattr(b, name)
                assert x is None and y is None or x.dtype == y.dtype and torch.equal(x, y), name
        assert torch.equal(from_blocks.embed, reference.embed) and torch.equal(from_blocks.output, reference.output)
