"""``pprun serve``'s settings are checked once, before anything starts, into one
:class:`~pprun.serve.settings.ServeSettings` the server takes as it is; and the engine-level
request limits the Python API shares with every front end (``max_tokens`` against the context,
``model.max_logprobs``)."""

from __future__ import annotations

import pytest

from pprun import LLM
from pprun.config.config import ServeConfig
from pprun.sampling.params import SamplingParams

_SETTINGS_ONCE = """
import asyncio, io, json, sys
from contextlib import redirect_stdout
sys.path.insert(0, "tests")
from test_validate_once import count_calls
from pprun.config import exposure
from pprun.config.config import ServeAppConfig, ServeConfig
from pprun.config.validate import validate_config
from pprun.serve import layout, settings
from pprun.serve.server import serve

model_dir, token_file = sys.argv[1], sys.argv[2]
cfg = ServeAppConfig(serve=ServeConfig(port=0, http_port=0, engine_process=False, auth_token_file=token_file))
cfg.model.model, cfg.model.dtype, cfg.parallel.executor = model_dir, "float32", "uni"
stop = asyncio.Event()
stop.set()  # serve, then drain at once
checks = (ServeConfig.validate, settings.read_token, layout.check_servable, exposure.check_network_exposure,
          validate_config)
out = io.StringIO()
with count_calls(*checks) as counts, redirect_stdout(out):
    serve(cfg, stop=stop)
print(json.dumps({"serving": '"event": "serving"' in out.getvalue(), "counts": {str(k): v for k, v in counts.items()}}))
"""


def test_serve_checks_its_settings_once(tiny_llama_dir, tmp_path):
    """From ``serve(cfg)`` to serving (gRPC and HTTP) and back: every check runs once.  In a
    process of its own: this one may hold tritonclient's copy of the KServe messages, which
    pprun.serve.server's own copy would clash with in protobuf's default pool."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "token").write_text("t0ken\n")
    out = subprocess.run([sys.executable, "-c", _SETTINGS_ONCE, str(tiny_llama_dir), str(tmp_path / "token")],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["serving"]
    assert len(result["counts"]) == 5 and set(result["counts"].values()) == {1}, result["counts"]


def test_bad_serve_settings_name_themselves():
    for kwargs, message in [({"max_choices": 0}, r"serve.max_choices=0 is invalid: must be an integer >= 1"),
                            ({"max_stop_strings": True}, r"serve.max_stop_strings=True is invalid"),
                            ({"max_request_output_tokens": -5}, r"serve.max_request_output_tokens=-5 is invalid")]:
        with pytest.raises(ValueError, match=message):
            ServeConfig(**kwargs).validate()


def test_python_api_refuses_max_tokens_past_the_context_and_logprobs_past_max_logprobs(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), dtype="float32", max_model_len=32, max_logprobs=3) as llm:
        prompt = {"prompt_token_ids": list(range(1, 11))}
        with pytest.raises(ValueError, match=r"prompts\[0\]: SamplingParams.max_tokens=23 is invalid: the prompt has "
                                             r"10 tokens and max_model_len=32 leaves room for 22 output tokens"):
            llm.generate(prompt, SamplingParams(max_tokens=23))
        with pytest.raises(ValueError, match=r"SamplingParams.logprobs=4 is invalid: must be at most "
                                             r"model.max_logprobs=3"):
            llm.generate(prompt, SamplingParams(max_tokens=2, logprobs=4))
        # The opt-in to "as many as the context leaves": max_tokens=None.
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True, logprobs=3))
        assert len(out[0].outputs[0].token_ids) == 22 and out[0].outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match=r"model.max_logprobs=-1 is not allowed"):
        LLM(str(tiny_llama_dir), max_logprobs=-1)
