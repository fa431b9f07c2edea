"""A ``pprun serve`` process on loopback for tests: started, waited for, stopped by signal."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc


class ServerProcess:
    """``python -m pprun serve <overrides>`` (or ``command``, which must print the same
    ``{"event": "serving", ...}`` line) in its own process; ``address`` once it serves."""

    def __init__(self, tmp_dir: Path, overrides: list[str], startup_timeout_s: float = 240.0,
                 command: list[str] | None = None) -> None:
        self.log_path = Path(tmp_dir) / "serve.log"
        cmd = command or [sys.executable, "-m", "pprun", "serve", *overrides, f"hydra.run.dir={tmp_dir}", "serve.port=0"]
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


def make_self_signed_cert(tmp_dir: Path) -> tuple[Path, Path]:
    """A self-signed certificate for ``localhost`` / 127.0.0.1 and its key, as PEM files in
    ``tmp_dir``: with the ``cryptography`` package when installed, else the ``openssl`` command;
    the test is skipped when neither is there."""
    cert_path, key_path = Path(tmp_dir) / "cert.pem", Path(tmp_dir) / "key.pem"
    try:
        import datetime
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        openssl = shutil.which("openssl")
        if openssl is None:
            import pytest

            pytest.skip("neither the cryptography package nor the openssl command is available")
        subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-days", "2", "-subj", "/CN=localhost", "-keyout", str(key_path), "-out",
                        str(cert_path), "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                       check=True, capture_output=True)  # fmt: skip
        return cert_path, key_path
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                    x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


class ClientProcess:
    """A Python client in its own process (``code`` gets the server address as ``sys.argv[1]``,
    then ``args``); ``wait_for(line)`` blocks until it prints that line, ``kill()`` SIGKILLs it,
    as a client machine that crashes or loses power would go."""

    def __init__(self, code: str, address: str, *args: str) -> None:
        tests_dir = str(Path(__file__).resolve().parent)  # so the client can import these helpers
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen([sys.executable, "-c", code, address, *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env)
        self._lines: queue.Queue = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=lambda: [self._lines.put(x) for x in self.proc.stdout], daemon=True).start()

    def wait_for(self, line: str, timeout_s: float = 120.0) -> None:
        """Block until the client prints ``line``; raise (with its output) if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                got = self._lines.get(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.kill()
                    raise RuntimeError(f"client never printed {line!r}:\n{''.join(self.output)}") from None
                continue
            self.output.append(got)
            if got.strip() == line:
                return

    def kill(self) -> None:
        """SIGKILL the client and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def kserve_request(model: str, request_id: str, prompt: str, sampling: dict | None = None, stream: bool = True):
    """A ModelInferRequest as Triton's vLLM clients send it (``tritonclient``'s own messages:
    a process may hold only one copy of the KServe protos, and tests use tritonclient's)."""
    from tritonclient.grpc import service_pb2 as pb

    def tensor(name: str, datatype: str, **contents):
        return pb.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=[1],
                                                     contents=pb.InferTensorContents(**contents))

    inputs = [tensor("text_input", "BYTES", bytes_contents=[prompt.encode()]),
              tensor("stream", "BOOL", bool_contents=[stream])]
    if sampling is not None:
        inputs.append(tensor("sampling_parameters", "BYTES", bytes_contents=[json.dumps(sampling).encode()]))
    return pb.ModelInferRequest(model_name=model, id=request_id, inputs=inputs)


def requests_then_hold(requests: list, hold: threading.Event):
    """A request iterator for a streaming call: ``requests``, then the stream stays open (the
    client neither half-closes nor sends more) until ``hold`` is set."""
    yield from requests
    hold.wait()
