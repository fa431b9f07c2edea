"""Attention over a paged KV cache: metadata, a reference backend and a Triton backend."""
