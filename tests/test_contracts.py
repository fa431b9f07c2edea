"""DESIGN.md contracts 1 and 2 through the real runners (V1 and V2), one regression test each."""

from __future__ import annotations

import pytest
import torch

from pprun import LLM, SamplingParams
from pprun.models.llama import LlamaForCausalLM
from pprun.worker import model_loader

SEEN: list[dict] = []


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
        assert llm.describe()["runner"] == "v2"
        assert llm.describe()["runner_fallback_reasons"] == []
    assert torch is not None
