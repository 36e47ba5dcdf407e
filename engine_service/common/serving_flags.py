"""The flags `nanoserve engine` and `nanoserve router` share for their OpenAI HTTP front and
API key. Light at import (no web framework), so building the CLI parsers stays fast."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any


def port_or_off(value: str) -> int | None:
    """argparse type of --http-port: a port in [0, 65535] (0: any free one) or "off"."""
    if value.lower() == "off":
        return None
    if not value.isdigit() or not 0 <= int(value) < 65536:
        raise argparse.ArgumentTypeError(
            f"must be a port in [0, 65535] (0 = any free port) or 'off', got {value!r}")
    return int(value)


def dataclass_from_args(cls: Any, args: argparse.Namespace) -> Any:
    """The dataclass `cls` from the parsed flags named as its fields (absent ones: defaults)."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


@dataclass
class ServingOptions:
    """The HTTP front and API key of one server: the shared flags in snake_case, plus the
    PEM files its HTTP front serves with (the server's --tls-* flags)."""

    http_port: int | None = None  # None: no HTTP front; 0: any free port
    served_model_name: str | None = None  # None: the model directory's name
    api_key: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None  # require client certificates signed by it

    def __post_init__(self) -> None:
        port = self.http_port
        if port is not None and not (isinstance(port, int) and 0 <= port < 65536):
            raise ValueError(f"http-port must be in [0, 65535] (0 = any free port) or off, "
                             f"got {port!r}")
        for flag, value in (("served-model-name", self.served_model_name),
                            ("api-key", self.api_key)):
            if value is not None and not value.strip():
                raise ValueError(f"{flag} must be a non-empty string, got {value!r}")


def add_serving_arguments(parser: argparse.ArgumentParser, http_port: int | None,
                          model_name_help: str, api_key_help: str = "") -> None:
    """--http-port (default `http_port`, None = off), --served-model-name, --api-key."""
    group = parser.add_argument_group("OpenAI-compatible HTTP API and API key")
    group.add_argument("--http-port", type=port_or_off, default=http_port, metavar="PORT",
                       help="serve the OpenAI API (/v1/completions, /v1/chat/completions, "
                            "/v1/models, /health, /metrics) on this port, over TLS with "
                            "--tls-cert; 0 = any free port, 'off' (None) = no HTTP server "
                            "(default: %(default)s)")
    group.add_argument("--served-model-name", default=None, metavar="NAME",
                       help=f"the model name clients send and see; {model_name_help}")
    group.add_argument("--api-key", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on HTTP and metadata "
                            "'authorization: Bearer KEY' on gRPC (health checks and /metrics "
                            f"stay open); None: no key{api_key_help}")
