"""kvlab: a lab bench for KV-cache eviction on real causal language models."""

__version__ = "0.3.0"
