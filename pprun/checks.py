"""Plain-Python value checks shared by the config validation, ``SamplingParams`` and the apps
(no torch import): an integer is an ``int`` but not a ``bool``, a number is finite."""

from __future__ import annotations

import math

SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
"""The seeds a torch generator takes (``torch.Generator.manual_seed``)."""


def is_int(value: object) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A finite ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_seed(value: object) -> bool:
    """An integer a torch generator takes as its seed (64 bits)."""
    return is_int(value) and SEED_MIN <= value <= SEED_MAX
