"""The run every benchmark smoke test makes: a script of benchmarks/ in Triton's CPU interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_in_interpreter(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python benchmarks/SCRIPT ARGS` from the checkout's root with TRITON_INTERPRET=1, no GPU visible and no $OUT;
    asserts it exits 0 and returns the finished process (its stdout for the table)."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", OUT="")
    proc = subprocess.run([sys.executable, f"benchmarks/{script}", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
