"""Append measured figures, with date, hardware, command and commit, to a run log
(.out/runs.md; NANOSERVE_RESULTS to redirect). benchmarks/RESULTS.md is kept by hand: current
figures only, copied from such a log."""

from __future__ import annotations

import datetime as dt
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / ".out" / "runs.md"


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def hardware() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            return f"{n}x {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    cpu = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    return f"CPU {cpu} ({os.cpu_count()} cores)"


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=ROOT, check=True).stdout.strip()
        # Untracked files count: a new module the run used is not in HEAD either.
        dirty = subprocess.run(["git", "status", "--porcelain"],
                               capture_output=True, text=True, cwd=ROOT).stdout
        return out + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def record(title: str, figures: dict[str, str], path: Path | None = None) -> None:
    """One entry per run: a heading, the figures, and how to reproduce them."""
    path = path or Path(os.environ.get("NANOSERVE_RESULTS", RESULTS))
    cmd = "nanoserve " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    lines = [f"\n### {title} — {dt.date.today().isoformat()}\n",
             f"- hardware: {hardware()}", f"- commit: {commit()}", f"- command: `{cmd}`"]
    lines += [f"- {k}: {v}" for k, v in figures.items()]
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("# Benchmark runs\n\nEvery figure with its date, hardware, command "
                        "and commit. Newest entries at the bottom.\n")
    with path.open("a") as f:
        f.write("\n".join(lines) + "\n")
