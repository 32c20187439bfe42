"""kvmesh: LLM serving with prefill/decode disaggregation and a cluster-wide KV cache."""
__version__ = "0.1.0"
