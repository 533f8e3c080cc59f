"""benchmarks/ttt_carveout_ab.py in Triton's interpreter (a smoke run: two heads, four mini-batches): both modes run
every case and give the same outputs (there is no carveout to set on a CPU; the times mean nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_in_the_interpreter(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "ab.json"
    env = dict(os.environ, TRITON_INTERPRET="1", OUT="")
    proc = subprocess.run([sys.executable, "benchmarks/ttt_carveout_ab.py", "--length", "64", "--heads", "2",
                           "--rounds", "1", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["runs"] for r in rows] == ["fwd+bwd", "train fwd", "sample fwd", "sample fwd", "fwd+bwd"]
    assert all(r["equal"] and r["norm_grad_moved"] == 0.0 for r in rows)
    assert "bit-equal" in proc.stdout
