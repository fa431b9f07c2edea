"""Send and receive tensor dicts between adjacent pipeline stages over ``torch.distributed``.

The tensors go on the device group (NCCL between GPUs, gloo on CPU) straight into the
receiver's persistent buffers.  Their metadata (keys, shapes, dtypes) travels once, before the
first send, on a CPU (gloo) group: the receiver checks keys, trailing shapes and dtypes against
its buffers and raises an error naming both sides instead of waiting for tensors that will
never fit.  After that a hop is the tensors alone (stacked into one message when they share a
shape and dtype) — both sides take the step's token count from
the same ``SchedulerOutput``, and what a stage's model sends (keys, dtypes, row widths) does not
change — and the sender checks each send against what it announced, so a change is an error on
the sending side rather than a hang on the receiving one.  A metadata message per hop would cost
about as much as a decode step's tensors (docs/performance.md, "Pipeline settings").  Every eager
wait is bounded by the process groups' timeout.

Decode steps replayed from CUDA graphs may carry the hop inside the graphs
(:meth:`PipelineTransport.send_in_graph` / :meth:`~PipelineTransport.recv_in_graph`, checked
against the announced metadata when captured).  A replayed NCCL operation is not watched by the
process group's timeout: if a neighbour dies mid-step the survivor's stream waits for good, and
it is the driver that notices the dead stage and kills the others.
"""

from __future__ import annotations

import dataclasses
import json
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from pprun.distributed import rendezvous
from pprun.distributed.intermediate import IntermediateTensors
from pprun.distributed.layout import StageLayout

META_BYTES = 1024
"""Size of the fixed metadata message that precedes the first send (keys, shapes, dtypes)."""
PACK_MAX_BYTES = 4 * 2**20
"""Largest hop sent stacked as one message (decode steps); larger ones (prefill) go tensor by
tensor: there the stack and unstack copies cost more than the saved operation
(docs/performance.md, "Pipeline settings")."""


