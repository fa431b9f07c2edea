"""A real multi-node Ray cluster on this machine, for tests: a head node (with the dashboard and the
job server on loopback) and extra nodes, each a ``ray start --block`` process of its own.

Every node is started in a new session and stopped by its own process id (SIGTERM: ``--block``
shuts down the processes it started; then SIGKILL to its process group if it lingers), never by
``ray stop``, which would stop every Ray cluster on the machine.  Every port is picked free, so
the cluster cannot collide with another one running here (including Ray's fixed defaults such
as the client server's 10001 and the dashboard agent's 52365).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

HOST = "127.0.0.1"
START_TIMEOUT_S = 180.0


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _ray_cli() -> list[str]:
    found = shutil.which("ray")
    if found is None:
        raise RuntimeError("the `ray` command is not on PATH")
    return [found]


STARTUP_TIMEOUT = "The current node timed out during startup"
"""What Ray's ``ray start`` raises when its raylet did not register with the GCS within 30 s."""

class LocalRayCluster:
    """Head node plus extra nodes, all bound to 127.0.0.1; see the module docstring."""

    def __init__(self, head_cpus: float = 1, dashboard: bool = True) -> None:
        # Short: Ray's socket paths under the temp dir have a length limit.
        self.temp_dir = tempfile.mkdtemp(prefix="rayF", dir="/tmp")
        self.gcs_port = free_port()
        self.dashboard_port = free_port() if dashboard else None
        self.procs: list[subprocess.Popen] = []
        self.cmds: list[list[str]] = []
        self.restarted: set[int] = set()
        self.logs: list[Path] = []
        self.env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
        self.env.pop("RAY_ADDRESS", None)
        args = [
            "--head",
            f"--port={self.gcs_port}",
            f"--ray-client-server-port={free_port()}",
            f"--temp-dir={self.temp_dir}",
            f"--include-dashboard={'true' if dashboard else 'false'}",
            "--disable-usage-stats",
        ]
        if dashboard:
            args += [f"--dashboard-host={HOST}", f"--dashboard-port={self.dashboard_port}"]
        self._start_node(args, head_cpus, None)

    @property
    def address(self) -> str:
        """The GCS address (``ray.init(address=...)``, ``RAY_ADDRESS`` for drivers)."""
        return f"{HOST}:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        """The job server's address (``JobSubmissionClient``, ``pprun submit --address``)."""
        if self.dashboard_port is None:
            raise RuntimeError("this cluster was started without a dashboard")
        return f"http://{HOST}:{self.dashboard_port}"

    def _start_node(
        self, args: list[str], num_cpus: float, resources: dict[str, float] | None, node_ip: str = HOST
    ) -> None:
        log = Path(self.temp_dir) / f"node{len(self.procs)}.log"
        cmd = [
            *_ray_cli(),
            "start",
            "--block",
            f"--node-ip-address={node_ip}",
            f"--num-cpus={num_cpus}",
            f"--node-manager-port={free_port()}",
            f"--object-manager-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            "--object-store-memory=80000000",
            *args,
        ]
        if resources:
            cmd.append(f"--resources={json.dumps(resources)}")
        self.procs.append(self._popen(cmd, log))
        self.logs.append(log)
        self.cmds.append(cmd)

    def _popen(self, cmd: list[str], log: Path, mode: str = "wb") -> subprocess.Popen:
        with open(log, mode) as out:
            return subprocess.Popen(
                cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def add_node(self, num_cpus: float, resources: dict[str, float] | None = None, node_ip: str = HOST) -> None:
        """Start one more node joining the head; ``node_ip`` another loopback address (127.0.0.2)
        gives it an address of its own, as a second host would have."""
        self._start_node([f"--address={self.address}"], num_cpus, resources, node_ip)

    def wait_ready(self, num_nodes: int, timeout_s: float = START_TIMEOUT_S) -> list[dict]:
        """Wait until ``num_nodes`` nodes are alive (and the job server answers); returns the nodes
        as ``ray list nodes`` would (``node_id``, ``resources_total``, ...)."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            for i, (proc, log) in enumerate(zip(self.procs, self.logs)):
                if proc.poll() is not None:
                    text = log.read_text()
                    joining = any(a.startswith("--address=") for a in self.cmds[i])
                    if joining and STARTUP_TIMEOUT in text and i not in self.restarted:
                        # Ray gives a joining raylet a fixed 30 s to register; on a loaded 2-core
                        # machine (another test worker's cluster) it can miss that once: start it again.
                        self.restarted.add(i)
                        self.procs[i] = self._popen(self.cmds[i], log, "ab")
                        continue
                    raise RuntimeError(f"ray node exited with {proc.returncode}:\n{text[-3000:]}")
            try:
                nodes = self._alive_nodes()
                if len(nodes) >= num_nodes and self._dashboard_up():
                    return nodes
                last = f"{len(nodes)} nodes alive"
            except Exception as e:  # not up yet
                last = f"{type(e).__name__}: {e}"
            time.sleep(1.0)
        raise RuntimeError(f"the Ray cluster did not come up in {timeout_s:.0f}s ({last})")

    def _alive_nodes(self) -> list[dict]:
        out = subprocess.run(
            [*_ray_cli(), "list", "nodes", f"--address={self.address}", "--format=json", "--filter=state=ALIVE"],
            env=self.env, capture_output=True, text=True, timeout=60,
        ) if self.dashboard_port is not None else None
        if out is None:
            raise RuntimeError("listing nodes needs the dashboard")
        if out.returncode != 0:
            raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "ray list failed")
        return json.loads(out.stdout)

    def _dashboard_up(self) -> bool:
        if self.dashboard_port is None:
            return True
        with urllib.request.urlopen(f"{self.dashboard_url}/api/version", timeout=5) as r:
            return r.status == 200

    def stop(self) -> None:
        """Stop every node this object started, by process id (see the module docstring)."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            # Whatever the node left in its own session (raylet, workers) goes with it.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)
