"""benchmarks/scan_overlap.py in Triton's interpreter (a smoke run: two heads, four mini-batches of 16): every
(scan, background) pair gives a row whose figures follow from its own timings, and the JSON is written."""

from __future__ import annotations

import json

import pytest

from tests.interpreter_runs import run_in_interpreter


def test_scan_overlap_smoke_in_interpreter(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "scan_overlap.json"
    proc = run_in_interpreter("scan_overlap.py", "--length", "64", "--heads", "2", "--tokens", "64", "--window", "64",
                              "--rounds", "1", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["scan_streams"], r["background"]) for r in rows] == [
        (4, "linear 3072x3072"), (4, "attention, one window"), (2, "linear 3072x3072"), (2, "attention, one window")]
    for r in rows:
        assert r["reps"] >= 1
        assert r["scan_slowdown"] == pytest.approx(r["scan_beside_ms"] / r["scan_alone_ms"])
        saved = r["scan_alone_ms"] + r["background_alone_ms"] - r["wall_ms"]
        assert r["overlap"] == pytest.approx(saved / min(r["scan_alone_ms"], r["background_alone_ms"]))
    assert "overlap" in proc.stdout
