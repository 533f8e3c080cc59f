"""benchmarks/ttt_sample_minibatch.py on the CPU at tiny sizes: a row per (kind, duration, mini-batch) on the
sampler's layout, the JSON written, the table printed."""

from __future__ import annotations

import json
import sys

import pytest

from tests.benchmark_scripts import BENCHMARKS, load_benchmark

pytestmark = pytest.mark.usefixtures("one_thread")


def test_rows_json_and_table(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports benchmarks/ttt_kernel.py by name
    sys.modules.pop("ttt_kernel", None)
    bench = load_benchmark("ttt_sample_minibatch")
    out = tmp_path / "r.json"
    assert bench.main(["--kinds", "mlp", "linear", "--durations", "3s", "--mini-batches", "16", "64", "--dim", "32",
                       "--heads", "2", "--height", "16", "--width", "16", "--layers", "2", "--reps", "1",
                       "--device", "cpu", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kind"], r["mini_batch"]) for r in rows] == [("mlp", 16), ("mlp", 64), ("linear", 16), ("linear", 64)]
    assert all(r["block_ms"] > 0 and r["step_s"] == pytest.approx(r["block_ms"] * 2 / 1e3) for r in rows)
    # the text length is the training mini-batch's whatever the sampling one: the same tokens at 16 and 64
    assert rows[0]["tokens"] == rows[1]["tokens"] and rows[2]["tokens"] == rows[3]["tokens"]
    assert all(r["duration"] == "3s" and r["duration_s"] == 3 for r in rows)  # the label and the number of seconds
    assert "x vs 64" in capsys.readouterr().out
