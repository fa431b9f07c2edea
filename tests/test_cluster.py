"""Beyond one process tree: stages placed across Ray nodes, multi-node torchrun, jobs on a Ray cluster.

Everything runs on this machine over loopback.  One real two-node Ray cluster is shared by the
module (a head with the dashboard and job server on 127.0.0.1, and a second node carrying a
custom resource), started and stopped by pid (``tests/ray_nodes.py``); drivers run in
subprocesses, so they attach to it and not to the session's in-process cluster.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ray_nodes import LocalRayCluster, free_port
from tiny_models import make_tiny_llama

REPO_ROOT = Path(__file__).resolve().parent.parent
NODE2_RESOURCE = "pprun_test_node2"
NODE2_IP = "127.0.0.2"
"""The second node's address: loopback too, but not the head's, so stages on it meet the others
at node addresses as between hosts (no shortcut for stages on the driver's node)."""
PROMPTS = [{"prompt_token_ids": [5, 17, 42]}, {"prompt_token_ids": list(range(10, 31))}]
MAX_TOKENS = 6
KV_BYTES = 4 * 1024 * 1024
RUN_TIMEOUT_S = 300


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    for key in ("RAY_ADDRESS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), num_layers=4)


@pytest.fixture(scope="module")
def reference_tokens(tiny_llama: Path) -> list[list[int]]:
    """Greedy tokens of pp=1 in this process."""
    from pprun import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(tiny_llama), dtype="float32", device="cpu", executor="uni", cpu_kv_cache_bytes=KV_BYTES) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes on loopback: the head (1 CPU, dashboard + job server) and a node with
    ``{NODE2_RESOURCE: 1}``; yields (cluster, node id of the second node).

    The second node starts once the head is up: a node that Ray's start-up does not see
    registered with the GCS within its fixed 30 s fails, and the two nodes starting together, on
    two cores that the other pytest-xdist worker uses too, once took longer than that."""
    c = LocalRayCluster(head_cpus=1)
    try:
        c.wait_ready(1)
        c.add_node(1, {NODE2_RESOURCE: 1}, node_ip=NODE2_IP)
        nodes = c.wait_ready(2)
        node2 = [n["node_id"] for n in nodes if NODE2_RESOURCE in (n.get("resources_total") or {})]
        assert len(node2) == 1, nodes
        yield c, node2[0]
    finally:
        c.stop()


PLACEMENT_SCRIPT = r"""
import json, sys
from pprun import LLM, SamplingParams

model, address, prompts, max_tokens, kv_bytes, resource = json.loads(sys.argv[1])
params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
with LLM(model, dtype="float32", device="cpu", pipeline_parallel_size=2, executor="ray", ray_address=address,
         placement_strategy="STRICT_SPREAD", stage_resources=[{}, {resource: 1}],
         cpu_kv_cache_bytes=kv_bytes) as llm:
    outs = llm.generate(prompts, params)
    ex = llm.engine.executor
    print("RESULT " + json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "nodes": ex.stage_node_ids,
                                  "ips": ex.stage_ips, "describe": llm.describe()["executor"]}))
