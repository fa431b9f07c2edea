"""Closed by default, serving side (docs/security.md): a server on an address beyond loopback
needs a bearer token or an explicit opt-out, refused before anything starts; a token without
TLS there starts with a warning that it travels in clear."""

from __future__ import annotations

import socket
import subprocess
import sys

import grpc
import psutil
import pytest
from serve_helpers import ServerProcess

from pprun.config.config import ServeConfig
from pprun.config.exposure import check_network_exposure, is_loopback

TOKEN = "exposure-test-token"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_needs_nothing(host):
    assert is_loopback(host)
    ServeConfig(host=host).validate()
    assert check_network_exposure(host, has_token=False, tls=False, allow_unauthenticated=False) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "192.0.2.7", "server.example"])
def test_beyond_loopback_without_a_token_is_refused_naming_the_ways_out(host, tmp_path):
    """The error names the field and value, how to add a token, and the opt-out by name; with
    a token, or the opt-out, the same host validates."""
    assert not is_loopback(host)
    with pytest.raises(ValueError) as e:
        ServeConfig(host=host).validate()
    message = str(e.value)
    assert f"serve.host={host!r}" in message
    assert "serve.auth_token_file=" in message and "serve.allow_unauthenticated=true" in message
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    ServeConfig(host=host, auth_token_file=str(token)).validate()
    ServeConfig(host=host, auth_token=TOKEN).validate()
    ServeConfig(host=host, allow_unauthenticated=True).validate()


def test_what_the_server_logs_beyond_loopback():
    """A token without TLS: the token travels in clear; with TLS: nothing to say; the opt-out:
    serving without authentication."""
    clear = check_network_exposure("0.0.0.0", has_token=True, tls=False, allow_unauthenticated=False)
    assert clear is not None and "travels in clear" in clear and "serve.tls_cert_file" in clear
    assert check_network_exposure("0.0.0.0", has_token=True, tls=True, allow_unauthenticated=False) is None
    open_ = check_network_exposure("0.0.0.0", has_token=False, tls=False, allow_unauthenticated=True)
    assert open_ is not None and "WITHOUT authentication" in open_


def test_allow_unauthenticated_must_be_a_bool():
    with pytest.raises(ValueError, match=r"serve.allow_unauthenticated='yes' is invalid"):
        ServeConfig(host="0.0.0.0", allow_unauthenticated="yes").validate()


def test_pprun_serve_refuses_before_anything_starts(tiny_llama_dir, tmp_path, monkeypatch):
    """In process: ``pprun serve``'s app refuses before it looks at the model or imports the
    server; from the command line: a non-zero exit whose message says what to do."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from pprun.apps.serve import run
    from pprun.config.config import default_conf_dir, register_configs
    from pprun.serve import layout

    def started(*args, **kwargs):
        raise AssertionError("the engine's configuration was built: the refusal came too late")

    monkeypatch.setattr(layout, "engine_config", started)
    register_configs()
    with initialize_config_dir(config_dir=str(default_conf_dir()), version_base="1.3"):
        cfg = OmegaConf.to_object(compose("serve", [f"model.model={tiny_llama_dir}", "parallel=single",
                                                    "serve.host=0.0.0.0", "serve.port=0"]))  # fmt: skip
    with pytest.raises(ValueError, match=r"serve.host='0.0.0.0' listens beyond this host"):
        run(cfg)
    proc = subprocess.run(
        [sys.executable, "-m", "pprun", "serve", f"model.model={tiny_llama_dir}", "parallel=single",
         "serve.host=0.0.0.0", "serve.port=0", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "serve.allow_unauthenticated=true" in proc.stderr and "serve.auth_token_file=" in proc.stderr, proc.stderr


def test_token_without_tls_beyond_loopback_starts_with_a_warning(tiny_llama_dir, tmp_path):
    """``serve.host=0.0.0.0`` with a token file and no TLS: the server starts, logs that the
    token travels in clear, answers a call carrying the token on a non-loopback address of this
    machine and refuses one without it."""
    from pprun.serve._proto.pprun.v1 import pprun_pb2 as pb
    from pprun.serve._proto.pprun.v1 import pprun_pb2_grpc as pb_grpc

    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    server = ServerProcess(tmp_path, [f"model.model={tiny_llama_dir}", "model.dtype=float32", "parallel=single",
                                      "serve.engine_process=false", "serve.host=0.0.0.0",
                                      f"serve.auth_token_file={token}"])  # fmt: skip
    try:
        assert "the bearer token travels in clear" in server.log()
        port = int(server.address.rsplit(":", 1)[1])
        others = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                  if a.family == socket.AF_INET and not a.address.startswith("127.")]  # fmt: skip
        address = f"{others[0]}:{port}" if others else f"127.0.0.1:{port}"
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.PprunStub(ch)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),),
                                     timeout=30)  # fmt: skip
            assert info.model == server.info["model"]
            with pytest.raises(grpc.RpcError) as e:
                stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert server.terminate() == 0, server.log()[-3000:]
    finally:
        server.kill()
