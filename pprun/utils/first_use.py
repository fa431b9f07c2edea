"""The first-use record: every variant a process compiles, captures, loads or runs for the first
time, as a key, and which of them came after the engine said it was ready.

A *key* is a short string naming one variant, its kind first:

* ``triton: <kernel>[<specialisation>]`` -- a Triton kernel compiled (or loaded from Triton's disk
  cache) for a new specialisation, seen through Triton's JIT hook (:func:`watch_triton`);
* ``cuda graph: <mode> <size>`` -- a CUDA graph captured (``pprun.worker.v2.cuda_graphs``);
* ``sampler: <branch>`` -- a branch of the sampler run for the first time (the runner, from the
  step's sampling flags: greedy argmax, temperature, top-k, the top-k/top-p sort, min-p, seeded
  draws, logprobs, suppression);
* ``step: <kind> <tokens> tokens <requests> requests`` -- a step of a new class
  (:func:`step_class_key`, from the ``SchedulerOutput``, in the engine);
* ``request: <feature>`` -- what a new request makes a step use (the step watchdog's request
  features: sampler variants, encoder, cached prefix).

Before :meth:`FirstUse.mark_ready` keys are the warm-up's (``pprun.engine.warmup``); after it
each new key is counted in :attr:`FirstUse.after_ready` and logged once as a warning, since the
step that met it paid for it.  :meth:`FirstUse.drain` hands the keys recorded since its last call
to whoever reports them (a stage's keys travel to the engine with its step output).

One record per object that owns it (the engine's, each worker's); the only process-wide state
is the listener set of Triton's hook, which is process-wide itself.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

EXACT_UP_TO = 32
"""Token and request counts up to this are classes of their own: decode-sized matmuls pick their
kernel (and Triton its specialisation) by the exact row count (``pprun.layers.skinny``)."""


def count_class(n: int) -> str:
    """The class of a token or request count that selects kernels and specialisations: the count
    itself up to :data:`EXACT_UP_TO`; above, its power-of-two bucket and whether it is a multiple
    of 16 (Triton specialises integer arguments on divisibility by 16), e.g. ``"<=128/16"`` and
    ``"<=128"``."""
    if n <= EXACT_UP_TO:
        return str(n)
    bucket = 1 << (n - 1).bit_length()
    return f"<={bucket}/16" if n % 16 == 0 else f"<={bucket}"


def count_class_top(n: int) -> int:
    """The count a choice for ``n`` should be made from so that it is the same across ``n``'s
    class (:func:`count_class`): ``n`` itself up to :data:`EXACT_UP_TO`, else the top of its
    power-of-two bucket.  A kernel, tile or path picked from this (a tuned table's nearest entry,
    a threshold on the count) is one of the few the warm-up's one count per class
    (:func:`count_class_representatives`) meets; picked from ``n`` itself, a threshold inside a
    bucket (a tuned entry at 256 and the next at 2,048 switch at their geometric mean, 724) splits
    the class, and the counts on the far side of the split meet their variant first in traffic."""
    return n if n <= EXACT_UP_TO else 1 << (n - 1).bit_length()


def count_class_representatives(limit: int) -> list[int]:
    """One count per class of :func:`count_class` for counts ``1..limit``: the largest of each
    class, ascending (what a warm-up runs to meet every class)."""
    reps: dict[str, int] = {}
    for n in range(1, min(limit, EXACT_UP_TO) + 1):
        reps[str(n)] = n
    bucket = 2 * EXACT_UP_TO
    while bucket // 2 < limit:
        top = min(bucket, limit)
        # The largest multiple of 16 and the largest other count in (bucket/2, top].
        for n in (top - top % 16, top if top % 16 else top - 1):
            if n > bucket // 2:
                reps.setdefault(count_class(n), n)
        bucket *= 2
    return sorted(reps.values())


def step_class_key(kind: str, num_tokens: int, num_reqs: int) -> str:
    """The first-use key of a step's class: its kind (``decode``, ``prefill`` or ``mixed``) and
    the classes of its token and request counts (:func:`count_class`)."""
    return f"step: {kind} {count_class(num_tokens)} tokens {count_class(num_reqs)} requests"


@dataclass(eq=False)  # hashable by identity: the Triton hook keeps its listeners in a WeakSet
class FirstUse:
    """The keys one owner has met, in order, and which came after :meth:`mark_ready`."""

    name: str = "engine"
    """Whose record this is (in the warning of a key met after ready)."""
    seen: set[str] = field(default_factory=set)
    """Every key recorded so far."""
    ready: bool = False
    """Set by :meth:`mark_ready`: from then on a new key is a first use the warm-up missed."""
    after_ready: list[str] = field(default_factory=list)
    """Keys first met after :meth:`mark_ready`, in order."""
    _undrained: list[str] = field(default_factory=list, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    """Triton may compile on another thread (its hook then records from there)."""

    def record(self, key: str, log: bool = True) -> bool:
        """Note ``key``; True when it is new (after ready also logged, unless ``log`` is False:
        its owner logged it already)."""
        if key in self.seen:
            return False
        with self._lock:
            if key in self.seen:
                return False
            self.seen.add(key)
            self._undrained.append(key)
            if self.ready:
                self.after_ready.append(key)
        if self.ready and log:
            logger.warning("%s: first use after ready: %s", self.name, key)
        return True

    @property
    def has_new(self) -> bool:
        """Whether keys were recorded since the previous :meth:`drain` (no lock: a hint)."""
        return bool(self._undrained)

    def add(self, keys: tuple[str, ...] | list[str]) -> list[str]:
        """Record keys another record drained and logged (a stage's, arriving with its output);
        the new ones."""
        return [k for k in keys if self.record(k, log=False)]

    def drain(self) -> tuple[str, ...]:
        """The keys recorded since the previous call, oldest first."""
        if not self._undrained:
            return ()
        with self._lock:
            keys, self._undrained = tuple(self._undrained), []
        return keys

    def mark_ready(self) -> None:
        """The warm-up is over: every key from now on is counted and logged."""
        self.ready = True
        self.drain()

    def snapshot(self) -> dict[str, object]:
        """Counts and the keys met after ready (tests, metrics, ``scripts/serve_warm_check.py``)."""
        return {
            "name": self.name,
            "ready": self.ready,
            "num_keys": len(self.seen),
            "num_after_ready": len(self.after_ready),
            "after_ready": list(self.after_ready),
        }


_triton_listeners: weakref.WeakSet[FirstUse] = weakref.WeakSet()
_triton_lock = threading.Lock()
_triton_hooked = False


def _triton_key(fn: object, compile: dict) -> str:
    """``triton: name[constexprs; specialisation]`` for one compile (stable within a process)."""
    name = getattr(fn, "name", "?")
    key = compile.get("key")
    # key = (dtypes and specialisation per argument, ..., options); its repr names the variant.
    return f"triton: {name}{key!r}"


def watch_triton(record: FirstUse) -> bool:
    """Send every Triton compile (a cache miss of a kernel's in-memory variants: a compile or a
    load from Triton's disk cache) from now on to ``record`` as a ``triton:`` key.  Installs one
    hook per process, chained after any hook already set; False when Triton is absent or has no
    such hook (nothing is recorded then)."""
    global _triton_hooked
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        return False
    with _triton_lock:
        _triton_listeners.add(record)
        if not _triton_hooked:
            previous = runtime.jit_cache_hook

            def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 (Triton's names)
                name = _triton_key(fn, compile)
                for listener in list(_triton_listeners):
                    listener.record(name)
                if previous is not None:
                    return previous(key=key, repr=repr, fn=fn, compile=compile,
                                    is_manual_warmup=is_manual_warmup, already_compiled=already_compiled)  # fmt: skip
                return None

            runtime.jit_cache_hook = hook
            _triton_hooked = True
    return True
