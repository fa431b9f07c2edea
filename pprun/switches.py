"""Debugging switches: environment variables that turn one fast path off (``docs/switches.md``).

Each fast path is on by default and gives the same tokens as its plain path; a switch exists
where turning the fast path off is how one tells whether it is at fault (a wrong token, a hang,
a crash inside a kernel) or measures what it saves (``scripts/gpu_speed.py --ab``).
``PPRUN_DISABLE_<NAME>=1`` (anything but empty or ``0``) turns the path off for a whole process;
its module reads the variable once, at import, into a module-level bool.

:data:`SWITCHES` names every switch and the bool it sets; ``enabled_unless`` refuses a name not
listed there, so the list (and ``docs/switches.md``, which a test checks against it) stays whole.
Tests flip a switch through the ``switch`` fixture (``tests/conftest.py``), which goes through
:data:`SWITCHES` too.
"""

from __future__ import annotations

import os

SWITCHES: dict[str, str] = {
    "PPRUN_DISABLE_FUSED": "pprun.layers.FUSED_ENABLED",
    "PPRUN_DISABLE_FUSED_DECODE": "pprun.layers.FUSED_DECODE_ENABLED",
    "PPRUN_DISABLE_SKINNY_GEMM": "pprun.layers.SKINNY_ENABLED",
    "PPRUN_DISABLE_NORM_FOLD": "pprun.layers.NORM_FOLD_ENABLED",
    "PPRUN_DISABLE_FP8_SKINNY": "pprun.layers.FP8_SKINNY_ENABLED",
    "PPRUN_DISABLE_DEFER_MERGE": "pprun.layers.DEFER_MERGE_ENABLED",
    "PPRUN_DISABLE_PDL": "pprun.kernels.triton_utils.PDL_ENABLED",
    "PPRUN_DISABLE_GRAPH_LOGITS": "pprun.worker.v2.runner.GRAPH_LOGITS_ENABLED",
    "PPRUN_DISABLE_CROSS_DECODE_KERNEL": "pprun.attention.cross.CROSS_DECODE_KERNEL_ENABLED",
    "PPRUN_DISABLE_STAGING_KERNEL": "pprun.worker.v2.inputs.STAGING_KERNEL_ENABLED",
    "PPRUN_DISABLE_FAST_LAUNCH": "pprun.worker.v2.staging.FAST_LAUNCH_ENABLED",
    "PPRUN_DISABLE_GRAPH_HOP": "pprun.distributed.pipeline.GRAPH_HOP_ENABLED",
    "PPRUN_DISABLE_FEEDBACK_SOCKET": "pprun.distributed.feedback.SOCKET_ENABLED",
    "PPRUN_DISABLE_FEEDBACK_SPIN": "pprun.distributed.feedback.SPIN_ENABLED",
    "PPRUN_DISABLE_EARLY_ANSWER": "pprun.executor.remote.EARLY_ANSWER",
    "PPRUN_DISABLE_FP8_BLOCK_GEMM": "pprun.layers.fp8_linear.BLOCK_GEMM_ENABLED",
    "PPRUN_DISABLE_FP8_MOE": "pprun.layers.moe.FP8_EXPERTS_ENABLED",
}
"""Every switch: environment variable -> ``module.BOOL`` it sets (True unless the variable is set)."""


def enabled_unless(name: str) -> bool:
    """False when the environment variable ``name`` is set to anything but ``""`` or ``"0"``.

    ``name`` must be one of :data:`SWITCHES` (a switch nobody documented is a bug)."""
    if name not in SWITCHES:
        raise KeyError(f"{name} is not a registered switch; add it to pprun.switches.SWITCHES and docs/switches.md")
    return os.environ.get(name, "") in ("", "0")
