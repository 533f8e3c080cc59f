"""benchmarks/ttt_forward_ab.py in Triton's interpreter (a smoke run: two heads, four mini-batches of 16): the present
kernel against a copy of itself as the baseline gives every case, bit-equal outputs, and a JSON with the rows."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.interpreter_runs import ROOT, run_in_interpreter


def test_forward_ab_smoke_in_interpreter(tmp_path):
    pytest.importorskip("triton")
    baseline = tmp_path / "triton_mlp_copy.py"
    shutil.copy(ROOT / "src" / "tttvideo" / "ttt" / "triton_mlp.py", baseline)
    out = tmp_path / "ab.json"
    proc = run_in_interpreter("ttt_forward_ab.py", "--baseline", str(baseline), "--length", "64", "--heads", "2",
                              "--rounds", "2", "--out", str(out))
    result = json.loads(out.read_text())
    assert [r["case"] for r in result["rows"]] == ["sampling, 96 streams", "sampling, 48 streams",
                                                     "training forward, 48 streams"]
    assert all(r["equal"] for r in result["rows"])
    assert all(len(r["present_ms"]) == 2 and r["baseline_us_step"] > 0 for r in result["rows"])
    assert all(r["present_error"] == r["baseline_error"] < 1e-4 for r in result["rows"])  # fp32 in the interpreter
    assert "bit-equal" in proc.stdout


def test_missing_baseline_is_one_sentence(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "benchmarks/ttt_forward_ab.py", "--baseline", str(tmp_path / "none.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "no such file" in proc.stderr and "Traceback" not in proc.stderr
