"""benchmarks/scan_overlap.py in Triton's interpreter (a smoke run: two heads, four mini-batches of 16): every
(scan, background) pair gives a row whose figures follow from its own timings, and the JSON is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_scan_overlap_smoke_in_interpreter(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "scan_overlap.json"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "benchmarks/scan_overlap.py", "--length", "64", "--heads", "2",
                           "--tokens", "64", "--window", "64", "--rounds", "1", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["scan_streams"], r["background"]) for r in rows] == [
        (4, "linear 3072x3072"), (4, "attention, one window"), (2, "linear 3072x3072"), (2, "attention, one window")]
    for r in rows:
        assert r["reps"] >= 1
        assert r["scan_slowdown"] == pytest.approx(r["scan_beside_ms"] / r["scan_alone_ms"])
        saved = r["scan_alone_ms"] + r["background_alone_ms"] - r["wall_ms"]
        assert r["overlap"] == pytest.approx(saved / min(r["scan_alone_ms"], r["background_alone_ms"]))
    assert "overlap" in proc.stdout
