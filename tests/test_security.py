"""The closed internal plane: a shared token on every internal RPC, mutual TLS, the router's
API key from the environment or a file. Real services in this process (prefill CP 2, decode
DCP 2) with a throwaway CA made here; the whole request path must still be exact through it."""

from __future__ import annotations

import datetime
import ipaddress

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.model.sampler import SamplingParams
from engine.reference import ReferenceEngine
from services.common.config import ConfigError, DecodeConfig, PrefillConfig, RouterConfig
from services.common.rpc import CHANNEL_OPTIONS
from services.common.security import TOKEN_ENV, InternalPlane
from services.decode.server import serve_decode
from services.prefill.server import serve_prefill
from services.protos import common_pb2, decode_pb2, decode_pb2_grpc
from services.router.server import serve_router

TOKEN = "s3cret-internal-token"


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_pki(tmp) -> dict[str, str]:
    """A CA, and one certificate it signs for 127.0.0.1 (servers and clients alike)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cpserve test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = _key()
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cpserve")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    files = {"tls_ca": ca.public_bytes(serialization.Encoding.PEM), "tls_cert": cert.public_bytes(
        serialization.Encoding.PEM), "tls_key": _pem(key)}
    out = {}
    for name, data in files.items():
        path = tmp / f"{name}.pem"
        path.write_bytes(data)
        out[name] = str(path)
    return out


@pytest.fixture(scope="module")
def closed_plane(tmp_path_factory):
    """Decode, prefill and router sharing a token (from the environment) and mutual TLS."""
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    mp = pytest.MonkeyPatch()
    mp.setenv(TOKEN_ENV, TOKEN)
    started = []
    try:
        dec = serve_decode(DecodeConfig(dcp=2, max_cache_tokens=4096, health_port=0, **pki))
        started.append(dec)
        pre = serve_prefill(PrefillConfig(cp=2, max_cache_tokens=4096, **pki))
        started.append(pre)
        router = serve_router(RouterConfig(prefill=(f"127.0.0.1:{pre[1]}",), decode=(f"127.0.0.1:{dec[1]}",),
                                           grpc_port=None, **pki))
        yield {"decode": dec, "prefill": pre, "router": router, "pki": pki}
        router.shutdown()
    finally:
        for s in reversed(started):
            s[2]()
        mp.undo()


def reserve(channel) -> decode_pb2.ReservationRef:
    return decode_pb2_grpc.DecodeStub(channel).Reserve(
        decode_pb2.ReserveRequest(request_id="t", num_tokens=4, max_new_tokens=1), timeout=10)


def tls_plane(pki: dict, token: str | None) -> InternalPlane:
    """A client with the cluster's certificate and CA, and ``token``."""
    read = {name: open(pki[f"tls_{name}"], "rb").read() for name in ("cert", "key", "ca")}
    return InternalPlane(token=token, **read)


def test_the_request_path_is_exact_through_token_and_mutual_tls(closed_plane):
    prompt = list(range(3, 60))
    r = httpx.post(f"{closed_plane['router'].url}/v1/completions", trust_env=False, timeout=60,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                         "return_token_ids": True})
    assert r.status_code == 200, r.text
    want = ReferenceEngine("tiny").generate([prompt], SamplingParams(max_new_tokens=8, stop_token_ids=()))[0]
    assert r.json()["choices"][0]["token_ids"] == want.output_ids


@pytest.mark.parametrize("token", [None, "wrong"])
def test_internal_rpcs_without_the_token_are_unauthenticated(closed_plane, token):
    address = f"127.0.0.1:{closed_plane['decode'][1]}"
    with tls_plane(closed_plane["pki"], token).channel(address, CHANNEL_OPTIONS) as ch:
        with pytest.raises(grpc.RpcError) as e:
            reserve(ch)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "token" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # a streaming method too
            next(iter(decode_pb2_grpc.DecodeStub(ch).Generate(decode_pb2.GenerateRequest(reservation_id="x"),
                                                                timeout=10)))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # the standard health service needs no token (Kubernetes probes carry none)
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with tls_plane(closed_plane["pki"], TOKEN).channel(address, CHANNEL_OPTIONS) as ch:
        ref = reserve(ch)
        decode_pb2_grpc.DecodeStub(ch).Abort(decode_pb2.ReservationRef(reservation_id=ref.reservation_id), timeout=10)
        s = decode_pb2_grpc.DecodeStub(ch).Status(common_pb2.StatusRequest(), timeout=10)
        assert s.reservations == 0


def test_tls_refuses_plaintext_and_certificate_less_clients(closed_plane):
    address = f"127.0.0.1:{closed_plane['decode'][1]}"
    with InternalPlane(token=TOKEN).channel(address, CHANNEL_OPTIONS) as ch:  # plaintext, right token
        with pytest.raises(grpc.RpcError) as e:
            reserve(ch)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    ca = open(closed_plane["pki"]["tls_ca"], "rb").read()
    creds = grpc.ssl_channel_credentials(root_certificates=ca)  # TLS, but no client certificate
    with grpc.secure_channel(address, creds, options=CHANNEL_OPTIONS) as ch:
        with pytest.raises(grpc.RpcError) as e:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # probes that cannot speak TLS use the plaintext health-only port
    health_port = closed_plane["decode"][0].health_port
    with grpc.insecure_channel(f"127.0.0.1:{health_port}", options=CHANNEL_OPTIONS) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as e:  # and nothing else
            reserve(ch)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_bad_credential_settings_name_the_field(tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)  # (it would win over the file)
    with pytest.raises(ConfigError, match="tls_key: tls_cert and tls_key go together"):
        serve_decode(DecodeConfig(tls_cert=str(tmp_path / "c.pem")))
    with pytest.raises(ConfigError, match="internal_token_file: cannot read"):
        serve_decode(DecodeConfig(internal_token_file=str(tmp_path / "missing")))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="internal_token_file: .* is empty"):
        serve_prefill(PrefillConfig(internal_token_file=str(tmp_path / "empty")))
    assert TOKEN not in repr(InternalPlane(token=TOKEN))


def test_router_api_key_from_a_file_or_the_environment(tmp_path, monkeypatch):
    (tmp_path / "key").write_text("file-key\n")
    monkeypatch.delenv("CPSERVE_API_KEY", raising=False)
    for source, key in (("file", "file-key"), ("env", "env-key")):
        if source == "env":
            monkeypatch.setenv("CPSERVE_API_KEY", "env-key")
        router = serve_router(RouterConfig(prefill=("127.0.0.1:9",), decode=("127.0.0.1:9",), grpc_port=None,
                                           api_key_file=str(tmp_path / "key") if source == "file" else None))
        try:
            url = f"{router.url}/v1/models"
            assert httpx.get(url, trust_env=False).status_code == 401
            assert httpx.get(url, trust_env=False, headers={"Authorization": "Bearer nope"}).status_code == 401
            assert httpx.get(url, trust_env=False, headers={"Authorization": f"Bearer {key}"}).status_code == 200
        finally:
            router.shutdown()
