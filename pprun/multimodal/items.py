"""One multimodal item of a request and where it sits in the prompt (plain data, no torch).

A request may carry several items (images, audio clips).  Each owns a *placeholder range* of the
prompt, ``(offset, length, is_embed)``: the ``length`` prompt tokens from ``offset`` on belong to
the item, and ``is_embed`` says which of them take one of the encoder's output rows (``None``:
all of them).  A Pixtral image, for instance, keeps ``[IMG_BREAK]``/``[IMG_END]`` text tokens
inside its range, so its mask is ``False`` there.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class PlaceholderRange:
    """Where an item's tokens sit in the prompt."""

    offset: int
    """First prompt position of the range."""
    length: int
    """Number of prompt positions in the range."""
    is_embed: tuple[bool, ...] | None = None
    """Per position of the range: whether it takes an encoder output row (None: every one)."""

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 1:
            raise ValueError(f"PlaceholderRange(offset={self.offset}, length={self.length}) is invalid: "
                             "offset must be >= 0 and length >= 1")
        if self.is_embed is not None and len(self.is_embed) != self.length:
            raise ValueError(f"PlaceholderRange.is_embed has {len(self.is_embed)} entries for length={self.length}")

    @property
    def end(self) -> int:
        """One past the range's last prompt position."""
        return self.offset + self.length

    @property
    def num_embeds(self) -> int:
        """Encoder output rows the item contributes (True entries of ``is_embed``)."""
        return self.length if self.is_embed is None else sum(self.is_embed)


@dataclass
class MultiModalItem:
    """One image (or audio clip, ...) of a request, processed and ready for its encoder."""

    modality: str
    """``"image"``, ``"audio"``, ..."""
    content_hash: str
    """Hash of the processed content: two equal items share one encoder output."""
    placeholder: PlaceholderRange
    """The item's range in the prompt (after the prompt's placeholder token was expanded)."""
    data: dict[str, Any] | None = field(default=None, repr=False)
    """The processed tensors the encoder reads (``pixel_values``, ``image_sizes``, ...).  Only the
    first pipeline stage gets them (:func:`without_payload`)."""
    num_encoder_positions: int = 0
    """Encoder output positions computed for an item that reaches the decoder through
    cross-attention instead of embedding rows (a Whisper window: ``max_source_positions``); what
    it costs of a step's encoder budget (``pprun.multimodal.encoder_budget.encoder_cost``)."""

    @property
    def num_embeds(self) -> int:
        """Encoder output rows of this item."""
        return self.placeholder.num_embeds

    def without_payload(self) -> MultiModalItem:
        """The same item without its tensors (what stages after the first receive)."""
        return self if self.data is None else replace(self, data=None)