"""


def test_strict_spread_puts_stages_on_different_nodes(cluster, tiny_llama, reference_tokens, tmp_path):
    """STRICT_SPREAD + a per-stage custom resource: stage 1 on the node that has it, stage 0 on the
    other; greedy tokens equal pp=1."""
    c, node2 = cluster
    script = tmp_path / "placement.py"
    script.write_text(PLACEMENT_SCRIPT)
    payload = json.dumps([str(tiny_llama), c.address, PROMPTS, MAX_TOKENS, KV_BYTES, NODE2_RESOURCE])
    proc = subprocess.run(
        [sys.executable, str(script), payload], env=_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert result["nodes"][1] == node2
    assert result["nodes"][0] != node2
    assert "STRICT_SPREAD on 2 nodes" in result["describe"]
    # Each stage's address as Ray reports it: the two differ, so the stages met at node addresses
    # (stage 0's for the rendezvous), not on the single-node loopback path.
    assert result["ips"][1] == NODE2_IP and result["ips"][0] != NODE2_IP
    assert result["tokens"] == reference_tokens


def test_impossible_placement_fails_at_once(ray_cluster, tiny_llama):
    """On a one-node cluster, STRICT_SPREAD over two stages, or a custom resource no node has, is a
    configuration error naming the setting, not a wait for resources that never come."""
    from pprun import LLM

    common = dict(dtype="float32", device="cpu", pipeline_parallel_size=2, executor="ray", cpu_kv_cache_bytes=KV_BYTES)
    with pytest.raises(ValueError, match=r"placement_strategy=STRICT_SPREAD .* 1 alive node"):
        LLM(str(tiny_llama), placement_strategy="STRICT_SPREAD", **common)
    with pytest.raises(ValueError, match=r"stage_resources\[1\]\.nowhere=1 cannot be reserved"):
        LLM(str(tiny_llama), stage_resources=[{}, {"nowhere": 1}], **common)
    with pytest.raises(ValueError, match=r"parallel.placement_strategy='diagonal' is not allowed"):
        LLM(str(tiny_llama), placement_strategy="diagonal", **common)


def test_torchrun_two_nodes_one_rendezvous(tiny_llama, reference_tokens, tmp_path):
    """Two torchrun launchers (``--nnodes 2``, one process each) meeting at one c10d rendezvous
    endpoint on 127.0.0.1: pp=2, and every rank's output equals pp=1."""
    torchrun = shutil.which("torchrun")
    base = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    endpoint = f"127.0.0.1:{free_port()}"
    procs = []
    for node in range(2):
        cmd = [
            *base, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", "pprun-test", "--local-addr", "127.0.0.1",
            str(REPO_ROOT / "launchers" / "torchrun_generate.py"),
            f"model.model={tiny_llama}", "model.dtype=float32", "device=cpu",
            "parallel.pipeline_parallel_size=2", f"input_file={prompts}",
            f"sampling.max_tokens={MAX_TOKENS}", "sampling.ignore_eos=true",
            f"cache.cpu_kv_cache_bytes={KV_BYTES}", f"output_file='{tmp_path}/rank{{rank}}.jsonl'",  # quoted: braces are Hydra grammar
        ]
        log = open(tmp_path / f"node{node}.log", "w")
        procs.append((subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=log, stderr=subprocess.STDOUT), log))
    try:
        for proc, _ in procs:
            proc.wait(timeout=RUN_TIMEOUT_S)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    logs = "\n".join((tmp_path / f"node{n}.log").read_text()[-3000:] for n in range(2))
    assert [p.returncode for p, _ in procs] == [0, 0], logs
    for rank in range(2):
        rows = [json.loads(line) for line in (tmp_path / f"rank{rank}.jsonl").read_text().splitlines()]
        assert [r["token_ids"] for r in rows] == reference_tokens, (rank, logs)


DEMO_PROMPT = "The capital of France is"
DEMO_MAX_TOKENS = 8


@pytest.fixture(scope="module")
def demo_reference_text(demo_model_dir) -> str:
    """The demo model's greedy continuation of DEMO_PROMPT at pp=1, in this process."""
    from pprun import LLM, SamplingParams

    with LLM(str(demo_model_dir), dtype="float32", device="cpu", executor="uni") as llm:
        out = llm.generate([DEMO_PROMPT], SamplingParams(temperature=0.0, max_tokens=DEMO_MAX_TOKENS))
    return out[0].outputs[0].text


def _pprun_submit(c: LocalRayCluster, args: list[str], cwd: Path, timeout_s: float = RUN_TIMEOUT_S):
    """``pprun submit ARGS`` with RAY_ADDRESS naming the cluster's job server."""
    return subprocess.run(
        [sys.executable, "-m", "pprun", "submit", *args], cwd=cwd, env=_env(RAY_ADDRESS=c.dashboard_url),
        capture_output=True, text=True, timeout=timeout_s,
    )


