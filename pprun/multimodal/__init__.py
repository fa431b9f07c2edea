"""Multimodal inputs (images, audio), the request side: items and their placeholder ranges
(``items``), processing (``processing``), the scheduler's encoder budget (``encoder_budget``) and
the batch mask (``mask``).

Modality-agnostic and torch-free at this level (the scheduler imports it); processing imports
torch itself.  What the runners keep on the first stage (items, the encoder cache, the scatter
into a step's embeddings) is runner-side code under ``pprun.worker`` (``pprun.worker.multimodal``
and the V2 plug-in ``pprun.worker.v2.multimodal_state``).
"""
