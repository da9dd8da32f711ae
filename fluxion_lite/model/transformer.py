"""Llama / Qwen2 decoder forward in torch, over a packed batch of sequence chunks.

Pure tensor code: weights come from the GGUF loader, K/V storage and attention from an AttentionBackend, so the dense and
the hybrid sparse paths share every other line.

Decode is dominated by per-op overhead (Python dispatch on the CPU, kernel launches on CUDA), not arithmetic, so the
forward keeps the op count per layer small: one matmul for q/k/v and one for gate/up (weights concatenated at load),
RoPE as three in-place kernels over q and k together with cos/sin gathered once per forward from a table built once per
position range, residual adds fused into the output matmuls (addmm_), logits only for the rows asked for, and at most
one host->device copy per forward (non-blocking, from pinned memory) with no device->host syncs. On CUDA a one-row
forward (batch-1 decode) runs its weight products as matrix-vector kernels (gemv_kernels.py: no split-K reduction
kernels, gate/up/silu in one).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from fluxion_lite.model import dense_kernels, gemv_kernels
from fluxion_lite.model.attention import AttentionBackend, SeqChunk
from fluxion_lite.model.config import ModelConfig
from fluxion_lite.model.cuda_graphs import DecodeGraphs, graphs_wanted
from fluxion_lite.model.gguf_loader import GGUFModel
from fluxion_lite.hostkv.layer import NativeDecoder, NativeLayer
from fluxion_lite.model.quantized import PREFILL_ROWS, DequantScratch, QuantLinear, native_layer
from fluxion_lite.model.quantized_gpu import GpuQuantLinear, GpuScratch, supported as gpu_supported
from fluxion_lite.settings import Settings

MIN_ROPE_POSITIONS = 4096  # first table size; it doubles when a position beyond it arrives


# a dense matrix, or one kept in the file's block format: products by the native library on the CPU
# (model/quantized.py) or by Triton kernels on the GPU (model/quantized_gpu.py)
Weight = torch.Tensor | QuantLinear | GpuQuantLinear


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [d]
    wqkv: Weight  # [(Hq + 2 Hkv) D, d]: one matmul for q, k and v
    bqkv: torch.Tensor | None  # [(Hq + 2 Hkv) D] (qwen2)
    wo: Weight  # [d, Hq D]
    ffn_norm: torch.Tensor  # [d]
    w_gate_up: Weight  # [2 F, d]: gate and up in one matmul
    w_down: Weight  # [d, F]
    # With oneDNN prepacking (CPU, bf16: see Transformer), wqkv / w_gate_up / w_down hold opaque packed tensors
    # (they are read by this module only) and wo_packed is a packed twin of wo, which stays plain for other readers.
    wo_packed: torch.Tensor | None = None
    # quantized weights: the layer's work before and after attention as two native calls (decode rows)
    native: NativeLayer | None = None

    def __post_init__(self) -> None:
        # transposed views made once, so a step does not call .t() twice per layer (no copy: same storage); None for
        # quantized weights (their product is a call, not a matmul over a view)
        dense = isinstance(self.wo, torch.Tensor)
        self.wo_t: torch.Tensor | None = self.wo.t() if dense else None  # [Hq D, d]
        self.w_down_t: torch.Tensor | None = self.w_down.t() if dense else None  # [F, d]; None once packed

    def wo_dense(self) -> torch.Tensor:
        """The output projection as a dense fp32 [d, Hq D] matrix (analysis: head contributions)."""
        if isinstance(self.wo, QuantLinear):
            return self.wo.dense()
        if isinstance(self.wo, GpuQuantLinear):
            return self.wo.dense(torch.float32, scratch=False)
        return self.wo.float()

    def prepack(self) -> None:
        """Replace the matmul weights by oneDNN-packed copies (the plain ones are freed, except wo)."""
        self.wqkv = _pack(self.wqkv)
        self.w_gate_up = _pack(self.w_gate_up)
        self.w_down, self.w_down_t = _pack(self.w_down), None
        self.wo_packed = _pack(self.wo)


def _pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w)


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN weight prepacking pays on the CPU in bf16: its packed GEMV streams weights ~1.65x faster than the default
    bf16 path on this VM's AVX512-BF16 cores (qwen2.5-coder-0.5b: 117 -> 71 ms of matmul per decode token, 1 thread);
    in fp32 MKL's default path is as fast. Checked with a small trial so a torch build without the ops falls back."""
    if device.type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        # asked first rather than learnt from the trial's exception: a C++ exception thrown inside torch aborts a
        # process with libasan preloaded (native/asan_check.py), as on CPUs without AVX512-BF16
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        w = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32).div_(2048).to(dtype)
        a = torch.ones(3, 32, dtype=dtype)
        got = torch.ops.mkldnn._linear_pointwise(a, _pack(w), None, "none", [], "")
        return bool(torch.allclose(got.float(), F.linear(a, w).float(), rtol=1e-2, atol=1e-2))
    except (RuntimeError, AttributeError):
        return False


