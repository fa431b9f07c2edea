"""pprun at run time needs none of the packages that only the ``dev`` and ``test`` extras bring.

``grpcio-tools`` (the ``dev`` extra) only regenerates ``pprun/serve/_proto``; the test tools
(``tritonclient``, ``hypothesis``, ``pytest``) only drive the suite. Here they are made
unimportable in every process a ``pprun serve`` starts (a ``sitecustomize`` module on
``PYTHONPATH`` puts a finder first on ``sys.meta_path`` that refuses them), and the server still
starts, answers and streams the offline engine's tokens.
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

NOT_AT_RUN_TIME = ("grpc_tools", "tritonclient", "hypothesis", "pytest")
"""Top-level modules of the dev and test extras' packages that no run-time path may import."""

BLOCKER = f'''
import importlib.abc
import sys

class _NotAtRunTime(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {NOT_AT_RUN_TIME!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (made unimportable by the test)", name=name)
        return None

sys.meta_path.insert(0, _NotAtRunTime())
'''

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
        assert proc.returncode != 0 and "made unimportable by the test" in proc.stderr, (module, proc.stderr)


def test_serve_runs_without_dev_packages(without_dev_packages, tiny_llama_dir, tmp_path):
    """``pprun serve`` (engine in its own process) starts, reports its model and streams the tokens
    ``LLM.generate`` gives offline, with grpc_tools and the test tools unimportable."""
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
    assert "made unimportable by the test" not in server.log()
