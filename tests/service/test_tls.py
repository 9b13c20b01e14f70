"""TLS_CERT / TLS_KEY serve TLS only; TLS_CLIENT_CA requires client certificates (mTLS). The
certificates are made by the test (tests/service/certs.py)."""

from __future__ import annotations

import json
import shutil
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgen import cli
from kvgen.client import Client, open_channel
from kvgen.service.server import Server
from kvgen.service.settings import Settings
from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as pb_grpc

INFO = pb.GetModelInfoRequest()


@pytest.fixture(scope="module")
def tls_server(start_server, pki):
    return start_server(tls_cert=str(pki.server_cert), tls_key=str(pki.server_key))


@pytest.fixture(scope="module")
def mtls_server(start_server, pki):
    return start_server(tls_cert=str(pki.server_cert), tls_key=str(pki.server_key), tls_client_ca=str(pki.ca))


def model_info(channel: grpc.Channel) -> pb.GetModelInfoResponse:
    return pb_grpc.GeneratorStub(channel).GetModelInfo(INFO, timeout=10)


def refused_code(channel: grpc.Channel) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        model_info(channel)
    return e.value.code()


def test_tls_call_works_and_plaintext_is_refused(tls_server, pki):
    with open_channel(tls_server.target, ca_file=str(pki.ca)) as ch:
        assert model_info(ch).vocab_size == 300
    with grpc.insecure_channel(tls_server.target) as ch:
        assert refused_code(ch) == grpc.StatusCode.UNAVAILABLE
    with open_channel(tls_server.target, tls=True) as ch:  # the system's roots do not know our CA
        assert refused_code(ch) == grpc.StatusCode.UNAVAILABLE


def test_mtls_needs_a_client_certificate_from_the_ca(mtls_server, pki):
    with open_channel(mtls_server.target, ca_file=str(pki.ca)) as ch:
        assert refused_code(ch) == grpc.StatusCode.UNAVAILABLE
    with open_channel(mtls_server.target, ca_file=str(pki.ca), cert_file=str(pki.stranger_cert),
                      key_file=str(pki.stranger_key)) as ch:
        assert refused_code(ch) == grpc.StatusCode.UNAVAILABLE
    with open_channel(mtls_server.target, ca_file=str(pki.ca), cert_file=str(pki.client_cert),
                      key_file=str(pki.client_key)) as ch:
        assert model_info(ch).vocab_size == 300
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_python_client_streams_over_mtls(mtls_server, pki):
    c = Client(mtls_server.target, ca_file=str(pki.ca), cert_file=str(pki.client_cert), key_file=str(pki.client_key))
    try:
        msgs = list(c.stream("Hello", max_new_tokens=4, temperature=0.0, ignore_eos=True, timeout=30))
        assert sum(len(m.token_ids) for m in msgs) == 4
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    finally:
        c.close()


def test_cli_over_mtls(mtls_server, pki, capsys):
    args = ["--target", mtls_server.target, "--ca-file", str(pki.ca)]
    assert cli.main([*args, "--cert-file", str(pki.client_cert), "--key-file", str(pki.client_key), "--info"]) == 0
    assert "vocab_size: 300" in capsys.readouterr().out
    assert cli.main([*args, "--info"]) == 1  # no client certificate
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_half_configured_tls_is_an_error(pki):
    for partial in (dict(tls_cert=str(pki.server_cert)), dict(tls_client_ca=str(pki.ca))):
        with pytest.raises(ValueError, match="TLS_CERT and TLS_KEY"):
            Server(Settings(host="127.0.0.1", port=0, metrics_port=0, **partial))
    with pytest.raises(ValueError):
        Client("127.0.0.1:1", cert_file=str(pki.client_cert))


@pytest.mark.skipif(shutil.which("grpcurl") is None, reason="grpcurl is not installed (Debian, PyPI and npm do not "
                    "ship it: its PyPI wrapper downloads the binary from GitHub at install time)")
def test_grpcurl_over_mtls(mtls_server, pki):
    out = subprocess.run(["grpcurl", "-cacert", str(pki.ca), "-cert", str(pki.client_cert), "-key",
                          str(pki.client_key), mtls_server.target, "kvgen.v1.Generator/GetModelInfo"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["vocabSize"] == 300
    plain = subprocess.run(["grpcurl", "-plaintext", mtls_server.target, "list"], capture_output=True, timeout=30)
    assert plain.returncode != 0


def test_node_client_over_mtls(mtls_server, pki, node_client):
    """A third-party gRPC stack (Node's grpc-js, through clients/node's CLI) over mTLS: refused
    without a client certificate, served with one."""
    cli = [shutil.which("node"), str(node_client / "cli.js"), "The capital of France is", "--target",
           mtls_server.target, "--ca-file", str(pki.ca), "--max-new-tokens", "4", "--temperature", "0"]
    refused = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "error: UNAVAILABLE" in refused.stderr, refused.stderr
    served = subprocess.run([*cli, "--cert-file", str(pki.client_cert), "--key-file", str(pki.client_key),
                             "--verbose"], capture_output=True, text=True, timeout=60)
    assert served.returncode == 0, served.stderr
    assert "completion 4 tokens" in served.stderr
