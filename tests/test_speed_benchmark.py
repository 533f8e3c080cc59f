"""benchmarks/speed.py (issue 36's speed targets in one run) on CPU with the tiny preset: every part runs, the JSON
holds the device, versions, commit and each figure, the long guided step is marked extrapolated when blocks are left
out, the profile lands beside the JSON, and a later run of one part keeps the others' results."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_scripts import load_benchmark

pytest.importorskip("diffusers")  # the train part times diffusers' transformer beside ours

pytestmark = pytest.mark.usefixtures("one_thread")

SMOKE = ["--preset", "tiny", "--device", "cpu", "--height", "32", "--width", "48", "--text-tokens", "8",
         "--long", "6", "--timed-blocks", "1", "--steps", "1", "--warmup", "0",
         "--set", "ttt.compile_glue=false", "--set", "model.compile_attention_glue=false"]


def test_every_part_on_cpu_then_one_part_again(tmp_path, capsys):
    speed = load_benchmark("speed")
    out = tmp_path / "speed_cpu.json"
    assert speed.main([*SMOKE, "--profile", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"] and result["torch"] and result["git_commit"]
    assert set(result["parts"]) == {"train", "sample3", "sample63", "ttt63"}
    figures = result["figures"]
    for key in ("train_ratio_short", "sample_ratio_short", "sample_ratio_long", "sample_long_ttt_step_s",
                "backbone_forward_vs_diffusers", "backbone_train_vs_diffusers", "ttt63_block_ms",
                "ttt63_block_serial_ms", "ttt63_block_one_ms", "ttt63_scans_ms"):
        assert figures[key] > 0, key
    train = result["parts"]["train"]["rows"]
    assert figures["train_ratio_short"] == pytest.approx(train["ttt"]["median_step_s"] / train["off"]["median_step_s"])
    assert figures["backbone_train_vs_diffusers"] == train["off"]["yardstick"]["vs_ours"]["train_step"]
    # CPU: no peak FLOP/s to divide by, so no MFU; the row says "not run", not a number
    rows = {r["figure"]: r for r in result["targets"]}
    assert len(rows) == len(speed.TARGETS) and rows["mfu_ttt_short"]["measured"] is None
    assert rows["train_ratio_short"]["met"] == (figures["train_ratio_short"] <= 1.4)
    # the long step ran 1 of the tiny model's 2 blocks: extrapolated, and said so; the short one ran both
    assert rows["sample_long_ttt_step_s"]["extrapolated"] and not rows["sample_ratio_short"]["extrapolated"]
    # a long video's 50 steps (sample.steps' default), each timed as the guided step: minutes, extrapolated with it
    assert figures["sample_long_video_min"] == pytest.approx(50 * figures["sample_long_ttt_step_s"] / 60)
    assert rows["sample_long_video_min"]["extrapolated"]
    long_on = result["parts"]["sample63"]["rows"]["ttt"]
    assert (long_on["blocks_timed"], long_on["blocks_total"]) == (1, 2)
    table = capsys.readouterr().out
    assert "speed targets (issue 36)" in table and "(extrapolated)" in table
    profile = json.loads((tmp_path / "speed_profile_cpu.json").read_text())
    assert set(profile) == {"train_short", "sample_short", "sample_long"}
    assert all("git_commit" in entry for entry in profile.values())
    assert all(entry["by_time"] for entry in profile.values())
    assert "## guided sampling step, 6 s, TTT on, 2 of 2 blocks" in (tmp_path / "speed_profile_cpu.md").read_text()

    # one part again: its figures are new, the other parts' are kept
    assert speed.main([*SMOKE, "--parts", "ttt63", "--out", str(out)]) == 0
    again = json.loads(out.read_text())
    assert set(again["parts"]) == {"train", "sample3", "sample63", "ttt63"}
    assert again["parts"]["train"] == result["parts"]["train"]
    assert again["parts"]["ttt63"] != result["parts"]["ttt63"]  # timed anew

    # micro-batch 2 beside the targets: two clips in each step, the figures per clip
    assert speed.main([*SMOKE, "--parts", "train2", "--out", str(out)]) == 0
    two = json.loads(out.read_text())
    on, off = two["parts"]["train2"]["rows"]["ttt"], two["parts"]["train2"]["rows"]["off"]
    assert on["latents_shape"][0] == off["latents_shape"][0] == 2
    assert on["flops"]["total"] == pytest.approx(2 * train["ttt"]["flops"]["total"])
    assert two["figures"]["train_ttt_short_b2_clip_s"] == pytest.approx(on["median_step_s"] / 2)
    assert two["figures"]["train_ratio_short_b2"] == pytest.approx(on["median_step_s"] / off["median_step_s"])
    assert two["parts"]["train"] == result["parts"]["train"]


def test_targets_table_from_figures():
    speed = load_benchmark("speed")
    result = {"parts": {
        "train": {"figures": {"train_ratio_short": 1.88, "mfu_ttt_short": 0.41, "backbone_forward_vs_diffusers": 1.5,
                              "backbone_train_vs_diffusers": None}},
        "sample63": {"figures": {"sample_long_ttt_step_s": 29.0, "sample_ratio_long": 1.2},
                     "extrapolated": {"ttt": "2 of 42 blocks run"}},
    }}
    rows = {r["figure"]: r for r in speed.target_rows(result)}
    assert rows["train_ratio_short"]["met"] is False and rows["mfu_ttt_short"]["met"] is True
    assert rows["backbone_forward_vs_diffusers"]["met"] is True  # ">= 1.5" includes 1.5
    assert rows["backbone_train_vs_diffusers"]["met"] is None and rows["mfu_ttt_long"]["measured"] is None
    assert rows["sample_long_ttt_step_s"]["met"] is True and rows["sample_long_ttt_step_s"]["extrapolated"]
    assert rows["sample_ratio_long"]["extrapolated"] and not rows["train_ratio_short"]["extrapolated"]
    assert speed.parse_args(["--quick"]).timed_blocks == 2
    assert speed.parse_args([]).parts == list(speed.QUICK_PARTS)
    with pytest.raises(SystemExit):
        speed.parse_args(["--parts", "train,nope"])


def test_a_failing_part_is_recorded_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    speed = load_benchmark("speed")

    def fails(*args):
        raise RuntimeError("kernel build failed")

    monkeypatch.setattr(speed, "ttt_long_part", fails)
    out = tmp_path / "speed_cpu.json"
    assert speed.main([*SMOKE, "--parts", "ttt63", "--out", str(out)]) == 0
    part = json.loads(out.read_text())["parts"]["ttt63"]
    assert part["error"] == "RuntimeError: kernel build failed" and part["figures"] == {}
    assert "part ttt63 failed: RuntimeError: kernel build failed" in capsys.readouterr().out
