"""What a process does once its start-up is over, before its first step."""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Move every object alive now (imported modules, the model, graphs) out of the garbage
    collector's reach.

    A full collection walks every tracked object: with torch, Triton and a model loaded that is
    over a hundred thousand objects and tens of milliseconds.  Steps allocate enough short-lived
    objects to trigger one every few dozen steps, and in a pipeline one stage stalled that long
    stalls every stage.  Objects made later are still collected as usual.
    """
    gc.collect()
    gc.freeze()
