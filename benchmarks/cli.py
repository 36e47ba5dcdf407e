"""`nanoserve bench offline|serve|routing|soak|diffusion` — benchmarks with progress bars;
figures go to the run log of benchmarks/results.py."""

from __future__ import annotations

import argparse
import importlib
import sys

_KINDS = {
    "offline": ("benchmarks.offline", "offline throughput with the LLM class"),
    "serve": ("benchmarks.serve", "concurrent streams against a running engine or router"),
    "routing": ("benchmarks.routing", "multi-tenant workload under each routing policy"),
    "soak": ("benchmarks.soak", "mixed load with cancels, bad requests and engine restarts"),
    "diffusion": ("benchmarks.diffusion_bench",
                  "diffusion LLM decoding: the plain reference loop and the engine's variants"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # metavar: a bare `nanoserve bench` names the benchmarks, not the internal dest
    sub = parser.add_subparsers(dest="bench_kind", required=True, title="benchmarks",
                                metavar="{" + ",".join(_KINDS) + "}")
    # Only the chosen kind's module is imported: `bench serve`, `routing` and `soak` must run
    # where torch is absent (a router pod), `bench offline` needs it.
    chosen = next((a for a in sys.argv[1:] if a in _KINDS), None)
    for kind, (module, help_text) in _KINDS.items():
        p = sub.add_parser(kind, help=help_text)
        if kind == chosen:
            importlib.import_module(module).add_arguments(p)
        p.set_defaults(bench_module=module)


def main(args: argparse.Namespace) -> int:
    return importlib.import_module(args.bench_module).main(args)
