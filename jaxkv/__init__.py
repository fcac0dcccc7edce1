"""jaxkv: a NaN-safe paged KV cache for LLM inference in JAX."""

__version__ = "0.1.0"
