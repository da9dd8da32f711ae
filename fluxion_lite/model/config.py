"""Model hyper-parameters read from GGUF metadata."""
from dataclasses import dataclass
from typing import Literal

RopeStyle = Literal["interleaved", "neox"]


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "qwen2"
    n_layers: int
    d_model: int
    d_ff: int
    n_heads: int  # query heads (Hq)
    n_kv_heads: int  # key/value heads (Hkv); Hq % Hkv == 0 (GQA)
    head_dim: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_theta: float
    rope_dim: int  # leading dims of each head that rotate (== head_dim for our architectures)
    # llama.cpp's converter permutes llama Q/K weights so adjacent pairs rotate ("normal" rope);
    # qwen2 keeps HF's half-split pairing ("neox").
    rope_style: RopeStyle
    rope_scaling: str = "none"  # "none" | "linear"
    rope_scale: float = 1.0  # positions are divided by this under linear scaling
    qkv_bias: bool = False
    tied_embeddings: bool = False

    @property
    def gqa_ratio(self) -> int:
        return self.n_heads // self.n_kv_heads

    def kv_bytes_per_token(self, bytes_per_elem: int) -> int:
        """Bytes of K and V for one token across all layers."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * bytes_per_elem