def linear(a: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a @ w^T (+ bias) for a plain, a oneDNN-packed or a quantized w: a [T, in] -> [T, out]."""
    if isinstance(w, (QuantLinear, GpuQuantLinear)):
        return w(a, bias)
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(a, w, bias, "none", [], "")
    return F.linear(a, w, bias)


def _add_product_(res: torch.Tensor, a: torch.Tensor, w: Weight) -> None:
    """res [T, out] += a [T, in] @ w^T in place, w in GPU blocks or a plain tensor."""
    if isinstance(w, GpuQuantLinear):
        w.add_(res, a)
    else:
        res += linear(a, w)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, d] -> normalised in fp32, cast back to x's dtype, times weight (the composite the CPU path uses)."""
    if x.dtype in (torch.float32, torch.float64):  # no casts: each is a dispatcher call per norm (and fp64 stays fp64)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps)) * weight
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(eps))).to(x.dtype) * weight


class RotaryEmbedding:
    """RoPE as x * cos + swap(x) * sin_signed, with both factors read from a table [P, 2, R] (R = rope_dim).

    swap exchanges the two members of each rotated pair and sin_signed carries the minus sign of the first member, so
    both pair layouts (interleaved (2i, 2i+1) for llama, half-split (i, i + R/2) for qwen2) are the same three kernels:
    one gather for swap(x) along a fixed index, then an in-place multiply and an in-place multiply-add. The table is computed in float64
    once per position range and stored in the model dtype, so a step only gathers its positions' rows.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, settings: Settings | None = None):
        half = cfg.rope_dim // 2
        exponents = torch.arange(half, dtype=torch.float64) * 2 / cfg.rope_dim
        self.inv_freq = 1.0 / (cfg.rope_theta**exponents)  # [R/2] float64, on the host
        self.style, self.rope_dim, self.scale = cfg.rope_style, cfg.rope_dim, cfg.rope_scale
        self.device, self.dtype = device, dtype
        self.table = torch.empty(0, 2, self.rope_dim, dtype=dtype, device=device)  # [P, 2, R]: cos, sin_signed
        pair = torch.arange(self.rope_dim)
        if self.style == "neox":  # i <-> i + R/2
            swap = (pair + self.rope_dim // 2) % self.rope_dim
        else:  # 2i <-> 2i + 1
            swap = pair ^ 1
        self.swap_index = swap.to(device)  # [R] long, made once
        # one Triton kernel instead of three torch ones on CUDA (dense_kernels.py says why)
        self.fused = dense_kernels.rope_enabled(device, self.rope_dim, settings)

    def ensure(self, n_positions: int) -> torch.Tensor:
        """The table covering positions 0..n_positions-1 (grown by doubling; positions past the end never index it)."""
        have = self.table.shape[0]
        if n_positions <= have:
            return self.table
        size = max(n_positions, 2 * have, MIN_ROPE_POSITIONS)
        angles = (torch.arange(size, dtype=torch.float64) / self.scale)[:, None] * self.inv_freq[None, :]  # [P, R/2]
        cos, sin = angles.cos(), angles.sin()
        if self.style == "neox":  # pairs (i, i + R/2): [cos | cos], [-sin | sin]
            cos_full, sin_signed = torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)
        else:  # interleaved pairs (2i, 2i + 1): [c0 c0 c1 c1 ...], [-s0 s0 -s1 s1 ...]
            cos_full = cos.repeat_interleave(2, dim=-1)
            sin_signed = torch.stack((-sin, sin), dim=-1).flatten(-2)
        # A one-off host->device copy per growth (a prefill reaching a new power of two), never per decode step.
        self.table = torch.stack((cos_full, sin_signed), dim=1).to(device=self.device, dtype=self.dtype)
        return self.table

    def apply_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate x: [T, H, D] in place (any row stride; last dim contiguous) by cos, sin: [T, 1, R]."""
        if self.fused:
            dense_kernels.rope_(x, cos, sin, self.style == "neox")
            return
        rot = x if self.rope_dim == x.shape[-1] else x[..., : self.rope_dim]  # [T, H, R]
        swapped = rot.index_select(-1, self.swap_index)  # [T, H, R] copy, read before rot is overwritten
        rot.mul_(cos).addcmul_(swapped, sin)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D], positions: [T] (on x's device) -> rotated copy (the unfused entry point, for tests/tools)."""
        table = self.ensure(int(positions.max()) + 1 if positions.numel() else 0)
        cs = table[positions][:, :, None, :]  # [T, 2, 1, R]
        out = x.clone()
        self.apply_(out, cs[:, 0], cs[:, 1])
        return out


class Transformer:
    def __init__(self, gguf_model: GGUFModel, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 prepack: bool | None = None, cuda_graphs: bool | None = None, settings: Settings | None = None,
                 quant_kernels: str | None = None):
        """prepack: oneDNN-packed matmul weights (None: wherever prepack_supported says they pay, i.e. CPU bf16).
        cuda_graphs: run pure decode steps through piecewise CUDA graphs (decode_graphs.py; None: on CUDA unless
        the setting FLUXION_CUDA_GRAPHS=0). settings: the kernels' switches (None: Settings.load()).
        quant_kernels: for a file loaded as its blocks (load_gguf(quantized=True)), "native" (products by the C
        library: CPU, fp32 activations), "triton" (model/quantized_gpu.py: CUDA, or the CPU under Triton's
        interpreter, as the tests run it) or "none" (every matrix dequantized to `dtype` where it is used: on the
        GPU for CUDA, so that no fp32 copy of the model passes through host RAM); None: triton on CUDA, else
        native."""
        self.settings = settings = settings if settings is not None else Settings.load()
        self.cfg = cfg = gguf_model.config
        self.device, self.dtype = torch.device(device), dtype
        if self.device.type == "cuda" and self.device.index is None:
            # a concrete index, so `tensor.device == self.device` recognises tensors already on it (cuda:0 != cuda)
            self.device = torch.device("cuda", torch.cuda.current_device())
        t = gguf_model.tensors
        kernels = quant_kernels or ("triton" if self.device.type == "cuda" else "native")
        if kernels not in ("native", "triton", "none"):
            raise ValueError(f"quant_kernels={quant_kernels!r}: use 'native', 'triton' or 'none'")
        # whether the matrices stay in their blocks (else they are dense tensors of `dtype`)
        self.quantized = not isinstance(t["blk.0.attn_q.weight"], torch.Tensor) and kernels != "none"
        self.native_quant = self.quantized and kernels == "native"  # the C library's products and layer calls
        if self.native_quant and (self.device.type != "cpu" or dtype != torch.float32):
            raise ValueError("quantized weights with the native kernels run on the CPU with float32 activations")
        scratch = DequantScratch()  # the prefill products' fp32 copy of one weight, shared by every layer
        gpu_scratch = GpuScratch(self.device, dtype)  # the same on the GPU, in the compute dtype

        def blocks(parts: list) -> Weight:
            """Matrices that share an input, from the file's blocks: kept as they are, or dequantized to one dense
            [sum n_out, k] tensor of `dtype` (also where the GPU kernels do not read the type: F16 / BF16 / F32)."""
            if self.native_quant:
                return QuantLinear(parts, scratch)  # one native call for all, input quantized once
            gpu_readable = all(gpu_supported(p) for p in parts)
            if self.quantized and gpu_readable:  # kernels "triton"
                return GpuQuantLinear(parts, self.device, gpu_scratch)
            if gpu_readable and self.device.type == "cuda":  # the blocks to the GPU, dequantized there
                return GpuQuantLinear(parts, self.device, gpu_scratch).dense(dtype, scratch=False)
            # the native dequantizer (fp32, into one tensor), then one conversion to the device
            return QuantLinear(parts, scratch).dense().to(device=self.device, dtype=dtype)

        def w(name: str) -> Weight:
            if not isinstance(t[name], torch.Tensor):
                return blocks([t[name]])
            return t[name].to(device=self.device, dtype=dtype)

        def cat(*names: str) -> Weight:
            if not isinstance(t[names[0]], torch.Tensor):
                return blocks([t[n] for n in names])
            # concatenate where the loaded tensors are (the host, for GGUF loads) in their dtype, then one conversion
            # to the device: no second device-sized temporary per fused weight
            return torch.cat([t[n] for n in names]).to(device=self.device, dtype=dtype).contiguous()

        self.embed = w("token_embd.weight")  # [V, d]
        self.output = self.embed if cfg.tied_embeddings else w("output.weight")  # [V, d]
        self.output_norm = w("output_norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            self.layers.append(
                LayerWeights(
                    attn_norm=w(p + "attn_norm.weight"),
                    wqkv=cat(p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"),
                    bqkv=cat(p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias") if cfg.qkv_bias else None,
                    wo=w(p + "attn_output.weight"),
                    ffn_norm=w(p + "ffn_norm.weight"),
                    w_gate_up=cat(p + "ffn_gate.weight", p + "ffn_up.weight"),
                    w_down=w(p + "ffn_down.weight"),
                )
            )
        if self.native_quant:
            for lw in self.layers:
                assert isinstance(lw.wqkv, QuantLinear) and isinstance(lw.wo, QuantLinear)
                assert isinstance(lw.w_gate_up, QuantLinear) and isinstance(lw.w_down, QuantLinear)
                lw.native = native_layer(cfg, lw.attn_norm, lw.ffn_norm, lw.bqkv, lw.wqkv, lw.wo, lw.w_gate_up,
                                         lw.w_down)
        # a one-token step of one sequence in the dense CPU cache goes through every layer in one native call
        self.native_decoder = NativeDecoder([lw.native for lw in self.layers]) if self.native_quant else None
        self.prepacked = not self.quantized and (prepack_supported(self.device, dtype) if prepack is None else prepack)
        # the vocabulary matmul's weight: packed separately when tied, since the embedding lookup needs the plain one
        self.output_mm = self.output
        if isinstance(self.output_mm, QuantLinear):
            self.output_mm.prefill_fp32 = True  # many logit rows (evaluation) in fp32: model/quantized.py says why
        if self.prepacked:
            for lw in self.layers:
                lw.prepack()
            self.output_mm = _pack(self.output)
            if not cfg.tied_embeddings:
                self.output = self.output_mm  # nothing else reads it: do not keep a plain copy as well
        self.rope = RotaryEmbedding(cfg, self.device, dtype, settings)
        self.rope.ensure(min(cfg.context_length, MIN_ROPE_POSITIONS))
        # On CUDA torch's rms_norm is one fused kernel (fp32 inside); on the CPU it is a slower composite of the same
        # ops, so the CPU keeps ours.
        self._fused_norm = self.device.type == "cuda"
        self._dense_kernels = dense_kernels.enabled(self.device, settings)  # norm and silu * mul: one short kernel each
        # one-row weight products over dense weights (quantized ones have their own kernels)
        self._gemv = gemv_kernels.enabled(self.device, settings) and not self.prepacked and not self.quantized
        # ... with RoPE after q/k/v (and with FLUXION_GEMV_FUSE=all the norm before) inside the same kernel, and with
        # L2 eviction policies on the weight reads: see gemv_kernels.fuse_mode and l2_hints_enabled
        fuse = gemv_kernels.fuse_mode(settings) if self._gemv else "none"
        self._gemv_rope = fuse in ("rope", "all") and cfg.rope_dim == cfg.head_dim
        self._gemv_norm = fuse == "all"
        self._l2_hints = self._gemv and gemv_kernels.l2_hints_enabled(settings)
        # the kernels' launch options (FLUXION_PDL, FLUXION_GEMV_CONFIG): the norm kernel takes pdl, gemv both
        self._pdl = settings.experimental.pdl
        self._gemv_opts = {"pdl": self._pdl, "tiles": settings.experimental.gemv_config}
        self.graphs = DecodeGraphs(self) if graphs_wanted(self.device, cuda_graphs, settings) else None

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._dense_kernels:
            return dense_kernels.rms_norm(x, weight, self.cfg.rms_eps, pdl=self._pdl)
        if self._fused_norm:
            return F.rms_norm(x, weight.shape, weight, self.cfg.rms_eps)
        return rms_norm(x, weight, self.cfg.rms_eps)

    def _one_row(self, x: torch.Tensor) -> bool:
        """Whether x [T, K] goes through gemv_kernels: a single contiguous row (batch-1 decode) on CUDA."""
        return self._gemv and x.shape[0] == 1 and x.is_contiguous()

    def _evict(self, policy: str) -> str:
        """The L2 eviction policy for a one-row weight read ("" when the hints are off)."""
        return policy if self._l2_hints else ""

    def _row_norm(self, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, gemv_kernels.Norm | None]:
        """A one-row product's input and norm: (x, the norm for the kernel) with _gemv_norm, else (norm(x), None)."""
        if self._gemv_norm:
            return x, gemv_kernels.Norm(weight, self.cfg.rms_eps)
        return self._norm(x, weight), None

    def _row_product(self, x: torch.Tensor, norm_weight: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                     cos: torch.Tensor, sin: torch.Tensor, rot_rows: int, evict: str) -> torch.Tensor:
        """One row x [1, d]: its RMS norm (_row_norm) times w [N, d]^T (+ bias) -> [1, N], the first rot_rows
        outputs rotated by RoPE inside the kernel when _gemv_rope (else the caller rotates them)."""
        h, norm = self._row_norm(x, norm_weight)
        rope = (gemv_kernels.Rope(cos, sin, rot_rows, self.cfg.head_dim, self.rope.style == "neox")
                if self._gemv_rope else None)
        return gemv_kernels.gemv(h, w, bias, norm=norm, rope=rope, evict=self._evict(evict), **self._gemv_opts)

    def _inputs(
        self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """tokens, positions (and the logit rows) on the device: host tensors travel in one non-blocking copy."""
        parts = [tokens, positions] + ([rows] if rows is not None else [])
        out: list[torch.Tensor | None] = [
            p if p.device == self.device and p.dtype == torch.long else None for p in parts  # already usable
        ]
        todo = [i for i, o in enumerate(out) if o is None]
        if self.device.type == "cpu" or any(parts[i].device.type != "cpu" for i in todo):
            # nothing to batch (CPU model), or a tensor on another device: plain conversions
            for i in todo:
                out[i] = parts[i].to(self.device, torch.long)
        elif todo:
            # host tensors for a GPU model: one packed copy instead of one per tensor (each pageable copy waits)
            host = torch.cat([parts[i].to(torch.long).reshape(-1) for i in todo])
            if self.device.type == "cuda":
                host = host.pin_memory()  # pinned: the copy is asynchronous and the host does not wait for the GPU
            moved = host.to(self.device, non_blocking=True).split([parts[i].numel() for i in todo])
            for i, m in zip(todo, moved):
                out[i] = m
        tok, pos = out[0], out[1]
        assert tok is not None and pos is not None
        return tok, pos, (out[2] if rows is not None else None)

    @staticmethod
    def _rows(logit_rows: torch.Tensor | None, chunks: list[SeqChunk], n_tok: int) -> torch.Tensor | None:
        """The rows whose logits are wanted, or None when that is every row in order (a pure decode batch)."""
        if logit_rows is None:
            if all(c.length == 1 for c in chunks):
                return None
            ends, total = [], 0
            for c in chunks:
                total += c.length
                ends.append(total - 1)
            return torch.tensor(ends, dtype=torch.long)
        if logit_rows.device.type == "cpu" and logit_rows.numel() == n_tok:
            # checked on the host only (free there); a device tensor is used as given rather than synced to check
            if logit_rows.tolist() == list(range(n_tok)):
                return None
        return logit_rows

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        chunks: list[SeqChunk],
        attn: AttentionBackend,
        logit_rows: torch.Tensor | None = None,
        defer_sync: bool = False,
    ) -> torch.Tensor:
        """tokens, positions: [T] packed over `chunks` (positions inside each chunk's [start, start + length));
        tokens may be on the device. Returns logits [R, V] (fp32) for the rows in logit_rows (default: the last
        token of every chunk). defer_sync: the step may still run on the device when this returns (graphed decode
        steps of a backend that allows it: DecodeGraphs.forward); otherwise ignored."""
        n_tok = tokens.shape[0]
        rows = self._rows(logit_rows, chunks, n_tok)
        if rows is None and self.graphs is not None and self.graphs.handles(chunks):
            return self.graphs.forward(tokens, positions, chunks, attn, defer_sync)
        tokens, positions, rows = self._inputs(tokens, positions, rows)
        # The table size comes from the chunks (host ints), never from reading positions back from the device.
        self.rope.ensure(max(c.start + c.length for c in chunks))
        x, cos, sin = self.embed_tokens(tokens, positions)
        if self.native_decoder is not None and n_tok == len(chunks) and self._native_step(x, cos, sin, chunks, attn):
            return self.logits(x, rows)
        for i, lw in enumerate(self.layers):
            q, k, v = self.pre_attention(lw, x, cos, sin)
            o = attn.attend(i, q, k, v, chunks)  # [T, Hq, D]
            x = self.post_attention(lw, x, o)
        return self.logits(x, rows)

    def _native_step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, chunks: list[SeqChunk],
                     attn: AttentionBackend) -> bool:
        """A decode step (one token per sequence, x [B, d] embedded) with every layer in one native call where the
        backend allows it: one dense sequence over its fp32 cache, or rows over the host KV store. True: x holds
        the last layer's output; False: nothing was touched."""
        assert self.native_decoder is not None
        assert self._rope_rows(cos, sin), "the RoPE rows are gathered as one table row per token"
        kv = attn.dense_decode_cache(chunks) if len(chunks) == 1 else None
        if kv is not None:
            self.native_decoder.step(x, cos, kv[0], kv[1], chunks[0].start, self.cfg.head_dim**-0.5)
            return True
        return attn.native_decode_step(self.native_decoder, x, cos, 2 * self.cfg.rope_dim, chunks)

    # The pieces of a forward, shared by the eager loop above and the CUDA-graph runner (decode_graphs.py), which
    # captures everything between two attention calls as one graph.

    def embed_tokens(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens, positions: [T] long on the device -> residual stream x [T, d] (a fresh tensor, updated in place by
        post_attention on CUDA) and cos, sin [T, 1, R] gathered once from the RoPE table for every layer."""
        cs = self.rope.table[positions][:, :, None, :]  # [T, 2, 1, R]
        if isinstance(self.embed, QuantLinear):
            x = self.embed.rows(tokens)
        elif isinstance(self.embed, GpuQuantLinear):
            x = self.embed.rows(tokens, self.dtype)
        else:
            x = F.embedding(tokens, self.embed)
        return x, cs[:, 0], cs[:, 1]

    def pre_attention(
        self, lw: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norm, q/k/v projection and RoPE: x [T, d] -> q [T, Hq, D], k, v [T, Hkv, D] (views of one qkv buffer)."""
        cfg = self.cfg
        hq, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        n_tok = x.shape[0]
        rotated = False
        if lw.native is not None and n_tok <= PREFILL_ROWS and self._rope_rows(cos, sin):
            qkv = lw.native.qkv(x, cos)  # [T, (Hq + 2 Hkv) D], normed, biased and rotated in one native call
            rotated = True
        elif self._one_row(x):  # the q rows may still be in L2 from the early query: read last here
            qkv = self._row_product(x, lw.attn_norm, lw.wqkv, lw.bqkv, cos, sin, (hq + hkv) * d, "evict_first")
            rotated = self._gemv_rope  # [1, (Hq + 2 Hkv) D]
        else:
            qkv = linear(self._norm(x, lw.attn_norm), lw.wqkv, lw.bqkv)  # [T, (Hq + 2 Hkv) D]
        qk, v = qkv.split(((hq + hkv) * d, hkv * d), dim=-1)  # views of qkv
        qk = qk.view(n_tok, hq + hkv, d)  # [T, Hq + Hkv, D]: q and k rotate together
        if not rotated:
            self.rope.apply_(qk, cos, sin)
        q, k = qk.split((hq, hkv), dim=1)  # [T, Hq, D], [T, Hkv, D]
        return q, k, v.view(n_tok, hkv, d)

    def _rope_rows(self, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Whether cos, sin [T, 1, R] are the halves of contiguous table rows [T, 2, R] (embed_tokens' gather), the
        layout the native layer reads (each row: cos then sin)."""
        r = self.cfg.rope_dim
        return (cos.stride(0) == 2 * r and cos.stride(-1) == 1 and sin.data_ptr() == cos.data_ptr() + 4 * r
                and cos.dtype == torch.float32)

    def query_ahead(self, lw: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """A layer's query from a residual stream x [T, d] other than its own input: norm, the q rows of the qkv
        projection, RoPE -> q [T, Hq, D]. Given the stream after the previous layer's attention (before its MLP),
        this predicts the layer's query one MLP early (device_graph.py's early block choice)."""
        cfg = self.cfg
        n_q = cfg.n_heads * cfg.head_dim
        bias = lw.bqkv[:n_q] if lw.bqkv is not None else None
        if isinstance(lw.wqkv, GpuQuantLinear):
            q = lw.wqkv.head(n_q)(self._norm(x, lw.attn_norm), bias).view(x.shape[0], cfg.n_heads, cfg.head_dim)
            self.rope.apply_(q, cos, sin)
            return q
        assert isinstance(lw.wqkv, torch.Tensor) and not lw.wqkv.is_mkldnn, "no q rows to slice"
        if self._one_row(x):  # evict_last: the layer's q/k/v product reads these rows again after the MLP
            q = self._row_product(x, lw.attn_norm, lw.wqkv[:n_q], bias, cos, sin, n_q, "evict_last")
            q = q.view(1, cfg.n_heads, cfg.head_dim)
            if not self._gemv_rope:
                self.rope.apply_(q, cos, sin)
            return q
        q = linear(self._norm(x, lw.attn_norm), lw.wqkv[:n_q], bias).view(x.shape[0], cfg.n_heads, cfg.head_dim)
        self.rope.apply_(q, cos, sin)
        return q

    def post_attention(self, lw: LayerWeights, x: torch.Tensor, o: torch.Tensor,
                       after_attention: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Output projection and MLP with both residual adds: x [T, d], o [T, Hq, D] -> the new x (the same tensor,
        updated in place, except with oneDNN-packed weights on the CPU). after_attention(x) is called between the
        two, with the stream after the attention's residual add (read it before the MLP's add changes it)."""
        o = o.reshape(x.shape[0], -1)  # [T, Hq D]
        if self.quantized and not self.native_quant:
            return self._post_attention_gpu_quant(lw, x, o, after_attention)
        if lw.native is not None and after_attention is None and x.shape[0] <= PREFILL_ROWS and x.is_contiguous():
            lw.native.out_mlp(x, o.contiguous())  # output product, MLP and both residual adds in one native call
            return x
        one_row = self._one_row(o) and x.is_contiguous()
        if one_row:
            gemv_kernels.gemv_add_(x, o, lw.wo, evict=self._evict("evict_first"), **self._gemv_opts)  # x += o @ wo^T
        elif lw.wo_t is None and lw.wo_packed is None:  # quantized
            x += linear(o, lw.wo)
        elif lw.wo_packed is None:
            x.addmm_(o, lw.wo_t)  # x += o @ wo^T in the matmul itself
        else:
            x = torch.ops.mkldnn._linear_pointwise.binary(o, x, lw.wo_packed, None, "add")  # x + o @ wo^T
        if after_attention is not None:
            after_attention(x)
        if one_row:  # gate, up and silu * mul in one kernel (with _gemv_norm the norm too), then the down product
            h, norm = self._row_norm(x, lw.ffn_norm)
            act = gemv_kernels.gemv_silu_mul(h, lw.w_gate_up, norm=norm, evict=self._evict("evict_first"),
                                             **self._gemv_opts)  # [1, F]
            gemv_kernels.gemv_add_(x, act, lw.w_down, evict=self._evict("evict_first"),
                                   **self._gemv_opts)  # x += act @ w_down^T
            return x
        h = self._norm(x, lw.ffn_norm)
        gate_up = linear(h, lw.w_gate_up)  # [T, 2F]
        if self._dense_kernels:  # one kernel instead of two (dense_kernels.py)
            act = dense_kernels.silu_mul(gate_up)  # [T, F]
        else:
            gate, up = gate_up.chunk(2, dim=-1)  # [T, F] views
            act = F.silu(gate).mul_(up)  # [T, F]
        if isinstance(lw.w_down, QuantLinear):
            x += linear(act, lw.w_down)
        elif lw.w_down_t is not None:
            x.addmm_(act, lw.w_down_t)
        else:
            x = torch.ops.mkldnn._linear_pointwise.binary(act, x, lw.w_down, None, "add")
        return x

    def _post_attention_gpu_quant(self, lw: LayerWeights, x: torch.Tensor, o: torch.Tensor,
                                  after_attention: Callable[[torch.Tensor], None] | None) -> torch.Tensor:
        """post_attention with weights in their blocks on the GPU: x [T, d] updated in place; decode rows in three
        launches besides the norm (output product with its residual add, gate/up with silu * up, down with its
        residual add). A matrix the file stores as F16 / BF16 / F32 is a plain tensor here and takes a matmul."""
        _add_product_(x, o, lw.wo)  # x += o @ wo^T
        if after_attention is not None:
            after_attention(x)
        h = self._norm(x, lw.ffn_norm)
        if isinstance(lw.w_gate_up, GpuQuantLinear):
            act = lw.w_gate_up.silu_mul(h)  # [T, F]
        else:
            gate, up = linear(h, lw.w_gate_up).chunk(2, dim=-1)  # [T, F] views
            act = F.silu(gate).mul_(up)
        _add_product_(x, act, lw.w_down)  # x += act @ w_down^T
        return x

    def logits(self, x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """x [T, d] -> fp32 logits [R, V] for the rows asked for (None: every row)."""
        if rows is not None:
            x = x[rows]  # [R, d]: the vocabulary matmul only for the rows asked for
        if self._one_row(x):  # the vocabulary stored as fp32 by the kernel (the bf16-rounded values widened)
            h, norm = self._row_norm(x, self.output_norm)
            return gemv_kernels.gemv(h, self.output_mm, norm=norm, out_dtype=torch.float32,
                                     evict=self._evict("evict_first"), **self._gemv_opts)  # [1, V]
        h = self._norm(x, self.output_norm)
        if isinstance(self.output_mm, GpuQuantLinear):  # the fp32 sums stored as they are
            return self.output_mm(h, out_dtype=torch.float32)  # [R, V]
        return linear(h, self.output_mm).float()  # [R, V]
