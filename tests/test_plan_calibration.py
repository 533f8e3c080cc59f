"""benchmarks/plan_calibration.py's fit: from measured peaks that are the counted part plus a linear activation term
(and step times linear in the tokens), it recovers the costs, and the planner then predicts held-out setups exactly;
its check: which runs it makes (the choice under the card's cap, faster candidates predicted not to fit) and what it
keeps of an earlier file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_benchmark
from tttvideo.config.loader import load_config
from tttvideo.layout import VideoLayout
from tttvideo.memory.plan.costs import activation_key, load_costs
from tttvideo.memory.plan.count import count

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.adapter=lora", "model.lora_rank=4", "model.dtype=bf16", "ttt.mini_batch_size=16"]


def calibration_module():
    return load_benchmark("plan_calibration")


def synthetic_row(name, phase, duration, overrides, calibrate, per_token=3000.0, fixed=5e6):
    cfg = load_config(ROOT / "configs/demo.toml", ["model.pretrained_path=", "train.init_from=", "memory.max_gpu_gib=0",
                                                   f"layout.duration={duration}"] + overrides)
    tokens = VideoLayout.from_config(cfg.layout, cfg.ttt).total_tokens * (cfg.train.batch_size if phase == "train"
                                                                           else 1)
    peak = count(cfg, phase).total + per_token * tokens + fixed
    return {"name": name, "config": "configs/demo.toml", "phase": phase, "duration": duration,
            "overrides": overrides, "status": "ok", "peak_allocated": int(peak),
            "step_seconds": [9.9, 1e-4 * tokens + 0.5], "calibrate": calibrate}


def test_fit_recovers_the_costs_and_predicts_held_out_setups(tmp_path, capsys):
    module = calibration_module()
    adamw = TINY + ["train.optimizer=adamw"]
    rows = [synthetic_row("a", "train", "3s", adamw, True), synthetic_row("a", "train", "9s", adamw, True),
            synthetic_row("a", "train", "18s", adamw, False),
            # the same activation regime with fp8 frozen weights: only the counted part differs
            synthetic_row("a fp8", "train", "9s", adamw + ["model.frozen_weights=fp8"], False),
            synthetic_row("s", "sample", "3s", TINY, True, 1000.0, 1e6),
            synthetic_row("s", "sample", "12s", TINY, True, 1000.0, 1e6),
            synthetic_row("s", "sample", "6s", TINY, False, 1000.0, 1e6)]
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps({"gpu_kind": "testgpu", "device": "synthetic", "setups": rows}))
    costs = tmp_path / "costs.json"
    assert module.main(["fit", str(measured), "--costs-out", str(costs), "--sp-efficiency", '{"2": 0.8}']) == 0
    out = capsys.readouterr().out
    table = load_costs("testgpu", costs)
    cfg = load_config(ROOT / "configs/demo.toml", adamw)
    line = table.activation[activation_key(cfg, "train")]
    tokens = VideoLayout.from_config(cfg.layout, cfg.ttt).total_tokens * cfg.train.batch_size
    assert line(tokens) == pytest.approx(3000.0 * tokens + 5e6)
    assert table.sp_efficiency == {2: 0.8}
    assert "held out: 3 peaks, median |error| 0.0%, max 0.0%" in out
    assert "3 step times, median |error| 0.0%, max 0.0%" in out  # fp8 weights share the bf16 time regime


def test_setups_name_existing_configs_and_valid_overrides():
    """Every setup of the device run loads (a typo would only show on the GPU)."""
    module = calibration_module()
    names = [s.name for s in module.SETUPS]
    assert len(names) == len(set(names)) == 14
    for s in module.SETUPS:
        assert s.phase in ("train", "sample") and (s.calibrate or s.held_out), s.name
        assert len(s.calibrate) != 1, f"{s.name}: a regime needs two durations to fit"
        for duration in s.calibrate + s.held_out:
            load_config(ROOT / s.config, module.NO_WEIGHTS + [f"layout.duration={duration}"] + list(s.overrides))


def test_check_runs_the_choice_under_the_cap_and_spot_checks_faster_ones(tmp_path, monkeypatch):
    """`check` with the profiling replaced: at 24 GiB, 9 s it runs the planner's choice under the card's cap and two
    faster candidates predicted not to fit; an earlier row for a choice the planner no longer makes is set aside as
    superseded, not counted as checked; at 80 GiB the choice is the fastest regime, so no spot check there."""
    import tttvideo.memory.studies.matrix as matrix

    pc = calibration_module()
    runs = []

    class Ran:
        status, note = "ok", ""
        summary = {"totals": {"peak_allocated": 1, "peak_reserved": 2}, "step_seconds": [1.0, 2.0]}

    def run_variant(m, variant, work):
        runs.append((variant.name, [o for o in variant.overrides if o.startswith("memory.max_gpu_gib")][-1]))
        return Ran()

    monkeypatch.setattr(matrix, "run_variant", run_variant)
    out = tmp_path / "check.json"
    stale = {"gpu_mem_gib": 24.0, "duration": "9s", "role": "chosen", "setup": "a choice made before", "status": "oom"}
    out.write_text(json.dumps({"setups": [stale]}))
    assert pc.main(["check", "--gpu-mem", "24,80", "--durations", "9s", "--out", str(out),
                    "--work", str(tmp_path / "w")]) == 0
    names = [name for name, _ in runs]
    assert names[0] == "24 GiB 9s chosen" and runs[0][1] == "memory.max_gpu_gib=23.2"
    assert names[1:3] == ["24 GiB 9s faster, predicted not to fit", "24 GiB 9s faster #2, predicted not to fit"]
    assert names[3:] == ["80 GiB 9s chosen"]
    result = json.loads(out.read_text())
    assert [r["superseded_by"] for r in result["superseded"]] == [result["setups"][0]["setup"]]
    assert result["setups"][0]["setup"] != "a choice made before" and len(result["setups"]) == 4
    assert all(r["predicted_step_s"] < result["setups"][0]["predicted_step_s"] for r in result["setups"][1:3])
    # a rerun holds every case: nothing runs again
    runs.clear()
    assert pc.main(["check", "--gpu-mem", "24,80", "--durations", "9s", "--out", str(out),
                    "--work", str(tmp_path / "w")]) == 0
    assert runs == []


def test_fit_gives_the_chunked_regimes_one_floor_from_their_least_run(tmp_path):
    """A chunked sampling regime's floor (costs.FLOOR_STREAMS streams + a fixed part): the fixed part is the least
    (activation - the streams) over the calibration runs of every chunked regime of the preset and dtype, whatever
    their head groups, since the peak outside the scan does not depend on them."""
    from tttvideo.memory.plan.costs import chunked_floor_streams

    module = calibration_module()
    g1, g2 = TINY + ["memory.chunked_inference=true"], TINY + ["memory.chunked_inference=true",
                                                               "memory.ttt_head_groups=2"]
    rows = [synthetic_row("c1", "sample", "3s", g1, True, 900.0, 4e6),
            synthetic_row("c1", "sample", "12s", g1, True, 900.0, 4e6),
            synthetic_row("c2", "sample", "3s", g2, True, 700.0, 2e6),  # the least: 700 a token + 2 MB at 3 s
            synthetic_row("c2", "sample", "12s", g2, True, 700.0, 2e6),
            synthetic_row("plain", "sample", "3s", TINY, True), synthetic_row("plain", "sample", "12s", TINY, True)]
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps({"gpu_kind": "testgpu", "device": "synthetic", "setups": rows}))
    costs = tmp_path / "costs.json"
    assert module.main(["fit", str(measured), "--costs-out", str(costs)]) == 0
    table = load_costs("testgpu", costs)
    cfg = load_config(ROOT / "configs/demo.toml", ["layout.duration=3s"] + g2)
    tokens = VideoLayout.from_config(cfg.layout, cfg.ttt).total_tokens
    expected = 700.0 * tokens + 2e6 - chunked_floor_streams(cfg)
    keys = {activation_key(load_config(ROOT / "configs/demo.toml", o), "sample") for o in (g1, g2)}
    assert set(table.floors) == keys  # the plain forward has none
    assert all(v == pytest.approx(expected, rel=1e-6) for v in table.floors.values())


def test_fit_keeps_the_reserve_above_the_peak_as_a_curve_and_skips_capped_runs(tmp_path):
    """What the allocator reserved above the peak, per regime: a curve through the calibration runs' (tokens,
    reserved - allocated), here 2 MB + 500 B a token; a run of benchmarks/fit_24gb.py under a cap (its --set or its
    config's) adds no point, since the cap decided what the allocator kept."""
    module = calibration_module()
    rows = []
    for duration in ("3s", "12s"):
        row = synthetic_row("s", "sample", duration, TINY, True)
        tokens = VideoLayout.from_config(_config_of(row).layout, _config_of(row).ttt).total_tokens
        rows.append({**row, "peak_reserved": row["peak_allocated"] + int(500 * tokens + 2e6)})
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps({"gpu_kind": "testgpu", "device": "synthetic", "setups": rows}))
    costs = tmp_path / "costs.json"
    assert module.main(["fit", str(measured), "--costs-out", str(costs)]) == 0
    table = load_costs("testgpu", costs)
    cfg = _config_of(rows[0], "6s")
    tokens = VideoLayout.from_config(cfg.layout, cfg.ttt).total_tokens
    assert table.reserve[activation_key(cfg, "sample")](tokens) == pytest.approx(500 * tokens + 2e6, rel=1e-6)

    run = {"status": "ok", "totals": {"peak_allocated": 3 * 2**30, "peak_reserved": 4 * 2**30}, "step_s": [1.0]}
    cmd = "-m tttvideo profile {} --phase sample --steps 2 --set layout.duration=3s"
    fit24 = tmp_path / "fit_24gb.json"
    fit24.write_text(json.dumps({"sample": {"variants": [
        {**run, "variant": "free", "command": cmd.format(ROOT / "configs/demo.toml") + " --set memory.max_gpu_gib=0"},
        {**run, "variant": "capped", "command": cmd.format(ROOT / "configs/demo.toml") + " --set memory.max_gpu_gib=9"},
        {**run, "variant": "capped by its config", "command": cmd.format(ROOT / "configs/cogvideox-5b/24gb-3s.toml")},
    ]}}))
    got = {r["name"]: r.get("peak_reserved") for r in module.rows_from_fit_24gb(fit24)}
    assert got == {"free": 4 * 2**30, "capped": None, "capped by its config": None}


def _config_of(row, duration=None):
    return load_config(ROOT / row["config"], ["model.pretrained_path=", "train.init_from=", "memory.max_gpu_gib=0",
                                              f"layout.duration={duration or row['duration']}"] + row["overrides"])
