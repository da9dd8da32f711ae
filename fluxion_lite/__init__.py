"""fluxion-lite: LLM inference with hybrid CPU-GPU sparse attention over host-memory KV caches."""
__version__ = "0.1.0"
