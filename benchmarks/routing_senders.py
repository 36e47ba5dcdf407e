"""How `nanoserve bench routing` sends one turn: a `Send` takes a prompt's token ids and
returns the reply, over a gRPC stream (a router or an engine) or an OpenAI HTTP stream (an
engine's, a router's or a gateway's /v1/completions), the prompt as token ids or as its
text. Every sender asks for the same thing: greedy, `ignore_eos`, `max_tokens` new tokens.
Also the engines' own request counts, read from their Prometheus /metrics, and the token
ids whose text reads back as the same ids (for workloads sent as text).

Torch-free; aiohttp carries the HTTP streams (`sse_events`, which bench serve reads too).
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import orjson

# vLLM's finished-request counter (engine_service/metrics.py), one series per finish reason;
# an engine counts every request it ends, whoever routed it there.
REQUEST_COUNTER = "vllm:request_success_total"


@dataclass
class Reply:
    token_ids: list[int]
    ttft: float  # seconds from the send to the first chunk with tokens or text
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    engine_id: str  # "" when the transport does not say (OpenAI HTTP)


Send = Callable[[list[int]], Awaitable[Reply]]


def grpc_sender(client, max_tokens: int, timeout: float) -> Send:
    """Turns as `Stream` calls through `client` (a clients.AsyncClient)."""

    async def send(prompt: list[int]) -> Reply:
        start, ttft, reply, usage, engine_id = time.perf_counter(), None, [], None, ""
        async for chunk in client.stream(prompt, max_tokens=max_tokens, temperature=0.0,
                                         ignore_eos=True, timeout=timeout):
            if chunk.token_ids and ttft is None:
                ttft = time.perf_counter() - start
            reply += chunk.token_ids
            usage = chunk.usage or usage
            engine_id = chunk.engine_id or engine_id
        if ttft is None or usage is None:
            raise RuntimeError(f"a stream ended without {'tokens' if ttft is None else 'usage'}")
        return Reply(reply, ttft, usage.prompt_tokens, usage.cached_prompt_tokens,
                     usage.completion_tokens, engine_id)

    return send


async def sse_events(response) -> AsyncIterator[list[dict]]:
    """The JSON data of an aiohttp response's server-sent events, one list per read that
    completes any (events without data, such as comments, and `[DONE]` are left out)."""
    rest = b""
    async for data in response.content.iter_any():
        *events, rest = (rest + data).split(b"\n\n")
        found = [orjson.loads(payload) for event in events
                 if (payload := event.partition(b"data:")[2].strip()) not in (b"", b"[DONE]")]
        if found:
            yield found


def http_sender(session, model: str, max_tokens: int,
                decode: Callable[[list[int]], str] | None = None) -> Send:
    """Turns as streaming POST /v1/completions through `session` (an aiohttp.ClientSession
    with the server's base URL): the prompt as token ids, or as `decode(ids)` (for servers
    that take text only). The reply's token ids come from vLLM's `return_token_ids`: the next
    turn's prompt is built from them, as the gRPC route builds it."""

    async def send(prompt: list[int]) -> Reply:
        body = {"model": model, "prompt": decode(prompt) if decode else prompt,
                "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True}
        start, ttft, reply, usage = time.perf_counter(), None, [], None
        async with session.post("/v1/completions", json=body) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")
                raise RuntimeError(f"HTTP {response.status}: {text[:300]}")
            async for events in sse_events(response):
                for event in events:
                    if "error" in event:
                        raise RuntimeError(f"stream error: {event['error']}")
                    for choice in event.get("choices") or []:
                        ids = choice.get("token_ids") or []
                        if ttft is None and (ids or choice.get("text")):
                            ttft = time.perf_counter() - start
                        reply += ids
                    usage = event.get("usage") or usage
        if ttft is None or usage is None:
            raise RuntimeError(f"a stream ended without {'tokens' if ttft is None else 'usage'}")
        if len(reply) != usage["completion_tokens"]:
            raise RuntimeError(f"the stream carried {len(reply)} of {usage['completion_tokens']}"
                               " reply token ids (return_token_ids ignored on the way?): the "
                               "next turn cannot be built")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return Reply(reply, ttft, usage["prompt_tokens"], cached, usage["completion_tokens"], "")

    return send


def _get(url: str, timeout: float) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # raises on HTTP errors
        return response.read()


def served_model(base_url: str, timeout: float = 30) -> str:
    """The model name an OpenAI front ("http://HOST:PORT") serves (GET /v1/models)."""
    return orjson.loads(_get(f"{base_url}/v1/models", timeout))["data"][0]["id"]


def requests_served(base_url: str, timeout: float = 30) -> int:
    """Requests the engine whose HTTP front is `base_url` has finished, from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = _get(f"{base_url}/metrics", timeout).decode()
    return int(sum(s.value for family in text_string_to_metric_families(text)
                   for s in family.samples if s.name == REQUEST_COUNTER))


def text_safe_tokens(tokenizer_json: str) -> list[int]:
    """Token ids that read as a space and a word and encode back to themselves alone: a
    sequence of them decodes to text that encodes back to the same ids, so a workload drawn
    from them reaches an engine as the same tokens whether it is sent as ids or as text."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    safe = []
    for t in range(tok.get_vocab_size()):
        text = tok.decode([t])
        if _WORD.fullmatch(text) and tok.encode(text, add_special_tokens=False).ids == [t]:
            safe.append(t)
    return safe


_WORD = re.compile(r" [A-Za-z]+")
