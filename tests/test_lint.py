"""The code passes ruff with the project's settings (pyproject.toml, [tool.ruff]): no undefined or unused names, no
syntax errors, lines of at most 120 columns. An undefined name is a crash waiting on the line that reads it, often in
a path no other test runs (a benchmark's error branch, a closure after a `del`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_passes():
    pytest.importorskip("ruff", reason="ruff is in the dev extra: pip install -e '.[dev]'")
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "src", "tests", "benchmarks"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"ruff found problems (fix them, or `ruff check --fix`):\n{run.stdout}{run.stderr}"
