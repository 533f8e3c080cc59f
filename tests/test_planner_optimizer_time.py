"""The planner's optimizer step (tttvideo.memory.plan.optimizer_time): its cost fitted per optimizer from
benchmarks/optimizer_step.py's rows, taken out of the calibration steps by benchmarks/plan_calibration.py fit and
added back per target, once per optimizer step (divided by the micro-batches a step)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_benchmark
from tttvideo.config.loader import load_config
from tttvideo.layout import VideoLayout
from tttvideo.memory.plan.costs import CostTable, load_costs
from tttvideo.memory.plan.count import model_bytes
from tttvideo.memory.plan.optimizer_time import (OptimizerCost, fit_optimizer_costs, micro_batches,
                                                 optimizer_step_s)

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs/demo.toml"
TINY = ["model.pretrained_path=", "train.init_from=", "memory.max_gpu_gib=0", "model.adapter=lora",
        "model.lora_rank=4", "model.dtype=bf16", "ttt.mini_batch_size=16"]
# synthetic costs: AdamW by the byte, 8-bit AdamW by the tensor (as measured on an H100: docs/memory.md)
ADAMW, EIGHT_BIT = OptimizerCost(0.0, 2e-9), OptimizerCost(4e-3, 0.0)


def demo(*extra: str):
    return load_config(DEMO, TINY + list(extra))


def optimizer_rows(costs: dict[str, OptimizerCost]) -> list[dict]:
    """benchmarks/optimizer_step.py's rows for three trainable sets, timed exactly by `costs`."""
    sets = [(1260, 1_725_956_064), (1428, 3_245_869_536), (1948, 7_230_178_848)]
    return [{"optimizer": name, "tensors": t, "params": p, "dtype": "bfloat16", "median_step_s": cost(t, 2 * p)}
            for name, cost in costs.items() for t, p in sets]


def test_the_fit_recovers_each_optimizers_cost_and_never_goes_negative():
    fitted = fit_optimizer_costs(optimizer_rows({"adamw": ADAMW, "adamw8bit": EIGHT_BIT}))
    assert fitted["adamw"].per_gradient_byte_s == pytest.approx(2e-9)
    assert fitted["adamw"].per_tensor_s == pytest.approx(0.0, abs=1e-12)
    assert fitted["adamw8bit"].per_tensor_s == pytest.approx(4e-3)
    # times falling with the bytes at a fixed tensor count would need a negative byte cost: one term alone instead
    rows = [{"optimizer": "x", "tensors": 100, "params": p, "dtype": "float32", "median_step_s": s}
            for p, s in ((1e9, 0.5), (2e9, 0.4))]
    cost = fit_optimizer_costs(rows)["x"]
    assert cost.per_tensor_s >= 0 and cost.per_gradient_byte_s >= 0 and cost(100, 4e9) > 0


def test_the_committed_h100_cost_reproduces_its_measurements():
    """costs.json's optimizer entry, fitted from benchmarks/results/optimizer_step_h100.json, within 10 % of each
    of its six rows (measured: 4.9 % at worst)."""
    table = load_costs("h100")
    rows = json.loads((ROOT / "benchmarks/results/optimizer_step_h100.json").read_text())["rows"]
    assert set(table.optimizer) == {r["optimizer"] for r in rows} == {"adamw", "adamw8bit"}
    for r in rows:
        predicted = table.optimizer[r["optimizer"]](r["tensors"], 2 * r["params"])
        assert predicted == pytest.approx(r["median_step_s"], rel=0.10), r
    assert CostTable.from_dict(table.to_dict()).optimizer == table.optimizer  # written and read back whole


def test_step_time_counts_tensors_whole_and_bytes_per_fsdp_shard():
    cfg = demo("train.optimizer=adamw8bit")
    b = model_bytes(cfg)
    assert b.trainable_tensors > 0 and b.gradients > 0
    costs = {"adamw8bit": OptimizerCost(1e-3, 1e-9)}
    assert optimizer_step_s(costs, cfg) == pytest.approx(1e-3 * b.trainable_tensors + 1e-9 * b.gradients)
    cfg.parallel.dp_shard = 2
    assert optimizer_step_s(costs, cfg, gpus=2) == pytest.approx(1e-3 * b.trainable_tensors + 1e-9 * b.gradients / 2)
    assert optimizer_step_s({"adamw": ADAMW}, cfg) is None  # 8-bit AdamW not measured there


