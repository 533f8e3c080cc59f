"""benchmarks/sampling_glue.py on the CPU (a smoke run: wall clock, and the CPU takes neither the compiled glue nor
the GELU epilogue): every variant of both parts is timed, the error between the MLP's two forms is recorded, and
the JSON carries device, torch and commit."""

from __future__ import annotations

import json

from tests.benchmark_scripts import load_benchmark


def test_sampling_glue_smoke(tmp_path):
    sampling_glue = load_benchmark("sampling_glue")
    out = tmp_path / "glue.json"
    assert sampling_glue.main(["--device", "cpu", "--height", "32", "--width", "48", "--text-tokens", "8", "--dim",
                               "64", "--heads", "4", "--durations", "3s", "--reps", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"device", "torch", "git_commit"} <= set(result)
    variants = [(r["part"], r["variant"]) for r in result["rows"]]
    assert variants == [("bidirectional TTT", "fused (compiled)"), ("bidirectional TTT", "eager"),
                        ("MLP", "GELU in the epilogue"), ("MLP", "GELU apart")]
    assert all(r["block_ms"] > 0 for r in result["rows"])
    assert all(r["rel_err_vs_apart"] == 0.0 for r in result["rows"] if r["part"] == "MLP")  # one path on the CPU
