"""TLS and mTLS on every hop (engine_service/common/tls.py), with a throwaway CA made here:
clients, `nanoserve generate`, the Node client, the router and real and fake engines; and
certificates rotated in place (a Kubernetes Secret's update) without a restart."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import itertools
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.client import HTTPSConnection
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients import AsyncClient, Client, Unavailable
from engine_service.common.tls import channel_credentials, open_channel, server_credentials
from router.config import RouterConfig
from router.server import Router
from tests.fake_engine import FakeEngine, start_fake_engine
from tests.procs import run_node_client_test, start_engine, start_router
from tests.router_helpers import wait_ready

NANOSERVE = Path(sys.executable).parent / "nanoserve"
SERVICE = "nanoserve-engine"  # the DNS name engines found by --engine-dns are verified as


@dataclass
class Pki:
    ca: str            # the CA every server and client trusts
    cert: str          # server (and router client) certificate: localhost, 127.0.0.1
    key: str
    client_cert: str   # a client certificate from the CA
    client_key: str
    service_cert: str  # names only SERVICE, as an engine behind a headless Service
    service_key: str
    other_ca: str      # a CA nobody trusts
    stranger_cert: str  # a client certificate from other_ca
    stranger_key: str


def issue(out: Path, name: str, signer: tuple | None = None, sans: tuple = ()) -> tuple:
    """Write OUT/NAME.crt and NAME.key: a self-signed CA when signer is None, else a leaf
    signed by signer = (key, cert) for server and client use. Returns (key, cert)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    signer_key, signer_cert = signer or (key, None)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject)
               .issuer_name(signer_cert.subject if signer_cert else subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=signer is None, path_length=None),
                              critical=True))
    if signer is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage(
            [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    cert = builder.sign(signer_key, hashes.SHA256())
    (out / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out / f"{name}.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return key, cert


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    out = tmp_path_factory.mktemp("pki")
    ca, other = issue(out, "ca"), issue(out, "other-ca")
    issue(out, "server", ca, (x509.DNSName("localhost"),
                              x509.IPAddress(ipaddress.ip_address("127.0.0.1"))))
    issue(out, "client", ca)
    issue(out, "service", ca, (x509.DNSName(SERVICE),))
    issue(out, "stranger", other)
    p = {name: str(out / name) for name in ("ca", "server", "client", "service", "other-ca",
                                            "stranger")}
    return Pki(f"{p['ca']}.crt", f"{p['server']}.crt", f"{p['server']}.key",
               f"{p['client']}.crt", f"{p['client']}.key", f"{p['service']}.crt",
               f"{p['service']}.key", f"{p['other-ca']}.crt", f"{p['stranger']}.crt",
               f"{p['stranger']}.key")


@pytest.fixture(scope="module")
def tls_fake(pki: Pki) -> Iterator[FakeEngine]:
    """A fake engine serving TLS (no client certificate asked)."""
    fake, _ = start_fake_engine(engine_id="tls", credentials=server_credentials(pki.cert,
                                                                                pki.key))
    yield fake
    fake.stop(0)


@pytest.fixture(scope="module")
def mtls_fake(pki: Pki) -> Iterator[FakeEngine]:
    """A fake engine that requires client certificates signed by the CA."""
    fake, _ = start_fake_engine(engine_id="mtls",
                                credentials=server_credentials(pki.cert, pki.key, pki.ca))
    yield fake
    fake.stop(0)


def target(fake: FakeEngine) -> str:
    return f"127.0.0.1:{fake.port}"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(NANOSERVE), *args], capture_output=True, text=True, timeout=120)


def test_cert_and_key_go_together(pki: Pki, tmp_path: Path) -> None:
    for kw in ({"tls_cert": pki.cert}, {"tls_key": pki.key}):
        with pytest.raises(ValueError, match="--tls-cert and --tls-key"):
            RouterConfig(engine=["127.0.0.1:1"], **kw)
    with pytest.raises(ValueError, match="--tls-ca must be a readable PEM file"):
        RouterConfig(engine=["127.0.0.1:1"], tls_ca=str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="--tls-cert and --tls-key"):
        Client("127.0.0.1:1", tls_ca=pki.ca, tls_cert=pki.client_cert)
    with pytest.raises(ValueError, match="--tls-cert needs --tls-ca"):
        Client("127.0.0.1:1", tls_cert=pki.client_cert, tls_key=pki.client_key)
    # an engine asked to require client certificates must serve TLS itself
    (tmp_path / "config.json").write_text("{}")
    proc = run_cli("engine", "--model", str(tmp_path), "--tls-ca", pki.ca)
    assert proc.returncode == 2
    assert "--tls-ca" in proc.stdout and "needs --tls-cert and --tls-key" in proc.stdout


def test_client_over_tls_and_what_fails_verification(tls_fake: FakeEngine, pki: Pki) -> None:
    with Client(target(tls_fake), timeout=10, tls_ca=pki.ca) as client:
        assert client.generate([5, 6, 7], max_tokens=3).token_ids == [8, 9, 10]

    async def over_asyncio() -> list[int]:
        async with AsyncClient(target(tls_fake), timeout=10, tls_ca=pki.ca) as client:
            return (await client.generate([1, 2], max_tokens=2)).token_ids

    assert asyncio.run(over_asyncio()) == [3, 4]
    for kw in ({}, {"tls_ca": pki.other_ca}):  # plaintext; a CA that did not sign the server
        with Client(target(tls_fake), timeout=10, **kw) as client, \
                pytest.raises(Unavailable):
            client.generate([5], max_tokens=1)


def test_mtls_engine_requires_a_client_certificate_from_its_ca(mtls_fake: FakeEngine,
                                                              pki: Pki) -> None:
    refused = ({}, {"tls_cert": pki.stranger_cert, "tls_key": pki.stranger_key})
    for kw in refused:
        with Client(target(mtls_fake), timeout=10, tls_ca=pki.ca, **kw) as client, \
                pytest.raises(Unavailable):
            client.generate([5], max_tokens=1)
    with Client(target(mtls_fake), timeout=10, tls_ca=pki.ca, tls_cert=pki.client_cert,
                tls_key=pki.client_key) as client:
        assert client.generate([5], max_tokens=2).token_ids == [6, 7]


def test_router_verifies_dns_found_engines_by_service_name(pki: Pki) -> None:
    """Engines found by DNS are dialled by IP; their certificate names only the Service. The
    router presents its own certificate to these mTLS engines, and serves TLS itself (its
    HTTP front too)."""
    fake, port = start_fake_engine(
        engine_id="svc", credentials=server_credentials(pki.service_cert, pki.service_key,
                                                        pki.ca))

    async def resolve(name_port: str) -> list[str]:
        assert name_port == f"{SERVICE}:{port}"
        return [f"127.0.0.1:{port}"]

    async def scenario() -> None:
        config = RouterConfig(engine_dns=f"{SERVICE}:{port}", port=0, health_interval=0.1,
                              tls_cert=pki.cert, tls_key=pki.key, tls_ca=pki.ca, http_port=0)
        router = Router(config, resolver=resolve)
        try:
            await router.start()
            assert await wait_ready(router.pool, 1, timeout=10)
            async with AsyncClient(f"127.0.0.1:{router.port}", timeout=10,
                                   tls_ca=pki.ca) as client:
                result = await client.generate([10, 11], max_tokens=3)
            assert (result.token_ids, result.engine_id) == ([12, 13, 14], "svc")
            url = f"127.0.0.1:{router.http.port}/v1/models"
            verified = ssl.create_default_context(cafile=pki.ca)
            async with httpx.AsyncClient(verify=verified) as http:
                assert (await http.get(f"https://{url}")).status_code == 200
                with pytest.raises(httpx.HTTPError):  # plaintext HTTP is not served
                    await http.get(f"http://{url}")
        finally:
            await router.stop(0)

    try:
        asyncio.run(scenario())
    finally:
        fake.stop(0)


def test_node_client_over_mtls(mtls_fake: FakeEngine, pki: Pki, tmp_path: Path) -> None:
    spec = {"prompt": "Hello", "sampling": {"max_tokens": 8, "temperature": 0}}
    with Client(target(mtls_fake), timeout=10, tls_ca=pki.ca, tls_cert=pki.client_cert,
                tls_key=pki.client_key) as client:
        result = client.generate(spec["prompt"], **spec["sampling"])
    run_node_client_test(target(mtls_fake), spec, result, tmp_path, env={
        "NANOSERVE_TLS_CA": pki.ca, "NANOSERVE_TLS_CERT": pki.client_cert,
        "NANOSERVE_TLS_KEY": pki.client_key})


def wait_serving(client: Client, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while client.health() != "SERVING":
        assert time.monotonic() < deadline, "router never had a routable engine"
        time.sleep(0.1)


def test_real_engine_and_router_all_tls_with_the_clis(tiny_model_dir: Path,
                                                                pki: Pki) -> None:
    pair = ("--tls-cert", pki.cert, "--tls-key", pki.key)
    engine = start_engine(tiny_model_dir, *pair, "--tls-ca", pki.ca)
    router = None
    try:
        with Client(engine.target, timeout=30, tls_ca=pki.ca) as client, \
                pytest.raises(Unavailable):
            client.generate("Hello", max_tokens=1)  # no client certificate
        with Client(engine.target, timeout=30, tls_ca=pki.ca, tls_cert=pki.client_cert,
                    tls_key=pki.client_key) as client:
            direct = client.generate("Hello", max_tokens=4, temperature=0)
        # the exec probe of deploy/k8s/components/tls
        probe = run_cli("health", "--target", engine.target, "--tls-ca", pki.ca,
                        "--tls-cert", pki.client_cert, "--tls-key", pki.client_key)
        assert (probe.returncode, probe.stdout) == (0, "SERVING\n"), probe.stderr
        router = start_router([engine.target], *pair, "--tls-ca", pki.ca,
                              "--health-interval", "0.2")
        with Client(router.target, timeout=30, tls_ca=pki.ca) as client:
            wait_serving(client)
        proc = run_cli("generate", "--target", router.target, "--tls-ca", pki.ca,
                       "--max-tokens", "4", "--temperature", "0", "Hello")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == direct.text + "\n"
        proc = run_cli("generate", "--target", router.target, "--timeout", "10", "Hello")
        assert proc.returncode == 1 and proc.stderr.startswith("error: UNAVAILABLE")
    finally:
        if router is not None:
            router.stop()
        engine.stop()


# ---- certificates rotate in place -------------------------------------------------------


@dataclass
class Leaf:
    """A certificate for localhost and 127.0.0.1, for serving and as a client's."""
    cert: bytes  # PEM
    key: bytes
    der: bytes   # what a handshake is served
    cert_path: str
    key_path: str


def leaf(out: Path, name: str, signer: tuple) -> Leaf:
    _, cert = issue(out, name, signer, (x509.DNSName("localhost"),
                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))))
    crt, key = out / f"{name}.crt", out / f"{name}.key"
    return Leaf(crt.read_bytes(), key.read_bytes(), cert.public_bytes(serialization.Encoding.DER),
                str(crt), str(key))


