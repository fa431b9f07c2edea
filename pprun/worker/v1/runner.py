"""The V1 ("legacy") model runner: eager, inputs rebuilt from the SchedulerOutput every step.

Simple on purpose: per-request state in Python objects, inputs built with Python loops.  It
works with every executor, including SPMD torchrun ranks at pp > 1 (docs/design.md contract 5).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pprun.attention.metadata import AttentionMetadata, count_leading_decodes
from pprun.core.outputs import ModelRunnerOutput, SchedulerOutput
from pprun.distributed.intermediate import IntermediateTensors
from pprun.distributed.layout import StageLayout
from pprun.models.base import PprunModel
from pprun.sampling.params import SamplingParams
from pprun.sampling.sampler import Sampler, SamplingTensors, make_generator, suppress_tokens, to_logprobs
from pprun.worker.encoder_decoder import EncoderDecoderState
from pprun.worker.model_inputs import build_model_inputs, uses_inputs_embeds
from pprun.worker.runner_base import ModelRunner, StepResult


@dataclass
class RequestState:
    """What a runner remembers about one request between steps."""

    req_id: str
    token_ids: list[int]
    """Prompt and every output token the runner has been told about."""
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    num_prompt_tokens: int = 0
    """Tokens of the original prompt (its first output is sampled at this length)."""
    draws_to_skip: int = 0
    """A resumed seeded request's earlier outputs: draws its new generator skips at its next
    sampling step (``SamplingTensors.skip_draws``)."""


class V1ModelRunner(ModelRunner):
    """Eager runner for one stage."""

    name = "v1"

    def __init__(
        self,
        model: PprunModel,
        layout: StageLayout,
        device: torch.device,
        block_size: int,
        encoder_decoder: EncoderDecoderState | None = None,
        max_model_len: int | None = None,
    ) -> None:
        """``max_model_len``: every step's block table is ``ceil(max_model_len / block_size)``
        wide, as V2's is, so that the decode kernel's split count (from the table's width) depends
        on the step's row count only and the engine's warm-up can meet every one
        (``pprun.engine.warmup.eager_decode_rows``); None: as wide as the step's longest request."""
        self.table_width = -(-max_model_len // block_size) if max_model_len is not None else 0
        self.model = model
        self.encoder_decoder = encoder_decoder
        """``pprun.worker.encoder_decoder.EncoderDecoderState`` of an encoder-decoder model."""
        self.layout = layout
        self.device = device
        self.block_size = block_size
        self.requests: dict[str, RequestState] = {}
        self.sampler = Sampler()
        self.mm = None
        """First stage of a multimodal model: items, encoder cache, embeddings scatter (the V2
        runner's plug-in does the same through ``MultiModalModelState``)."""
        if layout.is_first and uses_inputs_embeds(model):
            from pprun.worker.multimodal import MultiModalRunnerState

            self.mm = MultiModalRunnerState(model)

    def update_states(self, so: SchedulerOutput) -> None:
        """Apply the step's deltas: drop finished requests, add new ones, extend cached ones."""
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            if self.mm is not None:
                self.mm.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            if self.mm is not None:
                self.mm.add_request(new.req_id, new.mm_items)
            num_prompt_tokens = new.num_prompt_tokens if new.num_prompt_tokens is not None else len(new.prompt_token_ids)
            gen = make_generator(new.sampling_params.seed, self.device) if self.layout.samples else None
            self.requests[new.req_id] = RequestState(
                new.req_id,
                list(new.prompt_token_ids),
                list(new.block_ids),
                new.num_computed_tokens,
                new.sampling_params,
                gen,
                num_prompt_tokens,
                # A resumed request's prompt holds its outputs so far: its stream goes on after them.
                len(new.prompt_token_ids) - num_prompt_tokens if gen is not None else 0,
            )
        c = so.scheduled_cached_reqs
        for i, req_id in enumerate(c.req_ids):
            st = self.requests[req_id]
            st.block_ids.extend(c.new_block_ids[i])
            st.token_ids.extend(c.new_token_ids[i])
            st.num_computed_tokens = c.num_computed_tokens[i]
        if self.mm is not None:
            self.mm.apply_step(so)

    def prepare_inputs(self, so: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Token ids, positions, attention metadata and each request's last-token row."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start_loc = [0]
        tables: list[list[int]] = []
        last_rows: list[int] = []
        bs = self.block_size
        for req_id, n in so.num_scheduled_tokens.items():
            st = self.requests[req_id]
            start = st.num_computed_tokens
            end = start + n
            input_ids.extend(st.token_ids[start:end])
            for pos in range(start, end):
                positions.append(pos)
                slots.append(st.block_ids[pos // bs] * bs + pos % bs)
            seq_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + n)
            tables.append(st.block_ids)
            last_rows.append(query_start_loc[-1] - 1)
        max_blocks = max(self.table_width, max(len(t) for t in tables))
        table = torch.zeros((len(tables), max_blocks), dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        num_reqs, num_tokens = len(seq_lens), len(input_ids)
        dev = self.device
        counts = list(so.num_scheduled_tokens.values())
        meta = AttentionMetadata(
            num_reqs=num_reqs,
            num_reqs_padded=num_reqs,
            num_tokens=num_tokens,
            num_tokens_padded=num_tokens,
            max_query_len=max(counts),
            num_leading_decodes=count_leading_decodes(counts),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_table=table.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        )
        if self.encoder_decoder is not None:
            meta.cross = self.encoder_decoder.fill(list(so.num_scheduled_tokens), num_reqs)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        return ids, pos_t, meta, last_rows

    @torch.inference_mode()
    def execute_model(
        self,
        so: SchedulerOutput,
        intermediate_tensors: IntermediateTensors | None = None,
        receive: Callable[[], IntermediateTensors] | None = None,
    ) -> StepResult:
        """Run one step; non-last stages return what to send, the last its sampled tokens.

        ``receive`` (non-first stages, instead of ``intermediate_tensors``) is called once the
        step's inputs are on the device, to get the previous stage's tensors.
        """
        self.update_states(so)
        if self.encoder_decoder is not None:
            self.encoder_decoder.begin_step(so)
        if so.is_empty():
            return StepResult(ModelRunnerOutput(so.step_id, [], [])) if self.layout.samples else StepResult()
        ids, positions, meta, last_rows = self.prepare_inputs(so)
        if receive is not None:
            intermediate_tensors = receive()
        inputs_embeds = None
        if self.mm is not None:
            from pprun.multimodal.mask import StepWindow

            inputs_embeds = self.model.embed_input_ids(ids)
            windows, start = [], 0
            for req_id, n in so.num_scheduled_tokens.items():
                windows.append(StepWindow(start, self.requests[req_id].num_computed_tokens, n))
                start += n
            self.mm.scatter(inputs_embeds, list(so.num_scheduled_tokens), windows)
        inputs = build_model_inputs(
            self.model,
            is_first_stage=self.layout.is_first,
            input_ids=ids,
            positions=positions,
            intermediate_tensors=intermediate_tensors,
            attn_metadata=meta,
            inputs_embeds=inputs_embeds,
        )
        out = self.model(**inputs)
        if not self.layout.is_last:
            return StepResult(to_send=out)
        return StepResult(self.sample(so, out, last_rows))

    def sample(self, so: SchedulerOutput, hidden: torch.Tensor, last_rows: list[int]) -> ModelRunnerOutput | None:
        """Sample for each request whose scheduled tokens reach the end of what it knows.

        With tensor parallelism every tp rank of the last stage computes the logits (the LM
        head's gather is a collective of the group) and only tp rank 0 samples and answers
        (None elsewhere)."""
        req_ids = list(so.num_scheduled_tokens)
        rows, states = [], []
        for i, req_id in enumerate(req_ids):
            st = self.requests[req_id]
            if st.num_computed_tokens + so.num_scheduled_tokens[req_id] == len(st.token_ids):
                rows.append(last_rows[i])
                states.append(st)
        if not self.layout.samples and not rows:
            return None
        sampled: dict[str, list[int]] = {r: [] for r in req_ids}
        logprobs_by_req: dict[str, object] = {}
        if rows:
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
            if not self.layout.samples:
                return None
            params = [s.sampling_params for s in states]
            logits = suppress_tokens(logits, params, [len(s.token_ids) == s.num_prompt_tokens for s in states])
            t = SamplingTensors.build(params, [s.generator for s in states], self.device)
            if any(s.draws_to_skip for s in states):
                t.skip_draws = [s.draws_to_skip for s in states]
                for s in states:
                    s.draws_to_skip = 0
            res = self.sampler(logits, t)
            token_ids = res.sampled_token_ids.tolist()
            lps = to_logprobs(res, [p.logprobs for p in params])
            for st, tok, lp in zip(states, token_ids, lps):
                sampled[st.req_id] = [tok]
                logprobs_by_req[st.req_id] = lp
        return ModelRunnerOutput(
            step_id=so.step_id,
            req_ids=req_ids,
            sampled_token_ids=[sampled[r] for r in req_ids],
            logprobs=[logprobs_by_req.get(r) for r in req_ids],
        )
