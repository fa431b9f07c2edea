"""A ``pprun serve`` process on loopback for tests: started, waited for, stopped by signal."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc


class ServerProcess:
    """``python -m pprun serve <overrides>`` in its own process; ``address`` once it serves."""

    def __init__(self, tmp_dir: Path, overrides: list[str], startup_timeout_s: float = 240.0) -> None:
        self.log_path = Path(tmp_dir) / "serve.log"
        cmd = [sys.executable, "-m", "pprun", "serve", *overrides, f"hydra.run.dir={tmp_dir}", "serve.port=0"]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout], daemon=True).start()
        deadline = time.monotonic() + startup_timeout_s
        self.info: dict | None = None
        while self.info is None:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                self.kill()
                raise RuntimeError(f"pprun serve did not start (rc={self.proc.returncode}):\n{self.log()[-4000:]}")
            try:
                line = lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line.startswith("{") and '"serving"' in line:
                self.info = json.loads(line)
        self.address: str = self.info["address"]

    def log(self) -> str:
        """What the server wrote to stderr so far."""
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def channel(self) -> grpc.Channel:
        """A plaintext channel to the server."""
        return grpc.insecure_channel(self.address)

    def rss_bytes(self) -> int:
        """The server process's resident set size."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def terminate(self, timeout_s: float = 120.0) -> int:
        """SIGTERM, then wait for the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self.kill()

    def kill(self) -> None:
        """Make sure the process is gone (and its log closed)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        if not self._log.closed:
            self._log.close()