class PipelineTransport:
    """Point-to-point channel of one stage to its neighbours.

    ``global_ranks[i]`` is the ``torch.distributed`` rank of pipeline stage ``i`` (the identity
    for pprun's own executors; torchrun jobs may place stages differently).
    """

    def __init__(
        self,
        layout: StageLayout,
        device: torch.device,
        cpu_group: dist.ProcessGroup | None,
        device_group: dist.ProcessGroup | None,
        global_ranks: list[int],
        feedback_group: dist.ProcessGroup | None = None,
        feedback_host: str | None = None,
        timeout_s: float = 600.0,
        authkey: bytes | None = None,
    ) -> None:
        self.layout = layout
        self.device = device
        self.cpu_group = cpu_group
        self.device_group = device_group
        self.global_ranks = global_ranks
        self.feedback_group = feedback_group
        """First and last stage only, on gloo (host to host): the sampled ids of async pipeline
        steps (``pprun.distributed.feedback``); None where the transport was not made here."""
        self.feedback_host = feedback_host
        """Where the first stage may listen for the sampled ids' socket: the process group's
        rendezvous host, which pprun's executors put on the first stage's own host (None: the
        ids stay on :attr:`feedback_group`)."""
        self.timeout_s = timeout_s
        """The process groups' timeout, in seconds."""
        self.authkey = authkey
        """The run's secret: the sampled-ids socket's ends authenticate each other with it (None:
        no socket, the ids stay on :attr:`feedback_group`)."""
        self._meta_out = torch.zeros(META_BYTES, dtype=torch.uint8)
        self._meta_in = torch.zeros(META_BYTES, dtype=torch.uint8)
        self._announced: list[tuple[str, tuple[int, ...], str]] | None = None
        """(key, trailing shape, dtype) of every tensor, as sent in the one metadata message."""
        self._expected_keys: list[str] | None = None
        """The keys the previous stage announced, in its send order."""
        self._stack_out = False
        """Whether this stage's tensors go stacked (see :func:`_packable`; up to PACK_MAX_BYTES)."""
        self._stacked_in: torch.Tensor | None = None
        """Landing buffer of the previous stage's stacked hops (None when they never stack)."""
        self._store: rendezvous.RendezvousStore | None = None
        """The authenticated rendezvous store the groups were made with (``pprun://``), kept
        referenced while torch holds its C++ half; None for other rendezvous."""

    @classmethod
    def init(
        cls,
        layout: StageLayout,
        device: torch.device,
        init_method: str,
        timeout_s: float,
        feedback: bool = False,
        feedback_host: str | None = None,
        authkey: bytes | None = None,
    ) -> PipelineTransport:
        """Join a fresh world of ``layout.world_size`` ranks (pprun's own executors) and make the
        pipelines' groups (``pprun.distributed.groups``); with ``feedback`` (every rank passes the
        same) also the first and last stage's gloo group.  ``feedback_host``: where the first
        stage listens for the sampled ids' socket (default: the host of a ``tcp://``
        rendezvous); ``authkey``: the run's secret, which that socket needs (without it the ids
        stay on gloo).  A worker with tp > 1 makes its stage's tp group after this
        (``groups.tensor_parallel_group``), in the same order on every rank."""
        from pprun.distributed import groups

        store = groups.init_world(layout, device, init_method, timeout_s, authkey)
        mine = groups.pipeline_groups(layout, device, timeout_s, feedback=feedback)
        host = feedback_host
        if host is None and init_method.startswith(("tcp://", rendezvous.SCHEME)):
            host = urlsplit(init_method).hostname
        if authkey is None:
            host = None
        transport = cls(
            layout, device, mine.cpu_group, mine.device_group, layout.pipeline_ranks, mine.feedback_group, host,
            timeout_s, authkey,
        )
        transport._store = store
        return transport

    @classmethod
    def from_existing(cls, layout: StageLayout, device: torch.device, timeout_s: float) -> PipelineTransport:
        """Use an already initialised default group of ``layout.world_size`` ranks (torchrun);
        makes the pipelines' groups (a collective: every rank calls it)."""
        from pprun.distributed import groups

        mine = groups.pipeline_groups(layout, device, timeout_s)
        return cls(layout, device, mine.cpu_group, mine.device_group, layout.pipeline_ranks, timeout_s=timeout_s)

    # --- point to point ------------------------------------------------------------------------

    def send(self, tensors: IntermediateTensors) -> None:
        """Send to the next stage: the tensors, preceded on the first send by their metadata."""
        dst = self.global_ranks[self.layout.pp_rank + 1]
        signature = _signature(tensors)
        if self._announced is None:
            # JSON, not pickle: the gloo pairs do not authenticate their peer (docs/failures.md).
            meta = json.dumps([(k, list(v.shape), str(v.dtype)) for k, v in tensors.items()]).encode()
            if len(meta) > META_BYTES - 4:
                raise ValueError(f"intermediate tensor metadata is {len(meta)} bytes; at most {META_BYTES - 4}")
            # One fixed-size message: its length first, then the JSON (one send, not two).
            self._meta_out[:4] = torch.tensor([len(meta)], dtype=torch.int32).view(torch.uint8)
            self._meta_out[4 : 4 + len(meta)] = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
            dist.send(self._meta_out, dst, group=self.cpu_group)
            self._announced = signature
            self._stack_out = _packable(signature)
        elif signature != self._announced:
            raise ValueError(
                f"stage {self.layout.pp_rank}: intermediate tensors changed after the first send: "
                f"now (key, trailing shape, dtype) = {signature}, announced {self._announced}; stage "
                f"{self.layout.pp_rank + 1} learns them once, from the first send"
            )
        values = list(tensors.values())
        if self._stack_out and len(values) * values[0].numel() * values[0].element_size() <= PACK_MAX_BYTES:
            # One message instead of one per tensor: a point-to-point op costs far more host time
            # in torch.distributed than the stack of a decode step's rows.
            dist.send(torch.stack(values), dst, group=self.device_group)
            return
        for v in values:
            dist.send(v.contiguous(), dst, group=self.device_group)

    def recv(self, buffers: IntermediateTensors, num_tokens: int) -> IntermediateTensors:
        """Receive from the previous stage into ``buffers[:num_tokens]`` (persistent buffers);
        the first call also receives and checks the metadata."""
        src = self.global_ranks[self.layout.pp_rank - 1]
        if self._expected_keys is None:
            dist.recv(self._meta_in, src, group=self.cpu_group)
            size = int(self._meta_in[:4].view(torch.int32).item())
            if not 0 < size <= META_BYTES - 4:
                raise ValueError(
                    f"stage {self.layout.pp_rank}: malformed intermediate-tensor metadata from stage "
                    f"{self.layout.pp_rank - 1} (length {size}; expected 1..{META_BYTES - 4})"
                )
            meta = _parse_metadata(self._meta_in[4 : 4 + size].numpy().tobytes(), self.layout.pp_rank)
            check_received_metadata(meta, buffers, num_tokens, self.layout.pp_rank)
            self._expected_keys = [key for key, _, _ in meta]
            if _packable([(k, tuple(shape[1:]), dtype) for k, shape, dtype in meta]):
                # The landing buffer of stacked hops: as large as one can be.
                first = buffers[self._expected_keys[0]]
                self._stacked_in = torch.empty(
                    PACK_MAX_BYTES // first.element_size(), dtype=first.dtype, device=first.device
                )
        view = buffers[:num_tokens]
        keys = self._expected_keys
        first = view[keys[0]]
        stacked_numel = len(keys) * first.numel()
        if self._stacked_in is not None and stacked_numel <= self._stacked_in.numel():
            stacked = self._stacked_in[:stacked_numel].view(len(keys), *first.shape)
            dist.recv(stacked, src, group=self.device_group)
            for i, key in enumerate(keys):
                view[key].copy_(stacked[i])
            return view
        for key in keys:
            dist.recv(view[key], src, group=self.device_group)
        return view

    def send_payload(self, tensor: torch.Tensor) -> None:
        """Send one tensor whose shape and dtype the next stage derives from the step itself (an
        encoder-decoder model's encoder output for the requests the step brings in): no
        metadata; before the step's intermediate tensors, on the device group."""
        dist.send(tensor.contiguous(), self.global_ranks[self.layout.pp_rank + 1], group=self.device_group)

    def recv_payload(self, buffer: torch.Tensor) -> torch.Tensor:
        """Receive what the previous stage sent with :meth:`send_payload` into ``buffer``."""
        dist.recv(buffer, self.global_ranks[self.layout.pp_rank - 1], group=self.device_group)
        return buffer

    # --- hops captured in CUDA graphs ---------------------------------------------------------

    def agree(self, mine: object) -> bool:
        """True when every stage passed an equal ``mine`` (a collective on the CPU group: every
        stage must call it).  Stages decide together whether their decode graphs carry the hop,
        since one stage sending inside a graph while its neighbour receives outside would hang."""
        mine_bytes = _encode_plain(mine)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.layout.pp_size)]
        dist.all_gather(sizes, torch.tensor([len(mine_bytes)], dtype=torch.int64), group=self.cpu_group)
        width = max(int(s) for s in sizes)
        out = torch.zeros(width, dtype=torch.uint8)
        out[: len(mine_bytes)] = torch.frombuffer(bytearray(mine_bytes), dtype=torch.uint8)
        gathered = [torch.zeros(width, dtype=torch.uint8) for _ in range(self.layout.pp_size)]
        dist.all_gather(gathered, out, group=self.cpu_group)
        return all(g[: int(s)].numpy().tobytes() == mine_bytes for g, s in zip(gathered, sizes))

    def warm_up(self, sample: IntermediateTensors | None, buffers: IntermediateTensors | None) -> None:
        """One real hop of one token down the pipeline before any graph is captured: the
        receiver checks the metadata, and NCCL opens the pair's connection (which cannot happen
        inside a capture).  ``sample``: what this stage sends (None on the last stage);
        ``buffers``: where it receives (None on the first)."""
        if not self.layout.is_first:
            self.recv(buffers, 1)
        if not self.layout.is_last:
            self.send(sample[:1])

    def send_in_graph(self, tensors: IntermediateTensors) -> None:
        """Send inside a CUDA-graph capture: the graph replays the send (one message per tensor,
        straight from the graph's outputs: no host work at replay, so no need to stack).

        The tensors must match what :meth:`warm_up` announced, key by key in the announced
        order (the receiver lands each message in the buffer of the key it expects there):
        checked here, at capture, since a replay checks nothing.
        """
        signature = _signature(tensors)
        if self._announced is None or signature != self._announced:
            raise ValueError(
                f"stage {self.layout.pp_rank}: a graph-captured send of (key, trailing shape, dtype) = "
                f"{signature} does not match what was announced ({self._announced}); warm_up must send "
                "what the model's forward returns, in its order"
            )
        dst = self.global_ranks[self.layout.pp_rank + 1]
        for v in tensors.values():
            if not v.is_contiguous():
                raise ValueError(f"stage {self.layout.pp_rank}: a graph-captured send needs contiguous tensors")
            dist.send(v, dst, group=self.device_group)

    def recv_in_graph(self, buffers: IntermediateTensors) -> None:
        """Receive inside a CUDA-graph capture, straight into the graph's input buffers, in the
        order :meth:`send_in_graph` sends (the keys the previous stage announced in
        :meth:`warm_up`, which must come first)."""
        if self._expected_keys is None:
            raise RuntimeError(
                f"stage {self.layout.pp_rank}: recv_in_graph before any metadata arrived (call warm_up first)"
            )
        src = self.global_ranks[self.layout.pp_rank - 1]
        for key in self._expected_keys:
            dist.recv(buffers[key], src, group=self.device_group)

    def broadcast_object(self, obj: object, src_stage: int) -> object:
        """Broadcast ``obj`` from stage ``src_stage`` to every stage of this pipeline (CPU group),
        as :func:`broadcast_plain` does."""
        return broadcast_plain(obj, self.global_ranks[src_stage], self.cpu_group)

    def close(self) -> None:
        """Tear the process group down (pprun's own executors only)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._store is not None:
            self._store.close()
            self._store = None


def broadcast_plain(obj: object, src: int, group: dist.ProcessGroup) -> object:
    """Broadcast ``obj`` from global rank ``src`` to every rank of ``group`` (a gloo group), encoded
    as JSON (:func:`_encode_plain`: plain values and pprun's output dataclasses), never pickled —
    the gloo pairs do not authenticate their peer."""
    is_src = dist.get_rank() == src
    data = _encode_plain(obj) if is_src else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if is_src else torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return obj if is_src else _decode_plain(buf.numpy().tobytes())


def _plain_types() -> dict[str, type]:
    """The dataclasses :func:`_decode_plain` may build (by name): pprun's step outputs only."""
    from pprun.core.outputs import Logprobs, ModelRunnerOutput

    return {cls.__name__: cls for cls in (ModelRunnerOutput, Logprobs)}


def _to_plain(obj: object) -> object:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        name = type(obj).__name__
        if name not in _plain_types():
            raise TypeError(f"{name} cannot cross the CPU group (only {sorted(_plain_types())} can)")
        return {"__dataclass__": name, **{f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): _to_plain(v) for k, v in obj.items()}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if hasattr(obj, "tolist") and hasattr(obj, "dtype"):  # NumPy values and host tensors of ids
        return obj.tolist()
    raise TypeError(f"a {type(obj).__name__} cannot cross the CPU group as JSON")


def _from_plain(obj: object) -> object:
    if isinstance(obj, list):
        return [_from_plain(v) for v in obj]
    if isinstance(obj, dict):
        fields = {k: _from_plain(v) for k, v in obj.items() if k != "__dataclass__"}
        name = obj.get("__dataclass__")
        if name is None:
            return fields
        cls = _plain_types().get(name)
        if cls is None:
            raise ValueError(f"a message on the CPU group names an unknown type {name!r}")
        return cls(**fields)
    return obj


def _encode_plain(obj: object) -> bytes:
    """JSON bytes of ``obj`` (plain values, lists, dicts with string keys, the dataclasses of
    :func:`_plain_types`): what goes between stages on a group whose peers are not authenticated."""
    return json.dumps(_to_plain(obj), separators=(",", ":")).encode()


def _decode_plain(data: bytes) -> object:
    """The object :func:`_encode_plain` encoded (tuples come back as lists)."""
    return _from_plain(json.loads(data))


def _parse_metadata(data: bytes, pp_rank: int) -> list[tuple[str, tuple[int, ...], str]]:
    """The previous stage's metadata message: [(key, shape, dtype)], or a clear error."""
    try:
        meta = [(str(k), tuple(int(d) for d in shape), str(dtype)) for k, shape, dtype in json.loads(data)]
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"stage {pp_rank}: malformed intermediate-tensor metadata from stage {pp_rank - 1}: {e}"
        ) from None
    return meta


