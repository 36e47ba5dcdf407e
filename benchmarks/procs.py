"""`nanoserve` subprocesses (engines, routers) on loopback ports, for benchmarks and tests,
and what Linux's /proc tells of them (children, resident memory).

Torch-free: it only starts processes and reads their output."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NANOSERVE = [sys.executable, "-m", "clients.cli"]  # the `nanoserve` command of this checkout
ENGINE_READY = "nanoserve engine ready"
ROUTER_READY = "router listening on"
_LISTEN = re.compile(r"listening on (\S+):(\d+)")
_ENGINE_SERVING = re.compile(r"engine (\S+) \(.*\) is serving")


class ServerProc:
    """One `nanoserve ARGS...` subprocess in its own process group; its merged output is
    pumped into `lines` (the last `max_lines`, or all of it), `port` is the one it printed
    as "listening on HOST:PORT"."""

    def __init__(self, name: str, args: list[str], env: dict[str, str] | None = None,
                 max_lines: int | None = None) -> None:
        self.name = name
        self.args = args
        self.env = env
        self.lines: collections.deque[str] = collections.deque(maxlen=max_lines)
        self.port = 0
        self._changed = threading.Condition()
        self.proc = subprocess.Popen(
            [*NANOSERVE, *args], cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        threading.Thread(target=self._pump, daemon=True).start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def restarted(self) -> ServerProc:
        """The same command again, on this one's port (argparse keeps the last --port)."""
        return ServerProc(self.name, [*self.args, "--port", str(self.port)], self.env,
                          self.lines.maxlen)

    def output(self) -> str:
        return "".join(list(self.lines))

    def _pump(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                m = _LISTEN.search(line)
                if m and not self.port:
                    self.port = int(m.group(2))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_until(self, ready: Callable[[list[str]], bool], what: str,
                   timeout: float) -> None:
        """Block until ready(lines) holds; raise with the process's output otherwise."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not ready(list(self.lines)):
                left = deadline - time.monotonic()
                if self.proc.poll() is not None or left <= 0:
                    tail = "".join(list(self.lines)[-60:])
                    raise RuntimeError(f"{self.name} (nanoserve {' '.join(self.args)}) never "
                                       f"got {what} (exit code {self.proc.poll()}):\n{tail}")
                self._changed.wait(min(left, 0.5))

    def http_address(self, timeout: float = 30) -> tuple[str, int]:
        """(scheme, port) of the OpenAI HTTP front, from the line the server prints."""
        line = re.compile(r"OpenAI API on (https?)://\S+:(\d+)")
        self.wait_until(lambda lines: any(line.search(x) for x in lines), "its HTTP line",
                        timeout)
        match = next(m for x in list(self.lines) if (m := line.search(x)))
        return match.group(1), int(match.group(2))

    def wait_for(self, marker: str, timeout: float) -> None:
        self.wait_until(lambda lines: any(marker in x for x in lines), repr(marker), timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Signal the process and wait; SIGKILL if it outlives `timeout`. Its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def start_servers(args: list[str], ready: Callable[[list[str]], bool], what: str,
                  timeout: float, n: int = 1,
                  env: dict[str, str] | Callable[[int], dict[str, str]] | None = None,
                  max_lines: int | None = None,
                  stack: contextlib.ExitStack | None = None) -> list[ServerProc]:
    """`n` copies of `nanoserve ARGS...` started together (copy i with `env`, or env(i) when
    it is a function), returned once ready(lines) holds for each (and stopped when `stack`
    closes); if one never gets there, every copy is stopped and it raises."""
    procs = [ServerProc(f"{args[0]} {i}" if n > 1 else args[0], args,
                        env(i) if callable(env) else env, max_lines) for i in range(n)]
    try:
        for p in procs:
            p.wait_until(ready, what, timeout)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    if stack is not None:
        for p in procs:
            stack.callback(p.stop)
    return procs


def threads_each(n: int) -> dict[str, str]:
    """The env of one of `n` engines sharing the host's cores: a torch thread pool of its
    share each keeps them from fighting ($OMP_NUM_THREADS, if set, wins)."""
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")
            or str(max(1, (os.cpu_count() or 1) // n))}


def start_engines(model: str, *flags: str, n: int = 1, timeout: float = 120,
                  **kw) -> list[ServerProc]:
    """`n` engines on `model`, each on a free port (later flags win: argparse keeps the last)."""
    return start_servers(["engine", "--model", str(model), "--port", "0", *flags],
                         lambda lines: any(ENGINE_READY in x for x in lines), repr(ENGINE_READY),
                         timeout, n, **kw)


def start_routers(engines: list[str], *flags: str, n: int = 1, timeout: float = 120,
                  serving: bool = False, **kw) -> list[ServerProc]:
    """`n` routers over `engines` on free ports (HTTP front too, unless `flags` say otherwise),
    returned once each listens; with `serving`, once every engine serves in each one's pool
    (else the engines join as their health checks pass)."""
    def ready(lines: list[str]) -> bool:
        joined = {m.group(1) for x in lines if (m := _ENGINE_SERVING.search(x))}
        return any(ROUTER_READY in x for x in lines) and (not serving
                                                           or len(joined) >= len(engines))

    args = ["router", *(a for e in engines for a in ("--engine", e)), "--port", "0",
            "--http-port", "0", *flags]
    what = f"all {len(engines)} engines serving" if serving else repr(ROUTER_READY)
    return start_servers(args, ready, what, timeout, n, **kw)


def child_pids(pid: int) -> list[int]:
    """The children of process `pid`; none once it is gone."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found += [int(c) for c in (task / "children").read_text().split()]
    return found


def core_pid(engine_pid: int) -> int:
    """The engine core: the engine's spawned child (not multiprocessing's resource tracker)."""
    children = child_pids(engine_pid)
    for pid in children:
        with contextlib.suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    raise RuntimeError(f"no core process among the engine's children {children}")


def rss_bytes(pid: int) -> int:
    """Resident memory of process `pid`, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time process `pid` has used, every thread."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
