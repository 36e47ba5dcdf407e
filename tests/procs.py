"""Start real `nanoserve` processes (engines, routers) on loopback ports for tests."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from benchmarks.procs import ROOT, ServerProc


def start_server(args: list[str], ready_marker: str, timeout: float = 120,
                 env: dict | None = None) -> ServerProc:
    """Run `nanoserve ARGS...` and wait until it prints `ready_marker`."""
    sp = ServerProc(args[0], args, env)
    try:
        sp.wait_for(ready_marker, timeout)
    except RuntimeError:
        sp.stop(signal.SIGKILL)
        raise
    return sp


def start_engine(model_dir, *extra: str, **kw) -> ServerProc:
    args = ["engine", "--model", str(model_dir), "--port", "0", "--device", "cpu",
            "--dtype", "float32", "--num-kv-blocks", "512", *extra]
    return start_server(args, "nanoserve engine ready", **kw)


def start_router(engine_targets: list[str], *extra: str, **kw) -> ServerProc:
    """`nanoserve router` over `engine_targets` on a free port (its HTTP front too, unless
    `extra` says otherwise); returns once it listens (its engines may not be routable yet:
    they join as their health checks pass)."""
    args = ["router", *(a for t in engine_targets for a in ("--engine", t)), "--port", "0",
            "--http-port", "0", *extra]
    return start_server(args, "router listening on", **kw)


NODE_DIR = ROOT / "clients" / "node"


def run_node_client_test(target: str, spec: dict, expected, tmp_path: Path,
                         env: dict | None = None) -> str:
    """Run the Node client's own test suite against `target`, expecting it to stream the
    token ids and text the Python client got (`expected`); returns node's stdout. `env`
    adds variables (NANOSERVE_TLS_CA)."""
    import json
    import shutil

    import pytest

    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not installed (the Node client test needs Node.js >= 18)")
    if not (NODE_DIR / "node_modules").is_dir():
        pytest.fail("run npm ci in clients/node")
    expect = tmp_path / "expect.json"
    expect.write_text(json.dumps({**spec, "token_ids": expected.token_ids,
                                  "text": expected.text}))
    env = {**os.environ, "NANOSERVE_TARGET": target, "NANOSERVE_EXPECT_JSON": str(expect),
           **(env or {})}
    proc = subprocess.run([node, "--test"], cwd=NODE_DIR, env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "# fail 0" in proc.stdout
    return proc.stdout


def wait_blocks_free(client, timeout: float = 10):
    """Poll an engine's GetLoad until no request runs or waits and no KV block is held
    (cancellations reach the core asynchronously); returns the last Load seen."""
    deadline = time.monotonic() + timeout
    while True:
        load = client.load()
        if (load.kv_blocks_used == 0 and load.num_running == 0 and load.num_waiting == 0) \
                or time.monotonic() > deadline:
            return load
        time.sleep(0.05)
