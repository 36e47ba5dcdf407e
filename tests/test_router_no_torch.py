"""The router pod has no torch (nor transformers, safetensors or the model code): importing,
`nanoserve router --help` and serving a request must work with those made unimportable."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenizers import Tokenizer, models, pre_tokenizers

from nanoserve.v1 import nanoserve_pb2 as pb
from nanoserve.v1 import nanoserve_pb2_grpc as pb_grpc
from tests.fake_engine import FakeBehavior, start_fake_engine

REPO = Path(__file__).resolve().parent.parent

BLOCKER = textwrap.dedent("""
    import sys
    BLOCKED = {"torch", "transformers", "safetensors", "models", "triton"}

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is not installed in the router pod (test)")
            return None

    sys.meta_path.insert(0, Blocker())
""")


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + textwrap.dedent(code)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def write_word_tokenizer(directory: Path, words: list[str]) -> Path:
    """A whitespace word-level tokenizer: word i has id i."""
    directory.mkdir(parents=True)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({}))
    return directory


def test_blocker_really_blocks_torch():
    # Guards the test itself: without this, a broken blocker would let every test pass.
    result = run_python("import torch")
    assert result.returncode != 0
    assert "not installed in the router pod" in result.stderr


def test_router_imports_and_help_without_torch():
    result = run_python("""
        import router, router.cli, router.config, router.engine_pool, router.metrics
        import router.policy, router.prefix_index, router.server, router.tokenizer_source
        import router.admission
        import engine_service.common.tokenizer  # what the router loads for text prompts
        assert not any(m.split(".")[0] in BLOCKED for m in sys.modules)
        # Of engine_service, the router imports only the torch-free `common` subpackage.
        shared = {m for m in sys.modules if m.startswith("engine_service")}
        outside = shared - {"engine_service"} - {m for m in shared
                                                 if m.startswith("engine_service.common")}
        assert not outside, outside
        from clients.cli import main
        try:
            code = main(["router", "--help"])
        except SystemExit as e:
            code = e.code
        print("EXIT", code)
    """)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "EXIT 0" in out
    for flag in ("--engine", "--engine-dns", "--dns-interval", "--policy", "--tokenizer",
                 "--cache-weight", "--load-guard-ratio", "--load-guard-min",
                 "--health-interval", "--metrics-port", "--log-level",
                 "--stream-progress-timeout", "--max-concurrent-requests",
                 "--max-queued-requests", "--queue-timeout", "--http-port",
                 "--served-model-name", "--api-key"):
        assert flag in out


def test_python_dash_m_clients_cli_router_help_without_torch():
    result = run_python("""
        import runpy
        sys.argv = ["nanoserve", "router", "--help"]
        try:
            runpy.run_module("clients.cli", run_name="__main__")
        except SystemExit as e:
            print("EXIT", e.code)
    """)
    assert result.returncode == 0, result.stderr
    assert "EXIT 0" in result.stdout and "--engine-dns" in result.stdout


def test_router_serves_text_without_torch(tmp_path):
    # A fake engine (torch-free itself) hands out a word-level tokenizer; the router fetches
    # it, tokenizes the text and forwards ids. Expected ids follow from the vocab below.
    tok_dir = write_word_tokenizer(tmp_path / "tok", ["[UNK]", "hello", "router", "pod"])
    result = run_python(f"""
        import asyncio
        sys.path.insert(0, {str(REPO / "tests")!r})
        import grpc
        from fake_engine import FakeBehavior, start_fake_engine
        from nanoserve.v1 import nanoserve_pb2 as pb, nanoserve_pb2_grpc as pb_grpc
        from router.config import RouterConfig
        from router.server import Router
        from router_helpers import wait_ready

        async def main():
            fake, port = start_fake_engine(
                engine_id="e0", behavior=FakeBehavior(tokenizer_dir={str(tok_dir)!r}))
            router = Router(RouterConfig(engine=[f"127.0.0.1:{{port}}"], port=0,
                                         health_interval=0.1, http_port=None))
            await router.start()
            try:
                assert await wait_ready(router.pool, 1)
                async with grpc.aio.insecure_channel(f"127.0.0.1:{{router.port}}") as ch:
                    r = await pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                        text="hello router pod", sampling=pb.SamplingParams(max_tokens=2)),
                        timeout=10)
                print("SENT", list(fake.requests[0].token_ids.ids))
                print("GOT", list(r.token_ids))
            finally:
                await router.stop(0)
                fake.stop(0)
            assert not any(m.split(".")[0] in BLOCKED for m in sys.modules)

        asyncio.run(main())
    """)
    assert result.returncode == 0, result.stderr
    assert "SENT [1, 2, 3]" in result.stdout
    assert "GOT [4, 5]" in result.stdout


def test_nanoserve_router_command_serves_and_stops_on_sigterm(tmp_path):
    # `nanoserve router` as its own process (torch blocked) in front of a fake engine that
    # runs in this process; a text request goes through; SIGTERM ends it with status 0.
    tok_dir = write_word_tokenizer(tmp_path / "tok", ["[UNK]", "hi", "there"])
    fake, engine_port = start_fake_engine(engine_id="e0",
                                          behavior=FakeBehavior(tokenizer_dir=str(tok_dir)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = BLOCKER + textwrap.dedent(f"""
        from clients.cli import main
        sys.exit(main(["router", "--engine", "127.0.0.1:{engine_port}", "--port", "{port}",
                       "--http-port", "0", "--health-interval", "0.1", "--log-level", "debug"]))
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 30
            while True:
                assert proc.poll() is None, proc.communicate()[1]
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                except grpc.RpcError:
                    status = None
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
                assert time.monotonic() < deadline, "router never became SERVING"
                time.sleep(0.1)
            reply = pb_grpc.GenerationStub(channel).Generate(
                pb.GenerateRequest(text="hi there", sampling=pb.SamplingParams(max_tokens=2)),
                timeout=10)
        assert list(fake.requests[0].token_ids.ids) == [1, 2]
        assert list(reply.token_ids) == [3, 4]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "route request=" in err  # the debug line of the routing decision
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        fake.stop(0)
