"""The `nanoserve` console script: dispatches to each subcommand's owner module.

Owner modules are imported by name, and only the chosen one, so `nanoserve router` never
imports torch and a missing optional module breaks only its own subcommand. Each owner
exposes `add_arguments(parser: argparse.ArgumentParser) -> None` and
`main(args: argparse.Namespace) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

# name -> (owner module, one-line help); static so `nanoserve --help` imports nothing.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "engine": ("engine_service.cli", "serve a model: one engine service (gRPC)"),
    "router": ("router.cli", "route requests over engine services by cached prefix and load"),
    "generate": ("clients.generate_cli", "send one prompt to an engine or router, print answer"),
    "health": ("clients.health_cli", "check an engine's or router's health (exit 0: SERVING)"),
    "tiny-model": ("models.tiny_model", "write a small random Qwen3 checkpoint and tokenizer"),
    "bench": ("benchmarks.cli", "run the throughput, latency, routing and soak benchmarks"),
}


def package_version() -> str:
    """The installed package's version; pyproject.toml's when run from a checkout that was
    never installed."""
    try:
        return importlib.metadata.version("nanoserve")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        found = re.search(r'^version = "([^"]+)"', pyproject.read_text(), re.M)
        return found.group(1) if found else "unknown"


def build_parser(chosen: str | None) -> tuple[argparse.ArgumentParser, ModuleType | None]:
    """The top-level parser; only `chosen`'s owner module is imported to fill its parser."""
    parser = argparse.ArgumentParser(
        prog="nanoserve", description="nanoserve: LLM serving over gRPC.")
    parser.add_argument("--version", action="version", version=f"nanoserve {package_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    owner: ModuleType | None = None
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            owner = importlib.import_module(module_name)
            owner.add_arguments(sub)
    return parser, owner


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    try:
        parser, owner = build_parser(chosen)
    except ImportError as e:
        print(f"error: nanoserve {chosen} is not available here: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if owner is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(owner.main(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
