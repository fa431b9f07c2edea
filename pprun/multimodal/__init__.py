"""Multimodal inputs (images, audio): request items, their placeholder ranges, the batch mask.

Modality-agnostic and torch-free at this level (the scheduler imports it); processing and the
runner-side encoder cache live in submodules that import torch themselves.
"""
