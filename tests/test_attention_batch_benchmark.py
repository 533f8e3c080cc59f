"""benchmarks/attention_batch.py's CPU smoke run: every case runs, the FLOP rate follows from the shapes, the JSON
is written."""

from __future__ import annotations

import json

from tests.benchmark_scripts import load_benchmark


def test_attention_batch_cpu_smoke(tmp_path, capsys):
    bench = load_benchmark("attention_batch")
    out = tmp_path / "attention_batch_cpu.json"
    assert bench.main(["--device", "cpu", "--tokens", "32", "--heads", "2", "--dim", "8", "--windows", "3",
                       "--reps", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["case"] for r in rows] == ["3 s batch, 1 call", "3 s batch, 3 calls", "63 s batch, 1 call",
                                         "63 s batch, BLHD view", "3 s batch again"]
    assert [(r["batch"], r["calls"]) for r in rows] == [(2, 1), (2, 3), (6, 1), (6, 1), (2, 1)]
    for r in rows:
        flop = 4 * r["batch"] * 2 * 32 ** 2 * 8 * r["calls"]
        assert abs(r["tflops"] - flop / r["ms"] / 1e9) < 1e-9 * max(1.0, r["tflops"])
    assert "63 s batch, BLHD view" in capsys.readouterr().out
