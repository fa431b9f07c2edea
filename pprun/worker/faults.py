"""Faults injected into a stage, for tests of failure handling (not a product setting).

The hook is the environment variable ``PPRUN_TEST_FAULTS``: JSON mapping a stage rank to its
faults, e.g. ``{"1": {"raise_at_step": 3}}``.  The driver reads it when it builds its executor
(:func:`stage_faults`), and each stage's ``WorkerSpec`` carries its entry to wherever the stage
runs (in process, a local process, a Ray actor); on a torchrun job every rank reads it itself.
Tests set it through the ``inject_faults`` fixture (``tests/conftest.py``).

A stage's faults (any combination):

- ``raise_at_step``: int k, the stage raises at its k-th step (counted from 1);
- ``delay_s``: float d, the stage sleeps d seconds at the start of every step;
- ``rename_sent_keys``: true, a non-last stage sends its intermediate tensors under wrong
  names (the receiver must refuse them with an error, not hang);
- ``kill_at_step``: int k, the stage process SIGKILLs itself at the start of its k-th step (its
  neighbours may be waiting in a hop from or to it; a stage in its own process only);
- ``stop_at_step``: int k, the stage process SIGSTOPs itself at the start of its k-th step (it
  stops answering without dying; a stage in its own process only).
"""

from __future__ import annotations

import json
import os

ENV = "PPRUN_TEST_FAULTS"
"""The environment variable holding the faults (see the module docstring)."""
FAULTS = {"raise_at_step": int, "delay_s": (int, float), "rename_sent_keys": bool, "kill_at_step": int,
          "stop_at_step": int}
"""Each fault a stage accepts, and the type of its value."""


def stage_faults(rank: int) -> dict[str, object] | None:
    """The faults ``PPRUN_TEST_FAULTS`` injects into stage ``rank`` (None: none, the normal case).

    Raises ValueError naming the variable when it is not JSON of the documented form."""
    text = os.environ.get(ENV, "")
    if not text.strip():
        return None
    try:
        by_rank = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{ENV}={text!r} is not JSON ({e}); expected e.g. {{\"1\": {{\"raise_at_step\": 3}}}}") from e
    if not isinstance(by_rank, dict):
        raise ValueError(f"{ENV}={text!r} must be a JSON object of stage rank -> faults")
    faults = by_rank.get(str(rank))
    if faults is None:
        return None
    if not isinstance(faults, dict):
        raise ValueError(f"{ENV}: stage {rank}'s faults must be an object, got {faults!r}")
    for name, value in faults.items():
        kind = FAULTS.get(name)
        if kind is None:
            raise ValueError(f"{ENV}: unknown fault {name!r} for stage {rank}; allowed: {sorted(FAULTS)}")
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{ENV}: fault {name}={value!r} for stage {rank} has the wrong type")
    return faults
