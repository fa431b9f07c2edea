"""What a process does once its start-up is over, before its first step."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


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


def in_background(fn: Callable[..., T], *args: Any) -> Callable[[], T]:
    """Start ``fn(*args)`` on a daemon thread; the returned function waits for its result (or
    re-raises its exception).

    For start-up work that waits on files and imports while the caller waits on other processes
    (the driver loads the tokenizer while Ray and the stage processes start)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, name=f"pprun-{getattr(fn, '__name__', 'start-up')}", daemon=True)
    thread.start()

    def result() -> T:
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

    return result
