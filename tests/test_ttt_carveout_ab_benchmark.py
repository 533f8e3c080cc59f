"""benchmarks/ttt_carveout_ab.py in Triton's interpreter (a smoke run: two heads, four mini-batches): both modes run
every case and give the same outputs (there is no carveout to set on a CPU; the times mean nothing)."""

from __future__ import annotations

import json

import pytest

from tests.interpreter_runs import run_in_interpreter


def test_smoke_in_the_interpreter(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "ab.json"
    proc = run_in_interpreter("ttt_carveout_ab.py", "--length", "64", "--heads", "2", "--rounds", "1",
                              "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["runs"] for r in rows] == ["fwd+bwd", "train fwd", "sample fwd", "sample fwd", "fwd+bwd"]
    assert all(r["equal"] and r["norm_grad_moved"] == 0.0 for r in rows)
    assert "bit-equal" in proc.stdout
