"""The interface every ``pprun bench`` peer implements (:class:`Peer`), what it is given
(:class:`PeerJob`) and what it returns (:class:`PeerResult`).

A peer is one small class registered in ``pprun.apps.bench.peers.PEERS`` under the name ``peer=``
takes.  ``pprun bench`` calls :meth:`Peer.check` before pprun's engine starts (a peer that cannot
be there fails the run at once), times pprun, shuts pprun down and frees the device, then calls
:meth:`Peer.run` with the same requests (:class:`PeerJob`): the engines never run at once.  A peer
that cannot run this workload or configuration raises :class:`PeerSkipped` (the result says why,
the run still succeeds); one that fails while running raises :class:`PeerFailed`.  With
``batch_sizes``, :meth:`Peer.run_all` runs every row's job on one engine of the peer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from pprun.apps.bench.workloads import BenchRequest
from pprun.config.config import BenchAppConfig


class PeerSkipped(Exception):
    """The peer cannot run this workload or configuration; the message says why."""


class PeerFailed(Exception):
    """The peer started and failed; the message says how (enough to debug it in one read)."""


@dataclass
class PeerJob:
    """What a peer runs: pprun's workload and the settings pprun ran it with."""

    cfg: BenchAppConfig
    model_dir: str
    """The checkpoint pprun loaded (an alias resolved)."""
    device: str
    """pprun's device ("cuda", "cuda:1", "cpu")."""
    dtype: str
    """pprun's dtype ("bfloat16", "float32", ...)."""
    requests: list[BenchRequest]
    warmup: list[BenchRequest]
    """Run once before timing (the same requests pprun warmed up on)."""
    batch_size: int
    """pprun's ``scheduler.max_num_seqs``."""
    max_model_len: int
    """pprun's context length."""
    eos_token_ids: set[int]
    executor: str
    """pprun's executor ("uni", "mp", "ray", "external_launcher"), resolved."""
    pp_size: int
    """pprun's number of pipeline stages."""
    prefix_caching: bool
    """Whether pprun's engine cached prompt prefixes (``cache.enable_prefix_caching``, off for
    encoder-decoder models whatever the setting)."""
    max_num_batched_tokens: int
    """pprun's token budget per step, resolved (``scheduler.max_num_batched_tokens`` or the
    device's default)."""
    tp_size: int = 1
    """pprun's ``tensor_parallel_size`` (workers per stage)."""
    repeats: int = 1
    """Timed passes after the warm-up (``pprun bench``'s ``repeats``, resolved), summarised as
    pprun's are (``pprun.apps.bench.metrics.summarize_runs``)."""

    @property
    def ignore_eos(self) -> bool:
        """Generate every request's full length past EOS (``cfg.ignore_eos``)."""
        return self.cfg.ignore_eos


@dataclass
class PeerResult:
    """A peer's timed run: its metrics (the same names as pprun's where they mean the same) and
    each request's output token ids, in request order."""

    metrics: dict[str, Any]
    tokens: list[list[int]]


class Peer(Protocol):
    """One engine ``pprun bench`` times against pprun on the same workload."""

    name: str
    """The value of ``peer=`` that picks it."""

    def check(self, cfg: BenchAppConfig) -> None:
        """Before pprun's engine starts: raise (a ValueError or RuntimeError a user can act on,
        e.g. how to install the peer) when the peer cannot be there at all."""
        ...

    def run(self, job: PeerJob) -> PeerResult:
        """Warm up on ``job.warmup``, time ``job.requests``; raise :class:`PeerSkipped` or
        :class:`PeerFailed` when it cannot."""
        ...

    def run_all(self, jobs: list[PeerJob]) -> list[PeerOutcome]:
        """Each job in turn on one engine (loaded once; the jobs differ only in their requests, as
        the rows of ``batch_sizes`` do): each job's result, or the :class:`PeerSkipped` /
        :class:`PeerFailed` it met, in order.  :func:`run_each` does it job by job."""
        ...


PeerOutcome = PeerResult | PeerSkipped | PeerFailed
"""What a peer gives back for one job of :meth:`Peer.run_all`."""


def run_each(peer: Peer, jobs: list[PeerJob]) -> list[PeerOutcome]:
    """:meth:`Peer.run_all` by calling ``peer.run`` on each job (for a peer with nothing to share
    between them)."""
    outcomes: list[PeerOutcome] = []
    for job in jobs:
        try:
            outcomes.append(peer.run(job))
        except (PeerSkipped, PeerFailed) as e:
            outcomes.append(e)
    return outcomes

