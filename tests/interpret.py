"""Running Triton kernels under TRITON_INTERPRET=1 from pytest.

The interpreter must be on before triton is first imported, so a test file runs itself as a
script in a fresh subprocess: the script side runs every named check and prints "OK name" or
"FAIL name" with the traceback; the pytest side asserts one check per test. No torch or triton
import here: the parent process may already have triton loaded without the interpreter.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_interpreted(script: str, *args: str) -> str:
    """Output of `python script *args` with the interpreter on (start-up is slow: one
    subprocess runs all of a file's checks)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, script, *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=280)
    return f"{proc.stdout}\n{proc.stderr}"


def assert_check_passed(output: str, check: str) -> None:
    assert f"OK {check}\n" in output, f"check {check!r} did not pass:\n{output}"


def interpreted_check_test(script: str, checks: list[str]) -> Callable[[str], None]:
    """The pytest side of a file whose checks all run in one interpreter subprocess of
    `script` (started by the first test that needs it): a test parametrized over `checks`,
    each asserting that its check passed. Bind it to a `test_...` name in the file."""

    @functools.cache
    def output() -> str:
        return run_interpreted(script)

    @pytest.mark.parametrize("check", checks)
    def test(check: str) -> None:
        assert_check_passed(output(), check)

    return test


def run_checks(checks: list[tuple[str, Callable[[], None]]]) -> None:
    """Script side: run every check, report each, exit 1 if any failed."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    failed = False
    for name, check in checks:
        try:
            check()
            print(f"OK {name}", flush=True)
        except Exception:  # report every check, fail the process at the end
            failed = True
            print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
    sys.exit(1 if failed else 0)


def round_bf16_like_the_gpu() -> None:
    """Script side: Triton 3.x's interpreter casts float32 -> bfloat16 by truncation; the GPU
    (cvt.rn.bf16.f32) and torch round to nearest even. Left alone, every bf16 rounding in a
    kernel would be off by up to an ulp and a check would test the interpreter's rounding
    rather than the kernel's arithmetic: make that one cast round as the hardware does."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = torch.from_numpy(np.array(src.data, dtype=np.float32))
            bits = data.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits.reshape(src.data.shape), tl.bfloat16)
        return original(self, src, dst_type)

    builder.cast_impl = cast_impl
