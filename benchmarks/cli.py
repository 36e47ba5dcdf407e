"""`nanoserve bench offline|serve|routing` — benchmarks with progress bars; figures go to
benchmarks/RESULTS.md."""

from __future__ import annotations

import argparse
import importlib

_KINDS = {
    "offline": ("benchmarks.offline", "offline throughput with the LLM class"),
    "serve": ("benchmarks.serve", "concurrent streams against a running engine or router"),
    "routing": ("benchmarks.routing", "multi-tenant workload under each routing policy"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_kind", required=True)
    for kind, (module, help_text) in _KINDS.items():
        p = sub.add_parser(kind, help=help_text)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(bench_module=module)


def main(args: argparse.Namespace) -> int:
    return importlib.import_module(args.bench_module).main(args)
