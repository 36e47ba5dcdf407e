"""A port that is taken fails a server at once, with a message naming it: the gRPC, metrics
and HTTP ports of engines and routers, and a second `make run` (deploy/local-run.sh)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.procs import ROOT

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def held_port() -> Iterator[int]:
    """A listening socket's port, with SO_REUSEPORT as a grpc server sets it by default: a
    server that sets it too would share the port without a word."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_fails_naming(command: list[str], port: int, env: dict | None = None) -> str:
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60,
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"still running after 60 s on a taken port {port}: {e.output!r}")
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert str(port) in proc.stderr, proc.stderr
    return proc.stderr


def nanoserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "clients.cli", *args]


@pytest.mark.parametrize("flag", ["--port", "--metrics-port", "--http-port"])
def test_router_on_a_taken_port_exits_naming_it(held_port: int, flag: str) -> None:
    ports = {"--port": "0", flag: str(held_port)}
    err = assert_fails_naming(nanoserve("router", "--engine", f"127.0.0.1:{free_port()}",
                                        *(a for kv in ports.items() for a in kv)), held_port)
    assert f"cannot listen on 127.0.0.1:{held_port}" in err


@pytest.mark.parametrize("flag", ["--port", "--metrics-port", "--http-port"])
def test_engine_on_a_taken_port_exits_naming_it(tiny_model_dir: Path, held_port: int,
                                                flag: str) -> None:
    ports = {"--port": "0", flag: str(held_port)}
    err = assert_fails_naming(nanoserve("engine", "--model", str(tiny_model_dir), "--device",
                                        "cpu", *(a for kv in ports.items() for a in kv)),
                              held_port)
    assert f"cannot listen on 127.0.0.1:{held_port}" in err
    assert "nanoserve engine ready" not in err


def test_second_make_run_fails_before_starting_anything(tmp_path: Path, held_port: int) -> None:
    env = {"BIN": str(Path(sys.executable).parent), "RUN_DIR": str(tmp_path), "RUN_ONCE": "1",
           "ROUTER_PORT": str(held_port), "ENGINE_PORTS": f"{free_port()} {free_port()}"}
    err = assert_fails_naming(["bash", "deploy/local-run.sh"], held_port, env)
    assert f"port {held_port} on 127.0.0.1 is taken" in err
    assert not (tmp_path / "tiny").exists()  # failed before writing the model or serving
