"""TLS for every gRPC hop, with grpcio's own credentials, from PEM files: the servers of the
router and the engines, the router's channels to engines, the clients and the tests.

No CA given means plaintext. A server with a certificate and key speaks TLS; given a CA as
well it requires client certificates signed by that CA (mTLS). A channel given a CA speaks
TLS and verifies the server against it, presenting a certificate and key when it has them.

Certificates rotate in place (cert-manager renews a Secret; the kubelet swaps its mounted
directory at once): servers reread their files on every new handshake and serve the new
ones once they load (`ServerPems`; gRPC through grpcio's dynamic server credentials, HTTPS
through `rotating_server_context`); connections already open keep their certificate. A
channel reads its files when it is made (`PemFiles` tells its owner when to make another).
"""

from __future__ import annotations

import argparse
import logging
import os
import ssl
import threading
from collections.abc import Sequence
from typing import Any

import grpc

from engine_service.common.listen import cannot_listen

log = logging.getLogger("nanoserve.tls")

ChannelOptions = Sequence[tuple[str, Any]]


def add_tls_arguments(parser: argparse.ArgumentParser,
                      cert_help: str = "client certificate, for servers that require one",
                      ca_help: str = "connect over TLS, verifying the server against this CA"
                      ) -> None:
    """--tls-cert, --tls-key and --tls-ca (PEM files; default off), as one group; the help
    texts default to a client's meaning."""
    group = parser.add_argument_group("TLS (PEM files; none given: plaintext)")
    group.add_argument("--tls-cert", default=None, metavar="PEM", help=cert_help)
    group.add_argument("--tls-key", default=None, metavar="PEM",
                       help="the private key of --tls-cert")
    group.add_argument("--tls-ca", default=None, metavar="PEM", help=ca_help)


def check_tls_files(cert: str | None, key: str | None, ca: str | None, *,
                    ca_alone: bool) -> None:
    """ValueError naming the flags when the TLS files do not make a usable setting.

    ca_alone: whether --tls-ca means something without --tls-cert/--tls-key (a router
    verifying engines does; an engine requiring client certificates needs its own pair).
    """
    if (cert is None) != (key is None):
        raise ValueError("give --tls-cert and --tls-key together (a certificate chain and "
                         "its private key, PEM files)")
    if ca is not None and cert is None and not ca_alone:
        raise ValueError("--tls-ca (require client certificates) needs --tls-cert and "
                         "--tls-key")
    for flag, path in (("--tls-cert", cert), ("--tls-key", key), ("--tls-ca", ca)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag} must be a readable PEM file, got {path!r}")


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


class PemFiles:
    """PEM files that may be rewritten under a running process, and whether they changed
    since they were last taken. Compared by content: a rewrite within one timestamp tick
    can keep both size and mtime."""

    def __init__(self, *paths: str | None) -> None:
        self.paths = paths
        self.taken: tuple[bytes | None, ...] | str | None = self.read()

    def read(self) -> tuple[bytes | None, ...] | str:
        """Their bytes now, or why one cannot be read (a path missing mid-rewrite)."""
        try:
            return tuple(_read(path) for path in self.paths)
        except OSError as e:
            return str(e)

    def changed(self) -> bool:
        return self.read() != self.taken

    def names(self) -> str:
        return ", ".join(path for path in self.paths if path is not None)

    def take(self) -> None:
        self.taken = self.read()


