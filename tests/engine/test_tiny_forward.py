"""Full forwards of tiny random llama/qwen2 GGUF models against a float64 numpy reference written here.

The reference uses the weight values the fixture encoded (not the loader's output) and the architecture facts of the
GGUF format: RMSNorm, interleaved (llama) / half-split (qwen2) RoPE, causal GQA softmax attention, SwiGLU MLP. The engine
runs in fp32 through DenseAttention: one prefill, prefill in chunks of 7, two sequences packed in one forward, and
single-token decode steps after a prefill, all of which must give the same logits as the reference.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from fluxion_lite.model.attention import DenseAttention, SeqChunk
from fluxion_lite.model.gguf_loader import load_gguf
from fluxion_lite.model.transformer import Transformer
from fluxion_lite.offline.teacher_forcing import teacher_forced_logits
from gguf_fixtures import ALL_TYPES, TinySpec, write_tiny_model

SEQ_LEN = 40
REL_TOL = 1e-4  # max |engine - reference| / max |reference logit|; fp32 vs float64 lands near 1e-6


def _layer_types(q: str, k: str, v: str, o: str, gate: str, up: str, down: str, layer: int) -> dict[str, str]:
    p = f"blk.{layer}."
    return {p + "attn_q.weight": q, p + "attn_k.weight": k, p + "attn_v.weight": v, p + "attn_output.weight": o,
            p + "ffn_gate.weight": gate, p + "ffn_up.weight": up, p + "ffn_down.weight": down}


# K-quants sit on ffn_down, whose rows are d_ff (a multiple of 256) long; the 32-blocks fit every d_model used here.
SPECS = {
    "llama-gqa7-tied": TinySpec(
        arch="llama", n_heads=7, n_kv_heads=1, head_dim=32, d_ff=512, vocab=96, tied=True,
        types={"token_embd.weight": "Q8_0",
               **_layer_types("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "Q4_K", layer=0),
               **_layer_types("BF16", "F16", "F32", "Q8_0", "Q4_1", "Q5_0", "Q5_K", layer=1)}),
    "qwen2-gqa3-bias": TinySpec(
        arch="qwen2", n_heads=6, n_kv_heads=2, head_dim=32, d_ff=512, vocab=150, tied=False, qkv_bias=True,
        rope_theta=1e6, rms_eps=1e-6,
        types={"token_embd.weight": "F16", "output.weight": "Q5_1",
               **_layer_types("Q5_1", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "BF16", "Q6_K", layer=0),
               **_layer_types("Q4_1", "Q5_0", "Q5_1", "F16", "Q4_0", "Q8_0", "Q4_K", layer=1)}),
    "llama-mha-linear-rope": TinySpec(
        arch="llama", n_heads=3, n_kv_heads=3, head_dim=32, d_ff=256, vocab=64, tied=False,
        rope_linear_factor=2.0, write_rope_dim=True, rope_theta=500.0,
        types={"token_embd.weight": "BF16", "output.weight": "Q4_0",
               **_layer_types("Q8_0", "Q5_1", "Q4_1", "Q5_0", "F16", "Q4_0", "Q6_K", layer=0),
               **_layer_types("F32", "Q4_0", "Q8_0", "BF16", "Q5_1", "Q4_1", "Q5_K", layer=1)}),
    "qwen2-gqa4-hd16-tied": TinySpec(
        arch="qwen2", n_heads=4, n_kv_heads=1, head_dim=16, d_ff=256, vocab=200, tied=True, qkv_bias=True,
        types={"token_embd.weight": "Q4_1",
               **_layer_types("Q8_0", "Q4_0", "Q5_1", "Q5_0", "Q4_1", "Q8_0", "Q6_K", layer=0),
               **_layer_types("F16", "BF16", "Q4_0", "Q8_0", "Q5_0", "Q5_1", "Q4_K", layer=1)}),
}


def test_every_tensor_type_appears_in_a_forward() -> None:
    used = {t for spec in SPECS.values() for t in spec.types.values()}
    used.add("F32")  # norms (and biases) are F32 in every model
    assert used == set(ALL_TYPES)
    assert {s.n_heads // s.n_kv_heads for s in SPECS.values()} >= {1, 3, 7}


# ---------------------------------------------------------------- float64 reference


def rms_norm_ref(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope_ref(x: np.ndarray, positions: np.ndarray, spec: TinySpec) -> np.ndarray:
    """x: [T, H, D] -> rotated copy. llama: pairs (2i, 2i+1); qwen2: pairs (i, i + D/2)."""
    d = spec.head_dim
    inv_freq = spec.rope_theta ** (-2.0 * np.arange(d // 2) / d)  # [D/2]
    pos = positions.astype(np.float64) / (spec.rope_linear_factor or 1.0)
    angle = pos[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    out = np.empty_like(x)
    if spec.arch == "llama":
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
    else:
        a, b = x[..., : d // 2], x[..., d // 2 :]
        out[..., : d // 2], out[..., d // 2 :] = a * cos - b * sin, b * cos + a * sin
    return out


def reference_logits(spec: TinySpec, w: dict[str, np.ndarray], tokens: np.ndarray) -> np.ndarray:
    """float64 logits [T, V] at every position of one sequence starting at position 0."""
    t_len, hq, hkv, hd = len(tokens), spec.n_heads, spec.n_kv_heads, spec.head_dim
    group = hq // hkv
    positions = np.arange(t_len)
    causal = np.triu(np.ones((t_len, t_len), dtype=bool), k=1)  # True above the diagonal = future key
    x = w["token_embd.weight"][tokens]  # [T, d]
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        h = rms_norm_ref(x, w[p + "attn_norm.weight"], spec.rms_eps)
        q, k, v = (h @ w[p + f"attn_{n}.weight"].T for n in "qkv")
        if spec.qkv_bias:
            q, k, v = q + w[p + "attn_q.bias"], k + w[p + "attn_k.bias"], v + w[p + "attn_v.bias"]
        q = rope_ref(q.reshape(t_len, hq, hd), positions, spec)  # [T, Hq, D]
        k = rope_ref(k.reshape(t_len, hkv, hd), positions, spec)  # [T, Hkv, D]
        v = v.reshape(t_len, hkv, hd)
        o = np.empty_like(q)
        for head in range(hq):
            kv = head // group
            scores = q[:, head] @ k[:, kv].T / np.sqrt(hd)  # [T, T]
            scores[causal] = -np.inf
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            o[:, head] = probs @ v[:, kv]
        x = x + o.reshape(t_len, hq * hd) @ w[p + "attn_output.weight"].T
        h = rms_norm_ref(x, w[p + "ffn_norm.weight"], spec.rms_eps)
        gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
    x = rms_norm_ref(x, w["output_norm.weight"], spec.rms_eps)
    out = w["token_embd.weight"] if spec.tied else w["output.weight"]
    return x @ out.T


# ---------------------------------------------------------------- fixtures and comparison


@dataclass
class TinyCase:
    spec: TinySpec
    model: Transformer
    tokens: np.ndarray  # [SEQ_LEN]
    reference: np.ndarray  # [SEQ_LEN, V] float64
    other_tokens: np.ndarray  # [23] a second, shorter sequence
    other_reference: np.ndarray

    def fresh_attention(self) -> DenseAttention:
        cfg = self.model.cfg
        return DenseAttention(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module", params=list(SPECS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyCase:
    name: str = request.param
    spec = SPECS[name]
    path: Path = tmp_path_factory.mktemp("tiny") / f"{name}.gguf"
    weights = write_tiny_model(path, spec, seed=list(SPECS).index(name) + 10)
    model = Transformer(load_gguf(path, torch.float32), "cpu", torch.float32)
    rng = np.random.default_rng(123)
    tokens = rng.integers(0, spec.vocab, SEQ_LEN)
    other = rng.integers(0, spec.vocab, 23)
    ref, other_ref = reference_logits(spec, weights, tokens), reference_logits(spec, weights, other)
    # The fixture must be a model whose outputs depend on the inputs in a non-trivial way.
    assert ref.std(axis=-1).min() > 0.3, "logits nearly flat: the test would not discriminate"
    assert len(set(ref.argmax(-1).tolist())) >= 4, "argmax barely changes along the sequence"
    return TinyCase(spec, model, tokens, ref, other, other_ref)


def assert_matches(got: torch.Tensor, want: np.ndarray, what: str) -> None:
    got64 = got.double().numpy()
    assert got64.shape == want.shape, f"{what}: shape {got64.shape} != {want.shape}"
    scale = np.abs(want).max()
    rel = np.abs(got64 - want).max() / scale
    assert rel < REL_TOL, f"{what}: max |diff| / max |logit| = {rel:.2e}"
    # argmax must agree wherever the reference's top-two margin exceeds twice the observed error (only there is a
    # disagreement impossible for an engine this close)
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2 * max(rel, 1e-7) * scale
    assert clear.mean() >= 0.5, f"{what}: too many near-ties to check argmax"
    np.testing.assert_array_equal(got64.argmax(-1)[clear], want.argmax(-1)[clear], err_msg=what)


def run_forward(case: TinyCase, attn: DenseAttention, pieces: list[tuple[int, np.ndarray, int]]) -> torch.Tensor:
    """One packed forward: pieces = [(seq_id, tokens, start position)]. Returns logits at every packed row."""
    chunks = [SeqChunk(seq_id, start, len(toks)) for seq_id, toks, start in pieces]
    tokens = torch.tensor(np.concatenate([toks for _, toks, _ in pieces]))
    positions = torch.cat([torch.arange(start, start + len(toks)) for _, toks, start in pieces])
    return case.model.forward(tokens, positions, chunks, attn, logit_rows=torch.arange(len(tokens)))


# ---------------------------------------------------------------- tests


def test_config_matches_spec(case: TinyCase) -> None:
    cfg, spec = case.model.cfg, case.spec
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model) == (spec.n_heads, spec.n_kv_heads, spec.head_dim,
                                                                          spec.d_model)
    assert cfg.tied_embeddings == spec.tied and cfg.qkv_bias == spec.qkv_bias and cfg.vocab_size == spec.vocab


def test_single_prefill_matches_reference(case: TinyCase) -> None:
    attn = case.fresh_attention()
    attn.allocate(0)
    logits = run_forward(case, attn, [(0, case.tokens, 0)])
    assert_matches(logits, case.reference, "one prefill")
    assert attn.seq_len(0) == SEQ_LEN
    # default logit_rows: only the last token of the chunk
    attn2 = case.fresh_attention()
    attn2.allocate(5)
    last = case.model.forward(torch.tensor(case.tokens), torch.arange(SEQ_LEN), [SeqChunk(5, 0, SEQ_LEN)], attn2)
    assert_matches(last, case.reference[-1:], "last-row logits")


def test_chunked_prefill_matches_reference(case: TinyCase) -> None:
    logits = teacher_forced_logits(case.model, case.fresh_attention(), case.tokens.tolist(), chunk=7)
    assert_matches(logits, case.reference, "prefill in chunks of 7")


def test_chunked_prefill_last_row_only_matches_reference(case: TinyCase) -> None:
    # 40 tokens in chunks of 7 and 8: the last chunk is ragged (5) and full (8); only its last row comes back
    for chunk in (7, 8):
        logits = teacher_forced_logits(case.model, case.fresh_attention(), case.tokens.tolist(), chunk=chunk,
                                       last_row_only=True)
        assert logits.shape[0] == 1
        assert_matches(logits, case.reference[-1:], f"last row, chunks of {chunk}")


def test_two_sequences_packed_in_one_forward(case: TinyCase) -> None:
    attn = case.fresh_attention()
    attn.allocate(1)
    attn.allocate(2)
    logits = run_forward(case, attn, [(1, case.tokens, 0), (2, case.other_tokens, 0)])
    assert_matches(logits[:SEQ_LEN], case.reference, "packed sequence 1 (40 tokens)")
    assert_matches(logits[SEQ_LEN:], case.other_reference, "packed sequence 2 (23 tokens)")
    assert (attn.seq_len(1), attn.seq_len(2)) == (SEQ_LEN, len(case.other_tokens))


def test_decode_steps_after_prefill(case: TinyCase) -> None:
    """Prefill 25 / 10 tokens of two sequences, then decode both one token at a time in a shared batch, and finally a
    batch mixing one sequence's decode token with the other's prefill chunk."""
    attn = case.fresh_attention()
    a, b = case.tokens, case.other_tokens
    attn.allocate(7)
    attn.allocate(8)
    prefill = run_forward(case, attn, [(7, a[:25], 0), (8, b[:10], 0)])
    assert_matches(prefill[:25], case.reference[:25], "prefill A")
    assert_matches(prefill[25:], case.other_reference[:10], "prefill B")
    got_a, got_b = [], []
    for pos_b in range(10, 20):  # A: positions 25..34, B: 10..19, both in one 2-row batch per step
        pos_a = pos_b + 15
        step = run_forward(case, attn, [(7, a[pos_a : pos_a + 1], pos_a), (8, b[pos_b : pos_b + 1], pos_b)])
        got_a.append(step[0])
        got_b.append(step[1])
    assert_matches(torch.stack(got_a), case.reference[25:35], "decode A")
    assert_matches(torch.stack(got_b), case.other_reference[10:20], "decode B")
    # mixed batch: A decodes position 35 while B prefills its last 3 tokens
    mixed = run_forward(case, attn, [(7, a[35:36], 35), (8, b[20:23], 20)])
    assert_matches(mixed[:1], case.reference[35:36], "mixed batch, decode row")
    assert_matches(mixed[1:], case.other_reference[20:23], "mixed batch, prefill rows")
    # then A alone, one token at a time, to the end
    tail = torch.cat([run_forward(case, attn, [(7, a[p : p + 1], p)]) for p in range(36, SEQ_LEN)])
    assert_matches(tail, case.reference[36:], "decode A alone")