@dataclass
class Rotation:
    ca: str        # a CA and three of its leaves
    a: Leaf
    b: Leaf
    c: Leaf
    new_ca: str    # the CA a Secret moves to, and its leaf
    new: Leaf


@pytest.fixture(scope="module")
def rotation(tmp_path_factory: pytest.TempPathFactory) -> Rotation:
    out = tmp_path_factory.mktemp("rotation")
    ca, new_ca = issue(out, "ca"), issue(out, "new-ca")
    return Rotation(str(out / "ca.crt"), leaf(out, "a", ca), leaf(out, "b", ca),
                    leaf(out, "c", ca), str(out / "new-ca.crt"), leaf(out, "new", new_ca))


class Secret:
    """tls.crt, tls.key and ca.crt as the kubelet mounts a Secret: links through ..data to
    the current version's directory, which an update (cert-manager's) swaps in one rename."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.versions = itertools.count()
        self.cert, self.key, self.ca = (str(root / name) for name in ("tls.crt", "tls.key",
                                                                      "ca.crt"))

    def put(self, leaf: Leaf, ca: str) -> None:
        version = self.root / f"..v{next(self.versions)}"
        version.mkdir()
        for name, data in (("tls.crt", leaf.cert), ("tls.key", leaf.key),
                           ("ca.crt", Path(ca).read_bytes())):
            (version / name).write_bytes(data)
            if not (self.root / name).is_symlink():
                (self.root / name).symlink_to(f"..data/{name}")
        staged = self.root / "..data_tmp"
        staged.symlink_to(version.name)
        staged.replace(self.root / "..data")


def tls_context(ca: str, client: Leaf | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca)
    context.set_alpn_protocols(["h2", "http/1.1"])  # grpc's servers speak h2
    if client is not None:
        context.load_cert_chain(client.cert_path, client.key_path)
    return context


def served_cert(port: int, ca: str, name: str = "127.0.0.1", client: Leaf | None = None
                ) -> bytes:
    """The certificate (DER) a new TLS connection to 127.0.0.1:port is served, verified
    against ca under `name` (an IP address sends no SNI, a DNS name does)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock, \
            tls_context(ca, client).wrap_socket(sock, server_hostname=name) as tls:
        return tls.getpeercert(binary_form=True)


