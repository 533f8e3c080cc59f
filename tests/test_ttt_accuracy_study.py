"""benchmarks/ttt_accuracy.py end to end on the CPU (Triton interpreter, fp32 inputs, tiny sizes): it runs, writes
its JSON, and its three columns measure what they say."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_accuracy_study_runs_and_separates_its_columns(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.path.join(ROOT, "src"))
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "ttt_accuracy.py"), "--draws", "1", "--linear-draws", "1",
           "--regimes", "spec-init", "biased-eta16", "--length", "128", "--heads", "1", "--group", "2",
           "--out", str(tmp_path)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "kernel median" in run.stdout  # the table
    res = json.loads((tmp_path / "ttt_accuracy.json").read_text())
    assert {(r["kind"], r["regime"]) for r in res["rows"]} == {
        (k, g) for k in ("mlp", "linear") for g in ("spec-init", "biased-eta16")}
    for r in res["rows"]:
        kernel, rounded, nudged = (max(r[c].values()) for c in ("kernel", "bf16_reference", "sensitivity"))
        assert kernel < 1e-4, r  # fp32 in the interpreter: the kernels match the reference
        assert 1e-4 < rounded < 5e-2, r  # bf16 products do cost something, and not everything
        assert 0 < nudged < 5e-2, r  # the nudge moves the answer, a short chain stays well conditioned
