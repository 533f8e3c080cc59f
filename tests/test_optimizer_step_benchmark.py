"""benchmarks/optimizer_step.py on CPU with the tiny preset: a row per setup and optimizer, the trainable sets the
configs train (LoRA fewest tensors, sft most), the steps timed update the parameters, and the table."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_scripts import load_benchmark

pytestmark = pytest.mark.usefixtures("one_thread")


def test_rows_per_setup_and_optimizer(tmp_path, capsys):
    bench = load_benchmark("optimizer_step")
    out = tmp_path / "optimizer_step_cpu.json"
    assert bench.main(["--preset", "tiny", "--device", "cpu", "--warmup", "1", "--steps", "2",
                       "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["torch"] and result["git_commit"]
    rows = {(r["setup"].split(",")[0], r["optimizer"]): r for r in result["rows"]}
    assert set(rows) == {(s, o) for s in ("lora", "qkvo", "sft") for o in ("adamw", "adamw8bit")}
    assert all(r["updated"] and r["median_step_s"] > 0 and len(r["step_s"]) == 2 for r in rows.values())
    assert all(0 < r["tensors_8bit_eligible"] < r["tensors"] for r in rows.values())
    assert rows["lora", "adamw"]["adapter"] == "lora" and rows["sft", "adamw"]["adapter"] == "sft"
    assert rows["lora", "adamw"]["tensors"] < rows["qkvo", "adamw"]["tensors"] < rows["sft", "adamw"]["tensors"]
    assert rows["qkvo", "adamw"]["dtype"] == rows["sft", "adamw"]["dtype"] == "bfloat16"
    assert "| sft, bf16 | adamw8bit |" in capsys.readouterr().out


def test_unknown_setup_is_one_sentence(tmp_path):
    bench = load_benchmark("optimizer_step")
    with pytest.raises(SystemExit, match="--setups: full; choose from lora, qkvo, sft"):
        bench.main(["--setups", "full", "--out", str(tmp_path / "x.json")])
