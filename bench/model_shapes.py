"""The model shapes the speed benchmarks build with random weights (bench/tpot.py) or write as GGUF
(bench/llamacpp_peer.py): the exact dimensions of Llama-3.1-8B and Qwen2.5-7B, and `tiny` for CPU smoke runs."""

SHAPES = {
    "llama3.1-8b": dict(arch="llama", n_layers=32, d_model=4096, d_ff=14336, n_heads=32, n_kv_heads=8, head_dim=128,
                        vocab_size=128256, rope_theta=500000.0, rope_style="interleaved", qkv_bias=False),
    "qwen2.5-7b": dict(arch="qwen2", n_layers=28, d_model=3584, d_ff=18944, n_heads=28, n_kv_heads=4, head_dim=128,
                       vocab_size=152064, rope_theta=1000000.0, rope_style="neox", qkv_bias=True),
    "tiny": dict(arch="llama", n_layers=4, d_model=512, d_ff=1024, n_heads=8, n_kv_heads=2, head_dim=64,
                 vocab_size=1000, rope_theta=10000.0, rope_style="interleaved", qkv_bias=False),
}
