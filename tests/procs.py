"""Start real `nanoserve` processes (engines, routers) on loopback ports for tests."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from benchmarks.procs import ROOT, ServerProc, start_engines, start_routers


def start_engine(model_dir, *extra: str, **kw) -> ServerProc:
    """A CPU float32 engine with 512 KV blocks (`extra` flags win), once it is ready."""
    return start_engines(model_dir, "--device", "cpu", "--dtype", "float32", "--num-kv-blocks",
                         "512", *extra, **kw)[0]


def start_router(engine_targets: list[str], *extra: str, **kw) -> ServerProc:
    """A router over `engine_targets`, once it listens (its engines join as their health
    checks pass)."""
    return start_routers(engine_targets, *extra, **kw)[0]


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
