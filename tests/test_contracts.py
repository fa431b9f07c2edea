"""docs/design.md contracts 1 and 2 through the real runners (V1 and V2), one regression test each."""

from __future__ import annotations

import pytest
import torch

from pprun import LLM, SamplingParams
from pprun.distributed.intermediate import IntermediateTensors
from pprun.models.llama import LlamaForCausalLM
from pprun.worker import model_loader

SEEN: list[dict] = []
MADE: list[tuple[int, IntermediateTensors]] = []
"""(stage, buffers) of every ``make_empty_intermediate_tensors`` call of a StageRecordingModel."""


class EmbedsModel(LlamaForCausalLM):
    """Computes inputs_embeds on the first stage (like a multimodal model); records its inputs."""

    supports_multimodal = True

    def forward(self, input_ids, positions, inputs_embeds, intermediate_tensors, attn_metadata):
        SEEN.append({"input_ids": input_ids, "inputs_embeds": inputs_embeds, "it": intermediate_tensors})
        return super().forward(input_ids, positions, inputs_embeds, intermediate_tensors, attn_metadata)


class RawTokensModel(EmbedsModel):
    requires_raw_input_tokens = True


class NoDefaultsModel(LlamaForCausalLM):
    """``intermediate_tensors`` without a default, in an unusual position: the runner must pass
    every contract key by name, ``intermediate_tensors=None`` included, on the only stage."""

    def forward(self, positions, intermediate_tensors, input_ids, inputs_embeds, attn_metadata):
        SEEN.append({"it": intermediate_tensors})
        return super().forward(input_ids, positions, inputs_embeds, intermediate_tensors, attn_metadata)


class StageRecordingModel(LlamaForCausalLM):
    """Records, per stage, the receive buffers it makes and what its forward gets and returns."""

    def make_empty_intermediate_tensors(self, num_tokens, dtype, device):
        made = super().make_empty_intermediate_tensors(num_tokens, dtype, device)
        MADE.append((self.layout.pp_rank, made))
        return made

    def forward(self, input_ids, positions, inputs_embeds, intermediate_tensors, attn_metadata):
        seen = {"rank": self.layout.pp_rank, "input_ids": input_ids, "inputs_embeds": inputs_embeds,
                "it": intermediate_tensors}
        if intermediate_tensors is not None:  # the values now: the buffers are rewritten next step
            seen["it_values"] = {k: v.clone() for k, v in intermediate_tensors.items()}
        out = super().forward(input_ids, positions, inputs_embeds, intermediate_tensors, attn_metadata)
        if isinstance(out, IntermediateTensors):
            seen["out"] = {k: v.clone() for k, v in out.items()}
        SEEN.append(seen)
        return out


class TwoStagesInProcess:
    """Stage 0 then stage 1 of a pipeline, both real ``Worker``s in this process: what the test
    harness ``drive`` calls as if it were one runner."""

    def __init__(self, workers) -> None:
        self.workers = workers

    def execute_model(self, so, intermediate_tensors=None):
        from pprun.worker.runner_base import StepResult

        assert intermediate_tensors is None
        assert self.workers[0].execute_model(so) is None  # it sent its output down the pipeline
        return StepResult(self.workers[1].execute_model(so))