def test_router_serves_a_rotated_certificate_on_new_connections(
        rotation: Rotation, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The Secret is rewritten: new gRPC (grpc.aio) and HTTPS connections get the new
    certificate, with or without SNI; open ones keep working; a file caught half-written
    keeps the last good certificate."""
    secret = Secret(tmp_path)
    secret.put(rotation.a, rotation.ca)

    def health_status(https: HTTPSConnection) -> int:  # 503: the router has no engine
        https.request("GET", "/health")
        response = https.getresponse()
        response.read()
        return response.status

    async def scenario() -> None:
        router = Router(RouterConfig(engine=["127.0.0.1:1"], port=0, tls_cert=secret.cert,
                                     tls_key=secret.key, http_port=0))
        await router.start()
        ports = (router.port, router.http.port)
        # the connections made first, kept open (gRPC channel, HTTP keep-alive)
        channel = open_channel(f"127.0.0.1:{router.port}", channel_credentials(rotation.ca),
                               aio=True)
        health = health_pb2_grpc.HealthStub(channel)
        https = HTTPSConnection("127.0.0.1", router.http.port, timeout=5,
                                context=tls_context(rotation.ca))

        async def served(name: str = "127.0.0.1") -> list[bytes]:
            return [await asyncio.to_thread(served_cert, port, rotation.ca, name)
                    for port in ports]

        async def answered() -> bool:  # over the connections made first
            reply = await health.Check(health_pb2.HealthCheckRequest(service="liveness"),
                                       timeout=5)
            status = await asyncio.to_thread(health_status, https)
            return reply.status == health_pb2.HealthCheckResponse.SERVING and status == 503

        try:
            assert await served() == [rotation.a.der] * 2
            assert await answered()
            first_https = https.sock

            secret.put(rotation.b, rotation.ca)
            assert await served() == [rotation.b.der] * 2
            assert await served("localhost") == [rotation.b.der] * 2
            assert await answered()
            assert https.sock is first_https  # the same connection, on certificate A
            assert https.sock.getpeercert(binary_form=True) == rotation.a.der

            Path(secret.cert).write_bytes(rotation.c.cert[:len(rotation.c.cert) // 2])
            assert await served() == [rotation.b.der] * 2
            assert "do not load" in caplog.text
            secret.put(rotation.c, rotation.ca)
            assert await served() == [rotation.c.der] * 2
        finally:
            https.close()
            await channel.close()
            await router.stop(0)

    asyncio.run(scenario())


def test_mtls_engine_rotates_its_certificate_and_ca(rotation: Rotation,
                                                    tmp_path: Path) -> None:
    """An engine (grpc's threaded server) requiring client certificates: a rotated pair
    serves new connections, a rotated CA decides which client certificates they take; a
    channel made before goes on."""
    secret = Secret(tmp_path)
    secret.put(rotation.a, rotation.ca)
    fake, port = start_fake_engine(
        engine_id="rotating", credentials=server_credentials(secret.cert, secret.key,
                                                             secret.ca))
    target = f"127.0.0.1:{port}"

    def client(ca: str, leaf: Leaf) -> Client:
        return Client(target, timeout=10, tls_ca=ca, tls_cert=leaf.cert_path,
                      tls_key=leaf.key_path)

    try:
        with client(rotation.ca, rotation.a) as first:
            assert first.generate([5], max_tokens=2).token_ids == [6, 7]
            secret.put(rotation.b, rotation.ca)
            assert served_cert(port, rotation.ca, client=rotation.a) == rotation.b.der
            with client(rotation.ca, rotation.c) as other:
                assert other.generate([1], max_tokens=1).token_ids == [2]

            secret.put(rotation.new, rotation.new_ca)  # the Secret moves to a new CA
            assert served_cert(port, rotation.new_ca, client=rotation.new) == rotation.new.der
            with client(rotation.new_ca, rotation.new) as new:
                assert new.generate([3], max_tokens=1).token_ids == [4]
            with client(rotation.new_ca, rotation.a) as old_client_cert, \
                    pytest.raises(Unavailable):
                old_client_cert.generate([3], max_tokens=1)
            assert first.generate([8], max_tokens=1).token_ids == [9]
    finally:
        fake.stop(0)


def test_router_reaches_a_restarted_engine_with_its_rotated_ca(rotation: Rotation,
                                                               tmp_path: Path) -> None:
    """A channel reconnects with the files it was made with: after the Secret moved to a
    new CA, an engine restarted with it is reached through a new channel."""
    secret = Secret(tmp_path)
    secret.put(rotation.a, rotation.ca)

    def engine(port: int = 0) -> tuple[FakeEngine, int]:
        return start_fake_engine(port, engine_id="restarted", credentials=server_credentials(
            secret.cert, secret.key, secret.ca))

    fake, port = engine()

    async def generate_through(router: Router, ca: str, timeout: float = 10) -> str:
        deadline = time.monotonic() + timeout
        async with AsyncClient(f"127.0.0.1:{router.port}", timeout=5, tls_ca=ca) as client:
            while True:
                try:
                    return (await client.generate([1, 2], max_tokens=2)).engine_id
                except Unavailable:
                    assert time.monotonic() < deadline, "the router never reached the engine"
                    await asyncio.sleep(0.1)

    async def scenario() -> None:
        nonlocal fake
        router = Router(RouterConfig(engine=[f"127.0.0.1:{port}"], port=0, health_interval=0.1,
                                     tls_cert=secret.cert, tls_key=secret.key,
                                     tls_ca=secret.ca, http_port=None))
        try:
            await router.start()
            assert await generate_through(router, rotation.ca) == "restarted"
            secret.put(rotation.new, rotation.new_ca)
            await asyncio.to_thread(fake.stop, 0)
            fake, _ = engine(port)
            assert await generate_through(router, rotation.new_ca) == "restarted"
        finally:
            await router.stop(0)

    try:
        asyncio.run(scenario())
    finally:
        fake.stop(0)
