"""SGLang's model gateway (pip `sglang-router`) in front of nanoserve engines' OpenAI HTTP
fronts, as SGLang workers, so `nanoserve bench routing` can compare it with nanoserve's router.
Its `cache_aware` policy matches prompt TEXT, and it refuses token-id prompts (422): turns
through it must be text. Torch-free: it only starts the gateway and polls it over HTTP.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

PACKAGE = "sglang-router"
ENV = "NANOSERVE_SGLANG_ROUTER"  # a Python that has the package, or its `smg` script
# `make venv` installs it apart from the project's packages, in .venv/sglang.
FALLBACK_PYTHON = Path(__file__).resolve().parent.parent / ".venv" / "sglang" / "bin" / "python"
INSTALL = f"python3 -m venv .venv/sglang && .venv/sglang/bin/pip install {PACKAGE}==0.3.2"
PORT_TRIES = 3  # free ports are picked, then bound by the gateway: another process may win
STOP_TIMEOUT_S = 30
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # its log colours, even into a file
_VERSION_PY = "import sglang_router.launch_router, sglang_router.version as v; print(v.__version__)"


class GatewayUnavailable(RuntimeError):
    """SGLang's gateway cannot route to the engines here; str(e) says why."""


class _PortTaken(Exception):
    pass


# ---- which gateway ----------------------------------------------------------------------

def _is_python(exe: str) -> bool:
    return Path(exe).name.startswith("python")


def _installed_here() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


def _executable() -> str:
    """$NANOSERVE_SGLANG_ROUTER, else this Python if it has the package, else the venv
    INSTALL makes."""
    named = os.environ.get(ENV)
    if named:
        exe = shutil.which(named)
        if exe is None:
            raise GatewayUnavailable(f"{ENV}={named!r} names no executable file; point it at a "
                                     f"Python that has {PACKAGE} installed or at its smg script")
        return exe
    if _installed_here():
        return sys.executable
    if FALLBACK_PYTHON.exists():
        return str(FALLBACK_PYTHON)
    raise GatewayUnavailable(f"SGLang's gateway (pip package {PACKAGE}) is not installed: not "
                             f"in {sys.executable}, no {FALLBACK_PYTHON}, and {ENV} is not set; "
                             f"install it apart from the project venv with `{INSTALL}`")


def _version(exe: str) -> str:
    """The gateway's version as `exe` reports it; GatewayUnavailable if it cannot run it."""
    cmd = [exe, "-c", _VERSION_PY] if _is_python(exe) else [exe, "--version"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise GatewayUnavailable(f"cannot run {exe} to find SGLang's gateway: {e}") from None
    if out.returncode != 0 or not out.stdout.strip():
        said = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise GatewayUnavailable(f"{exe} cannot start SGLang's gateway (pip package {PACKAGE} "
                                 f"missing or broken there): {said}")
    return out.stdout.split()[-1]  # "0.3.2", or "sgl-model-gateway 0.3.2" from smg


def find_gateway() -> tuple[list[str], str]:
    """(the command that launches the gateway, its version)."""
    exe = _executable()
    version = _version(exe)
    # A Python runs the package's launcher module; anything else is taken for its smg script.
    command = [exe, "-m", "sglang_router.launch_router"] if _is_python(exe) else [exe, "launch"]
    return command, version


# ---- the gateway process ----------------------------------------------------------------

def _worker_url(target: str) -> str:
    """"host:port" or a URL, as the gateway lists the worker: a scheme, no trailing slash."""
    return (target if "://" in target else f"http://{target}").rstrip("/")


def _free_ports(n: int) -> list[int]:
    """`n` distinct ports free on loopback now (the gateway refuses --port 0)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _gateway_args(port: int, metrics_port: int, workers: list[str]) -> list[str]:
    # Its Prometheus exporter binds a port of its own (29000 by default): a free one here.
    return ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
            "--policy", "cache_aware", "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(metrics_port), "--log-level", "warn"]


class _Gateway:
    """One gateway process in its own session, its output in a temporary file."""

    def __init__(self, command: list[str], stack: contextlib.ExitStack) -> None:
        log = tempfile.NamedTemporaryFile(prefix="sglang-gateway-", suffix=".log")  # noqa: SIM115
        self.log = stack.enter_context(log)  # deleted once the callback below has stopped it
        self.command = command
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        stack.callback(self.stop)

    def output(self, limit: int = 4000) -> str:
        return _ANSI.sub("", Path(self.log.name).read_bytes().decode(errors="replace"))[-limit:]

    def stop(self) -> None:
        """SIGTERM to its process group; SIGKILL if it outlives STOP_TIMEOUT_S."""
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def healthy_workers(self, port: int) -> set[str] | None:
        """URLs of the workers it lists as healthy; None while it does not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/workers", timeout=2) as r:
                listing = json.load(r)
        except (OSError, ValueError):  # refused or reset while starting, or not JSON yet
            return None
        return {w["url"].rstrip("/") for w in listing.get("workers", []) if w.get("is_healthy")}

    def wait_ready(self, port: int, workers: list[str], deadline: float,
                   timeout: float) -> None:
        """Until every worker is healthy in it; _PortTaken if it lost a port race."""
        healthy: set[str] | None = None
        while True:
            code = self.proc.poll()
            if code is not None:
                out = self.output()
                if "Address already in use" in out:
                    raise _PortTaken
                raise GatewayUnavailable(f"SGLang's gateway ({' '.join(self.command[:3])}) "
                                         f"exited with code {code} while starting:\n{out}")
            healthy = self.healthy_workers(port)
            if healthy is not None and set(workers) <= healthy:
                return
            if time.monotonic() > deadline:
                state = ("never answered GET /workers" if healthy is None else
                         f"listed {sorted(healthy)} healthy of {workers}")
                raise GatewayUnavailable(f"SGLang's gateway on 127.0.0.1:{port} {state} within "
                                         f"{timeout:g} s; its output:\n{self.output()}")
            time.sleep(0.1)


def start_gateway(engine_http_urls: list[str], stack: contextlib.ExitStack,
                  start_timeout: float) -> str:
    """SGLang's gateway (`--policy cache_aware`, default thresholds) over the engines' OpenAI
    HTTP fronts ("host:port" or URLs), stopped when `stack` closes; returns "127.0.0.1:PORT"
    once every engine is a healthy worker in it. GatewayUnavailable says why it cannot."""
    if not engine_http_urls:
        raise ValueError("start_gateway needs at least one engine HTTP address")
    command, _ = find_gateway()
    workers = [_worker_url(u) for u in engine_http_urls]
    deadline = time.monotonic() + start_timeout
    for _ in range(PORT_TRIES):
        port, metrics_port = _free_ports(2)
        gateway = _Gateway(command + _gateway_args(port, metrics_port, workers), stack)
        try:
            gateway.wait_ready(port, workers, deadline, start_timeout)
        except _PortTaken:
            continue
        except GatewayUnavailable:
            gateway.stop()  # now, not when the caller's stack closes
            raise
        return f"127.0.0.1:{port}"
    raise GatewayUnavailable(f"SGLang's gateway lost its ports to other processes "
                             f"{PORT_TRIES} times in a row")


def gateway_version() -> str:
    """The version of the gateway start_gateway would run (for a benchmark's record)."""
    return find_gateway()[1]