def run_with(monkeypatch, model_cls, model_dir, runner):
    monkeypatch.setitem(model_loader.MODEL_CLASSES, "LlamaForCausalLM", model_cls)
    SEEN.clear()
    with LLM(str(model_dir), runner=runner, executor="uni", dtype="float32") as llm:
        out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(temperature=0, max_tokens=3))
    return out[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def reference_tokens(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), runner="v1", executor="uni", dtype="float32") as llm:
        out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(temperature=0, max_tokens=3))
    return out[0].outputs[0].token_ids


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_inputs_embeds_drop_input_ids_unless_declared(monkeypatch, tiny_llama_dir, reference_tokens, runner):
    assert run_with(monkeypatch, EmbedsModel, tiny_llama_dir, runner) == reference_tokens
    assert SEEN and all(s["inputs_embeds"] is not None and s["input_ids"] is None for s in SEEN)
    assert run_with(monkeypatch, RawTokensModel, tiny_llama_dir, runner) == reference_tokens
    assert SEEN and all(s["inputs_embeds"] is not None and s["input_ids"] is not None for s in SEEN)
    for s in SEEN:  # both describe the same tokens
        assert s["inputs_embeds"].shape[0] == s["input_ids"].shape[0]


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_forward_without_defaults_runs_as_the_only_stage(monkeypatch, tiny_llama_dir, reference_tokens, runner):
    assert run_with(monkeypatch, NoDefaultsModel, tiny_llama_dir, runner) == reference_tokens
    assert SEEN and all(s["it"] is None for s in SEEN)


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_non_first_stage_forward_gets_received_tensors_in_persistent_buffers(monkeypatch, tiny_llama_dir, runner):
    """Contract 2 through the real stage code: both stages of a 2-stage pipeline are real
    ``Worker``s (model load, KV cache, runner, ``PipelineTransport``) in this process; only the
    wire is fake (``torch.distributed.send``/``recv`` go through a queue).  On every step stage 1's
    forward gets ``input_ids=None``, ``inputs_embeds=None`` and the tensors stage 0 sent, in the
    buffers stage 1's model made with ``make_empty_intermediate_tensors`` (the same address every
    step); the tokens are those of one stage."""
    import torch.distributed as dist
    from test_v2_runner import build_runner, drive, prompts_of, resolved_for

    from pprun.distributed.layout import StageLayout
    from pprun.distributed.transport import PipelineTransport
    from pprun.worker.worker import Worker, WorkerSpec

    prompts, num_decode_steps = prompts_of([6, 3]), 3
    want, _ = drive(build_runner("v1", resolved_for(tiny_llama_dir, "cpu", "float32"))[0], prompts, num_decode_steps)

    wire: list[torch.Tensor] = []  # in flight from stage 0 to stage 1 (metadata, then tensors)
    monkeypatch.setattr(dist, "send", lambda t, dst, group=None: wire.append(t.clone()))
    monkeypatch.setattr(dist, "recv", lambda t, src, group=None: t.copy_(wire.pop(0).view(t.dtype).reshape(t.shape)))
    monkeypatch.setitem(model_loader.MODEL_CLASSES, "LlamaForCausalLM", StageRecordingModel)
    SEEN.clear()
    MADE.clear()
    rc = resolved_for(tiny_llama_dir, "cpu", "float32", pipeline_parallel_size=2, executor="mp")
    workers = []
    for rank in range(2):
        layout = StageLayout.from_partition(rc.layer_partition, rank)
        transport = PipelineTransport(layout, torch.device("cpu"), None, None, [0, 1])
        worker = Worker(WorkerSpec(rc, layout, runner), transport=transport)
        worker.load_model()
        worker.init_cache(64)
        assert worker.runner.name == runner
        workers.append(worker)
    got, _ = drive(TwoStagesInProcess(workers), prompts, num_decode_steps)
    assert got == want
    assert not wire  # stage 1 received everything stage 0 sent

    sent = [s["out"] for s in SEEN if s["rank"] == 0]
    stage1 = [s for s in SEEN if s["rank"] == 1]
    step_tokens = [sum(map(len, prompts))] + [len(prompts)] * num_decode_steps
    assert len(sent) == len(stage1) == len(step_tokens) >= 2
    assert not [m for rank, m in MADE if rank == 0]  # the first stage receives nothing
    made = {(k, m[k].data_ptr()) for rank, m in MADE if rank == 1 for k in m}
    assert made
    landed: dict[str, set[int]] = {}
    for step, (s, out, n) in enumerate(zip(stage1, sent, step_tokens)):
        assert s["input_ids"] is None, f"step {step}: stage 1's forward got input_ids"
        assert s["inputs_embeds"] is None, f"step {step}: stage 1's forward got inputs_embeds"
        it = s["it"]
        assert isinstance(it, IntermediateTensors) and sorted(it) == sorted(out), (step, it)
        for k, v in it.items():
            assert (k, v.data_ptr()) in made, f"step {step}: {k!r} is not in a make_empty_intermediate_tensors buffer"
            landed.setdefault(k, set()).add(v.data_ptr())
            assert v.shape[0] == n, (step, k, tuple(v.shape))
            assert torch.equal(s["it_values"][k], out[k]), f"step {step}: {k!r} differs from what stage 0 sent"
    assert all(len(ptrs) == 1 for ptrs in landed.values()), landed  # fixed addresses across steps


def test_v1_and_v2_identical_greedy(tiny_llama_dir):
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 5, 17, 40)]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    got = {}
    for runner in ("v1", "v2"):
        with LLM(str(tiny_llama_dir), runner=runner, dtype="float32", max_num_batched_tokens=24) as llm:
            got[runner] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
            assert llm.describe()["runner"] == runner
    assert got["v1"] == got["v2"]


def test_auto_runner_is_v2_and_reported(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), dtype="float32") as llm:
        d = llm.describe()
        assert d["runner"] == "v2" and d["runner_fallback_reasons"] == []
        # One stage in process: async scheduling, not async pipeline steps.
        assert d["async_scheduling"] is True and d["async_pipeline_steps"] is False
        # What is reported is what runs: the stage's runner is V2, and two steps are in flight.
        executor = llm.engine.executor
        assert executor.worker.runner_facts()["runner"] == "v2"
        assert executor.async_steps is True and executor.max_in_flight == 2


def test_every_model_class_implements_the_model_interface():
    """Every architecture the loader builds is a ``PprunModel`` with no method of the interface
    left abstract, and a class missing one cannot be built (the error names it)."""
    from pprun.models.base import PprunModel

    for name, cls in model_loader.MODEL_CLASSES.items():
        assert issubclass(cls, PprunModel), name
        assert not cls.__abstractmethods__, (name, sorted(cls.__abstractmethods__))

    class NoLogits(PprunModel):
        def forward(self, input_ids, positions, inputs_embeds, intermediate_tensors, attn_metadata):
            return positions

    with pytest.raises(TypeError, match="compute_logits"):
        NoLogits()


def test_v2_plugins_follow_the_declarations():
    """The V2 runner's registry maps declarations to plug-ins, first match first: a text-only
    decoder gets the plain ``ModelState``, Whisper (encoder-decoder) and Llava (multimodal)
    theirs, and a model declaring both takes the first entry's."""
    from pprun.worker.v2.encoder_decoder_state import EncoderDecoderModelState
    from pprun.worker.v2.model_state import ModelState
    from pprun.worker.v2.multimodal_state import MultiModalModelState
    from pprun.worker.v2.plugins import MODEL_STATES, model_state_class

    classes = model_loader.MODEL_CLASSES
    assert model_state_class(classes["LlamaForCausalLM"]) is ModelState
    assert model_state_class(classes["WhisperForConditionalGeneration"]) is EncoderDecoderModelState
    assert model_state_class(classes["LlavaForConditionalGeneration"]) is MultiModalModelState
    assert model_state_class(EmbedsModel) is MultiModalModelState  # declared on a Llama subclass
    both = type("Both", (LlamaForCausalLM,), {"is_encoder_decoder": True, "supports_multimodal": True})
    assert model_state_class(both) is MODEL_STATES[0][1]
