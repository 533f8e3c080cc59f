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


def test_parts_keep_the_other_rows(tmp_path):
    """--parts times only those; the rows of the other parts already in --out (same device) stay, each with its
    commit."""
    sampling_glue = load_benchmark("sampling_glue")
    out = tmp_path / "glue.json"
    common = ["--device", "cpu", "--height", "32", "--width", "48", "--text-tokens", "8", "--dim", "64", "--heads",
              "4", "--durations", "3s", "--reps", "1", "--out", str(out)]
    assert sampling_glue.main(common) == 0
    first = json.loads(out.read_text())["rows"]
    assert sampling_glue.main(common + ["--parts", "mlp"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["part"], r["variant"]) for r in rows] == [(r["part"], r["variant"]) for r in first]
    assert rows[:2] == first[:2]  # the TTT rows kept as they were
    assert rows[2]["block_ms"] != first[2]["block_ms"] and all("git_commit" in r for r in rows)
