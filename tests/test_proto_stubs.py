"""The committed Python stubs must be what `make proto` generates from the committed .proto."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STUBS = ("nanoserve_pb2.py", "nanoserve_pb2.pyi", "nanoserve_pb2_grpc.py")


def test_stubs_match_proto(tmp_path: Path) -> None:
    # Same command as the Makefile's `proto` target, pointed at a scratch directory.
    out = str(tmp_path)
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", "proto", f"--python_out={out}",
         f"--pyi_out={out}", f"--grpc_python_out={out}", "proto/nanoserve/v1/nanoserve.proto"],
        cwd=ROOT, check=True, capture_output=True)
    stale = [name for name in STUBS
             if (tmp_path / "nanoserve/v1" / name).read_bytes()
             != (ROOT / "proto/nanoserve/v1" / name).read_bytes()]
    if stale:
        pytest.fail(f"stubs are stale: run make proto ({', '.join(stale)} differ)")
