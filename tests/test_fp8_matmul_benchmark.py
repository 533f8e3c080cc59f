"""benchmarks/fp8_matmul.py on CPU with the tiny preset: the four variants (bf16, fp8 storage, fp8 matmul, fp8 matmul
on every linear) at both durations, the error of each against bf16 (zero for bf16 itself, non-zero for the fp8 ones),
a row per fp8 layer shape with its quantisation timed alone, the training step of the three training variants, and
the table."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_scripts import load_benchmark

pytestmark = pytest.mark.usefixtures("one_thread")

SMOKE = ["--preset", "tiny", "--device", "cpu", "--height", "32", "--width", "48", "--text-tokens", "8",
         "--long", "6", "--timed-blocks", "1", "--repeats", "1"]


def test_four_variants_two_durations_errors_and_layers(tmp_path, capsys):
    bench = load_benchmark("fp8_matmul")
    out = tmp_path / "fp8_matmul_cpu.json"
    assert bench.main([*SMOKE, "--train-durations", "3", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"] and result["torch"] and result["git_commit"] and result["use_ttt"]
    steps = {(r["variant"], r["duration_s"]): r for r in result["steps"]}
    assert set(steps) == {(v, d) for v in bench.VARIANTS for d in (3, 6)}
    assert steps["bf16", 3]["error_vs_bf16"] == 0
    assert 0 < steps["fp8 storage", 3]["error_vs_bf16"] < 0.1
    assert 0 < steps["fp8 matmul", 3]["error_vs_bf16"] < 0.2
    assert steps["fp8 matmul", 6]["blocks_timed"] == 1 < steps["fp8 matmul", 6]["blocks_total"]
    assert 0 < steps["fp8 matmul, every linear", 3]["error_vs_bf16"] < 0.2
    assert 0 < result["fp8_layers"] == result["fp8_matmul_layers"] < result["fp8_matmul_every_layers"]
    shapes = {(r["in"], r["out"]) for r in result["layers"]}
    assert len(shapes) == len(result["layers"]) > 1
    assert sum(r["layers"] for r in result["layers"]) == result["fp8_matmul_every_layers"]
    assert all(r["bf16_ms"] > 0 and r["fp8_ms"] > 0 for r in result["layers"])
    # off CUDA the quantisation is the reference, compiled or not
    assert all(r["quantize_kernel"] == "reference" and r["quantize_ms"] > 0 and r["quantize_compiled_gbs"] > 0
               for r in result["layers"])
    assert [r["variant"] for r in result["train"]] == list(bench.TRAIN_VARIANTS) == list(bench.VARIANTS[:3])
    assert all(r["median_step_s"] > 0 and r["duration_s"] == 3 for r in result["train"])
    table = capsys.readouterr().out
    assert "| fp8 matmul | 3 s |" in table and "frozen layer (in -> out)" in table
