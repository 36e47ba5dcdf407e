"""`nanoserve bench soak`: a short run end to end (two real engines, a router, an engine
killed and restarted mid-run), read from the table it prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from benchmarks.procs import ROOT
from benchmarks.soak import OUTCOMES


@pytest.mark.timeout(90)
def test_short_soak_has_no_unexplained_outcome_and_no_block_held_at_idle(tiny_model_dir,
                                                                          tmp_path):
    cmd = [sys.executable, "-m", "clients.cli", "bench", "soak", "--minutes", "0.2",
           "--restart-every", "0.1", "--model", str(tiny_model_dir), "--no-record"]
    env = {**os.environ, "NANOSERVE_RESULTS": str(tmp_path / "runs.md")}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=75)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the benchmark stops the engines and router it started
        stdout, stderr = proc.communicate(timeout=30)
    out = stdout[-3000:] + stderr[-3000:]
    assert proc.returncode == 0, out
    total = re.search(r"^\| total \| (.*) \|$", stdout, re.M)
    assert total, out
    counts = dict(zip(OUTCOMES, map(int, total.group(1).split(" | ")[:len(OUTCOMES)]),
                      strict=True))
    assert counts["unexplained"] == 0, out
    assert counts["ok"] > 0 and counts["cancelled"] > 0 and counts["invalid"] > 0, counts
    blocks = re.search(r"^KV blocks used at idle: (.*)$", stdout, re.M)
    assert blocks and re.findall(r"engine \d+ (\d+)", blocks.group(1)) == ["0", "0"], out
    assert "engine 0 (127.0.0.1:" in stdout and "killed (SIGKILL) and restarted" in stdout
    rss = dict(re.findall(r"^\| (engine 0 core|router) \| \d+ \| \d+ \| (\d+) \|$", stdout,
                          re.M))
    assert rss == {"router": "0", "engine 0 core": "1"}, out  # restarts, by process
    assert not (tmp_path / "runs.md").exists()  # --no-record