def _server_context(cert: str, key: str | None, ca: str | None) -> ssl.SSLContext:
    """An HTTPS server's context: cert/key; client certificates signed by ca required when
    given. Raises ssl.SSLError (an OSError) when the files do not load."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    if ca is not None:
        context.load_verify_locations(ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class ServerPems:
    """A server's certificate, key and optional client CA, reloaded when their files change.

    `refresh()` runs on every new handshake, so it is cheap while nothing changed (three
    small reads). Files that do not load (caught half-written, a key that does not match
    its certificate) keep the last good ones, with a warning, until they change again.
    """

    def __init__(self, cert: str, key: str | None, ca: str | None = None) -> None:
        self.files = PemFiles(cert, key, ca)
        try:
            self.context = _server_context(cert, key, ca)
        except OSError as e:
            raise OSError(f"TLS files {self.files.names()} do not load: {e}") from None
        if isinstance(self.files.taken, str):  # gone again since it loaded: start-up race
            raise OSError(f"TLS files {self.files.names()}: {self.files.taken}")
        self.pems = self.files.taken
        self._lock = threading.Lock()  # grpc calls in from its own threads

    def refresh(self) -> bool:
        """Reread the files; True when they changed and load (then `pems` and `context` are
        the new ones)."""
        with self._lock:
            now = self.files.read()
            if now == self.files.taken:
                return False
            self.files.taken = now
            try:
                if isinstance(now, str):
                    raise OSError(now)
                context = _server_context(*self.files.paths)
            except OSError as e:
                log.warning("TLS files %s changed but do not load (%s); still serving the "
                            "previous certificate", self.files.names(), e)
                return False
            if self.files.read() != now:  # rewritten while it loaded: look again next time
                self.files.taken = None
                return False
            self.pems, self.context = now, context
        log.info("TLS certificate reloaded from %s", self.files.paths[0])
        return True


def server_credentials(cert: str | None, key: str | None,
                       ca: str | None = None) -> grpc.ServerCredentials | None:
    """TLS with cert/key (None without them: plaintext); with ca, clients must present a
    certificate signed by it. The files are reread before every new connection's handshake
    (rotation); OSError naming them when they do not load at start."""
    if cert is None or key is None:
        return None
    pems = ServerPems(cert, key, ca)

    def config() -> grpc.ServerCertificateConfiguration:
        cert_pem, key_pem, ca_pem = pems.pems
        return grpc.ssl_server_certificate_configuration([(key_pem, cert_pem)], ca_pem)

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        # grpc asks before each new connection's handshake; None keeps what it has
        return config() if pems.refresh() else None

    return grpc.dynamic_ssl_server_credentials(config(), fetch,
                                               require_client_authentication=ca is not None)


def rotating_server_context(cert: str, key: str | None,
                            ca: str | None = None) -> ssl.SSLContext:
    """The SSLContext for an asyncio (uvicorn) HTTPS server, serving each new connection the
    files as they are then: its sni_callback, which OpenSSL runs on every ClientHello (with
    or without SNI), moves the connection to the newest context that loaded."""
    pems = ServerPems(cert, key, ca)
    served = pems.context

    def newest(conn: ssl.SSLObject, server_name: str | None, _: ssl.SSLContext) -> None:
        pems.refresh()
        if pems.context is not served:
            conn.context = pems.context

    served.sni_callback = newest
    return served


def channel_credentials(ca: str | None, cert: str | None = None,
                        key: str | None = None) -> grpc.ChannelCredentials | None:
    """TLS verifying the server against ca, presenting cert/key when given (for servers
    that require client certificates); None without ca: plaintext."""
    if ca is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=_read(ca), private_key=_read(key),
                                        certificate_chain=_read(cert))


def add_port(server: grpc.Server | grpc.aio.Server, address: str,
             credentials: grpc.ServerCredentials | None) -> int:
    """Bind address, over TLS when there are credentials; returns the bound port. OSError
    naming the address when it cannot (build the server with grpc.so_reuseport 0, or a
    second server shares a taken port without a word)."""
    try:
        port = (server.add_insecure_port(address) if credentials is None
                else server.add_secure_port(address, credentials))
    except RuntimeError:  # grpc's way of saying the bind failed
        port = 0
    if port == 0:
        raise cannot_listen(address, "the port is taken or the address is not local")
    return port


def open_channel(target: str, credentials: grpc.ChannelCredentials | None,
                 options: ChannelOptions = (), *, aio: bool = False,
                 interceptors: Sequence[Any] = ()) -> Any:
    """A grpc (aio=False) or grpc.aio channel to target, secure when there are credentials;
    `interceptors` (grpc.aio client interceptors) for aio channels only."""
    module = grpc.aio if aio else grpc
    extra = {"interceptors": list(interceptors)} if interceptors else {}
    if credentials is None:
        return module.insecure_channel(target, options=list(options), **extra)
    return module.secure_channel(target, credentials, options=list(options), **extra)
