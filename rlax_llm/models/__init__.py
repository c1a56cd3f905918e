"""Decoder models, KV cache and tokenizers."""