@pytest.mark.parametrize("sets, gpus, expected", [
    (("train.grad_accum=0",), 1, 1), (("train.grad_accum=4",), 1, 4), (("train.global_batch=64",), 1, 64),
    (("train.global_batch=64",), 2, 32), (("train.global_batch=64", "parallel.sp=2"), 2, 64),
    (("train.global_batch=63",), 2, 32),  # the trainer refuses it; rounded up here
])
def test_micro_batches_per_step_follow_the_trainers_batch_plan(sets, gpus, expected):
    from tttvideo.config.batch import batch_plan

    cfg = demo("train.batch_size=1", "train.grad_accum=0", *sets)
    assert micro_batches(cfg, gpus) == expected
    if cfg.train.global_batch % (gpus // cfg.parallel.sp) == 0:
        assert batch_plan(cfg.train, gpus // cfg.parallel.sp)[0] == expected


def test_the_planner_adds_the_optimizer_step_once_per_optimizer_step():
    from tttvideo.memory.plan.planner import Candidate, predict

    table = load_costs("h100")
    cfg = load_config(ROOT / "configs/cogvideox-5b/stage2-9s-1gpu.toml", ["model.pretrained_path=",
                                                                         "train.init_from="])
    assert cfg.train.optimizer == "adamw8bit" and micro_batches(cfg) == 64

    def step(accumulated: bool, optimizers=table.optimizer) -> tuple[float, list[str]]:
        c = load_config(ROOT / "configs/cogvideox-5b/stage2-9s-1gpu.toml",
                        ["model.pretrained_path=", "train.init_from="]
                        + ([] if accumulated else ["train.global_batch=0", "train.grad_accum=1"]))
        t = CostTable(table.gpu, table.device, table.source, table.activation, table.time, table.sp_efficiency,
                      table.reserve, table.blocks, table.floors, optimizers)
        p = predict(c, "train", Candidate("as configured", ()), t, 1, 80 * 2**30)
        return p.step_s, p.notes

    opt = optimizer_step_s(table.optimizer, cfg)
    assert 0.4 < opt < 0.8  # 8-bit AdamW over qkvo's 1,428 tensors: 0.55 s measured on an H100
    (one, one_notes), (accum, accum_notes), (bare, bare_notes) = step(False), step(True), step(True, {})
    assert one - accum == pytest.approx(opt * (1 - 1 / 64))
    assert accum - bare == pytest.approx(opt / 64)  # a table without optimizer costs adds none
    assert any(n == f"adamw8bit step {opt:.2f} s" for n in one_notes)
    assert any(n.startswith(f"adamw8bit step {opt:.2f} s once per 64 micro-batches: +") for n in accum_notes)
    assert not any("adamw8bit step" in n for n in bare_notes)


def test_calibration_takes_the_optimizer_step_out_and_the_prediction_puts_the_targets_back(tmp_path, capsys):
    """Steps of 1e-4 s a token plus the run's own optimizer step: calibrated with AdamW, a held-out run with 8-bit
    AdamW (4 ms a tensor, far more than AdamW's) is predicted exactly only when both happen."""
    module = load_benchmark("plan_calibration")

    def row(duration: str, optimizer: str, calibrate: bool) -> dict:
        sets = TINY + [f"layout.duration={duration}", f"train.optimizer={optimizer}"]
        cfg = load_config(DEMO, sets)
        tokens = VideoLayout.from_config(cfg.layout, cfg.ttt).total_tokens * cfg.train.batch_size
        b = model_bytes(cfg)
        opt = {"adamw": ADAMW, "adamw8bit": EIGHT_BIT}[optimizer](b.trainable_tensors, b.gradients)
        return {"name": f"a {optimizer}", "config": "configs/demo.toml", "phase": "train", "duration": duration,
                "overrides": sets[3:], "status": "ok", "peak_allocated": 10**8, "step_seconds": [9.9, 1e-4 * tokens
                                                                                                   + opt],
                "calibrate": calibrate}

    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps({"gpu_kind": "testgpu", "device": "synthetic", "setups": [
        row("3s", "adamw", True), row("9s", "adamw", True), row("18s", "adamw8bit", False)]}))
    optimizer = tmp_path / "optimizer_step.json"
    optimizer.write_text(json.dumps({"rows": optimizer_rows({"adamw": ADAMW, "adamw8bit": EIGHT_BIT})}))
    costs = tmp_path / "costs.json"
    assert module.main(["fit", str(measured), "--costs-out", str(costs), "--optimizer-step", str(optimizer)]) == 0
    out = capsys.readouterr().out
    assert "1 step times, median |error| 0.0%, max 0.0%" in out
    assert load_costs("testgpu", costs).optimizer["adamw8bit"].per_tensor_s == pytest.approx(4e-3)
    # without the optimizer's costs the 8-bit run is predicted at AdamW's step
    assert module.main(["fit", str(measured), "--costs-out", str(tmp_path / "bare.json")]) == 0
    assert "1 step times, median |error| 0.0%" not in capsys.readouterr().out