def test_submit_generate_pp2_job(cluster, demo_reference_text, tmp_path):
    """``pprun submit generate`` at pp=2 on the demo model: the job succeeds, its followed logs hold
    pp=1's text, and ``status`` and ``logs`` report it.  The prompt comes from a file in the
    working directory, which the job only sees if that directory was carried."""
    c, _ = cluster
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": DEMO_PROMPT}) + "\n")
    proc = _pprun_submit(
        c,
        ["generate", "parallel=pp2_ray", "input_file=prompts.jsonl", f"sampling.max_tokens={DEMO_MAX_TOKENS}",
         "model.dtype=float32", "device=cpu", "progress=false"],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    job_id = proc.stdout.splitlines()[0].strip()
    assert demo_reference_text.strip() and demo_reference_text.strip() in proc.stdout
    assert "SUCCEEDED" in proc.stderr
    assert re.search(r"stages:\s+2 \(", proc.stdout) and "executor: ray" in re.sub(r"\s+", " ", proc.stdout)
    status = _pprun_submit(c, ["status", job_id, "--address", c.dashboard_url], cwd=tmp_path)
    assert status.returncode == 0 and f"{job_id}: SUCCEEDED" in status.stdout
    logs = _pprun_submit(c, ["logs", job_id], cwd=tmp_path)
    assert logs.returncode == 0 and demo_reference_text.strip() in logs.stdout


def test_submit_bad_override_fails_with_config_error(cluster, tmp_path):
    """A job whose override is invalid fails: the configuration error is in its logs, the exit is non-zero."""
    c, _ = cluster
    proc = _pprun_submit(c, ["--no-working-dir", "generate", "parallel.placement_strategy=diagonal"], cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "parallel.placement_strategy='diagonal' is not allowed" in proc.stdout
    job_id = proc.stdout.splitlines()[0].strip()
    status = _pprun_submit(c, ["status", job_id], cwd=tmp_path)
    assert f"{job_id}: FAILED" in status.stdout
    logs = _pprun_submit(c, ["logs", job_id], cwd=tmp_path)
    assert "parallel.placement_strategy='diagonal' is not allowed" in logs.stdout


def test_submit_no_wait_then_stop(cluster, tmp_path):
    """``--no-wait`` returns with the job id while the job runs; ``stop`` ends it (exit 3, STOPPED)."""
    import time

    c, _ = cluster
    proc = _pprun_submit(
        c,
        ["--no-wait", "--no-working-dir", "generate", "parallel=single", f"prompt='{DEMO_PROMPT}'",
         "sampling.max_tokens=8000", "sampling.ignore_eos=true", "device=cpu"],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    job_id = proc.stdout.strip()
    deadline = time.monotonic() + 120
    while True:
        status = _pprun_submit(c, ["status", job_id], cwd=tmp_path).stdout
        if "RUNNING" in status or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert f"{job_id}: RUNNING" in status
    stop = _pprun_submit(c, ["stop", job_id], cwd=tmp_path)
    assert stop.returncode == 3 and f"{job_id}: STOPPED" in stop.stdout, stop.stdout + stop.stderr
    unknown = _pprun_submit(c, ["status", "no-such-job"], cwd=tmp_path)
    assert unknown.returncode == 2 and "no-such-job" in unknown.stderr


def test_submit_runtime_env_parts(tmp_path, monkeypatch):
    """What a job carries: pprun laid out as a wheel (its YAML inside), PPRUN_* and named
    variables, the app and its overrides quoted as one command line; bad arguments are errors."""
    import shlex

    from pprun.apps import submit

    staged = submit.stage_pprun(tmp_path)
    assert (staged / "__init__.py").is_file() and (staged / "conf" / "generate.yaml").is_file()
    assert not list(staged.rglob("__pycache__"))
    monkeypatch.setenv("PPRUN_CONTROL_SPIN_US", "0")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    env = submit.job_env(["NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME=eth1"])
    assert env["PPRUN_CONTROL_SPIN_US"] == "0"
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["GLOO_SOCKET_IFNAME"] == "eth1"
    assert "PATH" not in env
    monkeypatch.delenv("NOT_SET_HERE", raising=False)
    with pytest.raises(ValueError, match="NOT_SET_HERE: no such variable"):
        submit.job_env(["NOT_SET_HERE"])
    line = submit.entrypoint("generate", ["prompt='a b'", "sampling.max_tokens=4"])
    assert shlex.split(line) == ["python", "-m", "pprun", "generate", "prompt='a b'", "sampling.max_tokens=4"]
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ValueError, match="--address .* or set RAY_ADDRESS"):
        submit.job_server_address(None)
    with pytest.raises(SystemExit):
        submit.parse_args(["nonsense-app"])


def test_stage_resources_checked_before_start():
    """``parallel.stage_resources``: one mapping per stage, custom names only, amounts Ray can
    reserve, ray only; each error names the field and what is allowed."""
    from pprun.config.config import PprunConfig
    from pprun.config.validate import _check_values

    def check(**kw) -> None:
        _check_values(PprunConfig.from_kwargs(pipeline_parallel_size=2, **kw), {})

    check(executor="ray", stage_resources=[{}, {"big_mem": 1}], placement_strategy="SPREAD")
    with pytest.raises(ValueError, match=r"must be a list of 2 mappings"):
        check(executor="ray", stage_resources=[{"big_mem": 1}])
    with pytest.raises(ValueError, match=r"stage_resources\[1\]\.CPU is not allowed"):
        check(executor="ray", stage_resources=[{}, {"CPU": 1}])
    with pytest.raises(ValueError, match=r"stage_resources\[0\]\.a=1\.5 is invalid"):
        check(executor="ray", stage_resources=[{"a": 1.5}, {}])
    with pytest.raises(ValueError, match=r"not allowed with executor 'mp'"):
        check(executor="mp", stage_resources=[{}, {}])
