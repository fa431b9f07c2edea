"""Environment switches that turn one fast path off (the A/B flags of the benchmarks).

Each module reads its switch once, at import, into a module-level bool that tests and
``scripts/gpu_speed.py --ab`` may flip; ``PPRUN_DISABLE_<NAME>=1`` (anything but empty or ``0``)
turns the path off for a whole process.
"""

from __future__ import annotations

import os


def enabled_unless(name: str) -> bool:
    """False when the environment variable ``name`` is set to anything but ``""`` or ``"0"``."""
    return os.environ.get(name, "") in ("", "0")
