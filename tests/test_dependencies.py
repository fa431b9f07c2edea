"""pprun at run time needs none of the packages that only the ``dev`` and ``test`` extras bring.

``grpcio-tools`` (the ``dev`` extra) only regenerates ``pprun/serve/_proto``; ``tritonclient``
(the ``test`` extra) is only the serve tests' client. Here they are made unimportable in every
process a ``pprun serve`` starts (a ``sitecustomize`` module on ``PYTHONPATH`` sets their
``sys.modules`` entries to None), and the server still starts, answers and streams the offline
engine's tokens.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from serve_helpers import ServerProcess

from pprun import LLM
from pprun.sampling.params import SamplingParams
from pprun.serve._proto.pprun.v1 import pprun_pb2 as pb
from pprun.serve._proto.pprun.v1 import pprun_pb2_grpc as pb_grpc

NOT_AT_RUN_TIME = ("grpc_tools", "tritonclient")
"""Top-level modules of the dev and test extras' packages that no run-time path may import (not
pytest or hypothesis: some libraries read ``"pytest" in sys.modules`` as "under test", and a None
entry would say so)."""

BLOCKER = f"""
import sys

# None in sys.modules is how Python spells "not installed" to both `import` (ModuleNotFoundError)
# and importlib.util.find_spec (None), so optional-import checks see the package as absent.
for name in {NOT_AT_RUN_TIME!r}:
    sys.modules[name] = None
"""

PROMPT = [3, 14, 15, 92, 65]
MAX_TOKENS = 6


@pytest.fixture
def without_dev_packages(tmp_path: Path, monkeypatch) -> dict[str, str]:
    """``PYTHONPATH`` with the blocking ``sitecustomize`` first, set for processes started in the test."""
    blocker_dir = tmp_path / "blocker"
    blocker_dir.mkdir()
    (blocker_dir / "sitecustomize.py").write_text(BLOCKER)
    path = os.pathsep.join(p for p in (str(blocker_dir), os.environ.get("PYTHONPATH")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
    return dict(os.environ)


def test_blocker_refuses_the_dev_packages(without_dev_packages):
    """The environment the server test uses cannot import any of them (else that test proves nothing)."""
    for module in NOT_AT_RUN_TIME:
        proc = subprocess.run([sys.executable, "-c", f"import {module}"], env=without_dev_packages,
                              capture_output=True, text=True)  # fmt: skip
        assert proc.returncode != 0 and "None in sys.modules" in proc.stderr, (module, proc.stderr)


def test_serve_runs_without_dev_packages(without_dev_packages, tiny_llama_dir, tmp_path):
    """``pprun serve`` (engine in its own process) starts, reports its model and streams the tokens
    ``LLM.generate`` gives offline, with grpc_tools and tritonclient unimportable."""
    with LLM(str(tiny_llama_dir), dtype="float32") as llm:
        (offline,) = llm.generate([{"prompt_token_ids": PROMPT}],
                                  SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    server = ServerProcess(tmp_path, [f"model.model={tiny_llama_dir}", "model.dtype=float32", "parallel=single"])
    try:
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=PROMPT),
            sampling=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        )
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.PprunStub(ch)
            assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).model == server.info["model"]
            responses = list(stub.Generate(request, timeout=60))
        assert [t for r in responses for t in r.token_ids] == offline.outputs[0].token_ids
        assert responses[-1].final.finish_reason == "length"
        assert server.terminate() == 0, server.log()[-3000:]
    finally:
        server.kill()
    assert "None in sys.modules" not in server.log()
