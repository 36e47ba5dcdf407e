"""TLS for every gRPC hop, with grpcio's own credentials, from PEM files: the servers of the
router and the engines, the router's channels to engines, the clients and the tests.

No CA given means plaintext. A server with a certificate and key speaks TLS; given a CA as
well it requires client certificates signed by that CA (mTLS). A channel given a CA speaks
TLS and verifies the server against it, presenting a certificate and key when it has them.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

import grpc

from engine_service.common.listen import cannot_listen

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


def server_credentials(cert: str | None, key: str | None,
                       ca: str | None = None) -> grpc.ServerCredentials | None:
    """TLS with cert/key (None without them: plaintext); with ca, clients must present a
    certificate signed by it."""
    if cert is None or key is None:
        return None
    return grpc.ssl_server_credentials([(_read(key), _read(cert))],
                                       root_certificates=_read(ca),
                                       require_client_auth=ca is not None)


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