def _signature(tensors: IntermediateTensors) -> list[tuple[str, tuple[int, ...], str]]:
    """(key, trailing shape, dtype) of every tensor, in send order: what a hop must keep."""
    return [(k, tuple(v.shape[1:]), str(v.dtype)) for k, v in tensors.items()]


def _packable(signature: list[tuple[str, tuple[int, ...], str]]) -> bool:
    """Several tensors of one trailing shape and dtype travel stacked, as one message (say a
    model that sends its hidden states and residual apart; the Llama family sends one tensor);
    both sides decide from the announced signature, so they agree."""
    return len(signature) > 1 and len({(shape, dtype) for _, shape, dtype in signature}) == 1


def check_received_metadata(
    meta: list[tuple[str, tuple[int, ...], str]],
    buffers: IntermediateTensors,
    num_tokens: int,
    pp_rank: int,
) -> None:
    """Raise a clear error when what the previous stage sends cannot land in our buffers."""
    sent_keys = [m[0] for m in meta]
    if sorted(sent_keys) != sorted(buffers):
        raise ValueError(
            f"stage {pp_rank}: intermediate tensor keys differ: stage {pp_rank - 1} sent "
            f"{sorted(sent_keys)}, stage {pp_rank} expects {sorted(buffers)} (from "
            "make_empty_intermediate_tensors)"
        )
    for key, shape, dtype in meta:
        buf = buffers[key]
        want = (num_tokens, *buf.shape[1:])
        if tuple(shape) != want or dtype != str(buf.dtype):
            raise ValueError(
                f"stage {pp_rank}: intermediate tensor {key!r} from stage {pp_rank - 1} has "
                f"shape {tuple(shape)} and dtype {dtype}; stage {pp_rank} expects {want} and "
                f"{buf.dtype}"
            )
