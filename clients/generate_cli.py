"""`nanoserve generate`: send one prompt to an engine or a router and print the answer.

The answer goes to stdout (chunk by chunk with --stream); a one-line usage summary goes to
stderr so `nanoserve generate ... > out.txt` captures only the text.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from clients.client import Client, Prompt, Usage
from clients.errors import NanoserveError
from engine_service.common.tls import add_tls_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", metavar="PROMPT", help="the prompt text ('-' reads stdin)")
    parser.add_argument("--target", required=True, metavar="HOST:PORT",
                        help="router or engine address")
    parser.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--chat", action="store_true",
                      help="send PROMPT as one user chat message (the chat template applies)")
    kind.add_argument("--token-ids", action="store_true",
                      help="PROMPT is token ids separated by commas or spaces")
    parser.add_argument("--max-tokens", type=int, help="most tokens to generate (server: 16)")
    parser.add_argument("--min-tokens", type=int)
    parser.add_argument("--temperature", type=float, help="0 = greedy (server default: 1.0)")
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--min-p", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", metavar="S",
                        help="a stop string (repeat the flag for several)")
    parser.add_argument("--ignore-eos", action="store_true", default=None)
    parser.add_argument("--diffusion", type=json.loads, metavar="JSON",
                        help="a diffusion model's decoding: DiffusionParams' fields as a JSON "
                             "object, e.g. '{\"gen_length\": 64, \"steps\": 64}'")
    parser.add_argument("--request-id")
    parser.add_argument("--timeout", type=float, metavar="SECONDS", help="deadline of the call")
    parser.add_argument("--api-key", metavar="KEY",
                        help="for servers run with --api-key (sent as 'authorization: Bearer')")
    add_tls_arguments(parser)


def _prompt(args: argparse.Namespace) -> Prompt:
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.token_ids:
        return [int(t) for t in text.replace(",", " ").split()]
    if args.chat:
        return [{"role": "user", "content": text}]
    return text


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    names = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
             "stop", "ignore_eos", "diffusion", "request_id", "timeout")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _usage_line(finish_reason: str | None, usage: Usage | None, engine_id: str) -> str:
    counts = ("" if usage is None else f" prompt={usage.prompt_tokens} "
              f"completion={usage.completion_tokens} cached={usage.cached_prompt_tokens}")
    if usage is not None and usage.num_forward_passes:
        counts += f" passes={usage.num_forward_passes}"
    return f"[finish={finish_reason}{counts} engine={engine_id}]"


def main(args: argparse.Namespace) -> int:
    try:
        prompt = _prompt(args)
    except ValueError as e:
        print(f"error: --token-ids: {e}", file=sys.stderr)
        return 2
    try:
        with Client(args.target, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                    tls_key=args.tls_key, api_key=args.api_key) as client:
            if args.stream:
                summary = _stream(client, prompt, _sampling(args))
            else:
                result = client.generate(prompt, **_sampling(args))
                sys.stdout.write(result.text)
                summary = _usage_line(result.finish_reason, result.usage, result.engine_id)
    except NanoserveError as e:
        print(f"error: {e.code.name}: {e.details}", file=sys.stderr)
        return 1
    except (TypeError, ValueError) as e:  # refused before sending (e.g. a negative count)
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(summary, file=sys.stderr)
    return 0


def _stream(client: Client, prompt: Prompt, sampling: dict[str, Any]) -> str:
    """Print each chunk's text as it arrives; returns the usage line."""
    finish, usage, engine_id, printed = None, None, "", False
    try:
        for chunk in client.stream(prompt, **sampling):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            printed = printed or bool(chunk.text)
            finish, engine_id = chunk.finish_reason or finish, chunk.engine_id or engine_id
            usage = chunk.usage or usage
    except NanoserveError:
        if printed:  # end the partial answer's line before the error message
            print(flush=True)
        raise
    return _usage_line(finish, usage, engine_id)
