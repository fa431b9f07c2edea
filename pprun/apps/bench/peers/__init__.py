"""The engines ``pprun bench`` compares pprun with, keyed by the name ``peer=`` takes (as SGLang's
``bench_serving`` keys its backends): ``hf`` (transformers' ``generate``), ``vllm`` (vLLM's
offline engine, in its own process), ``none``.  Adding a peer is one class implementing
:class:`~pprun.apps.bench.peers.base.Peer` and one line here."""

from __future__ import annotations

from pprun.apps.bench.peers.base import (
    Peer,
    PeerFailed,
    PeerJob,
    PeerOutcome,
    PeerResult,
    PeerSkipped,
    run_each,
)
from pprun.apps.bench.peers.hf_peer import TransformersPeer
from pprun.apps.bench.peers.vllm_peer import VllmPeer

PEERS: dict[str, Peer | None] = {"hf": TransformersPeer(), "vllm": VllmPeer(), "none": None}
"""``peer=`` value -> the peer (None: no peer, pprun alone)."""

__all__ = [
    "PEERS", "Peer", "PeerFailed", "PeerJob", "PeerOutcome", "PeerResult", "PeerSkipped", "TransformersPeer", "VllmPeer",
    "run_each",
]  # fmt: skip
