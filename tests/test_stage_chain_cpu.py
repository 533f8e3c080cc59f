"""benchmarks/stage_chain.py under torchrun (gloo, CPU), the tiny model through the two- and four-GPU stage configs:
the way a several-GPU chain is checked before it costs GPU time. A 3-s stage killed (kill -9 of rank 1) in mid-step,
resumed on two processes and then on one (the DCP checkpoint read by another world size), a 6-s stage through the
63-s config (FSDP with offloaded block inputs), then the sample in one process, with sp = 2 and with split guidance;
and the same kill among four processes, resumed on four and on two."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.launching import run_launch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow
# no loss curves at the end of the stages (train.plots: ~1.4 s of CPU a launch; tests/test_demo_learns.py checks them)
NO_PLOTS = ["--set", "train.plots=false"]


def test_two_process_chain_kill_resume_reshard_and_samples(tmp_path):
    out = tmp_path / "chain.json"
    cmd = [sys.executable, "-m", "benchmarks.stage_chain", "--workdir", str(tmp_path / "work"), "--preset", "tiny",
           "--device", "cpu", "--gpus", "2", "--durations", "3", "6", "--kill-at", "3", "--reshard-gpus", "1",
           "--steps", "2", "--sample-steps", "1", "--out", str(out), "--set", "layout.height=64",
           "--set", "layout.width=96", "--set", "layout.text_tokens=8", "--set", "model.adapter=qkvo", *NO_PLOTS]
    run = run_launch(cmd, None, 540, cwd=ROOT, logs=lambda: sorted((tmp_path / "work").glob("*.log")))
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    result = json.loads(out.read_text())
    killed, last = result["stages"]
    assert [r["config"] for r in result["stages"]] == ["stage1-3s-2gpu.toml", "stage5-63s-2gpu.toml"]
    assert killed["killed"] == "rank 1" and killed["launch_exit_s"] < 30
    # the survivor said one sentence naming the dead rank
    assert len(killed["sentences"]) == 1 and "rank 1 stopped answering: its process" in killed["sentences"][0]
    assert killed["resumed_steps_once"] and killed["steps"] == [1, 2, 3] and killed["steps_asked"] == 3
    assert killed["reshard"]["gpus"] == 1 and killed["reshard"]["resumed_steps_once"]
    assert "resumed from" in killed["reshard"]["resumed_line"]
    assert last["steps"] == [1, 2] and last["steps_asked"] == 2 and last["global_batch"] == 2
    # each step's time beside the model's forward and backward, kept and printed
    assert [t["step"] for t in last["time_by_step"]] == [1, 2]
    assert all(0 < t["optimizer_s"] < t["step_s"] and t["data_s"] >= 0 for t in last["time_by_step"])
    assert "step 2: " in run.stdout and ", optimizer " in run.stdout
    # the checkpoints as `tttv plan` counts them (the tensors; headers and DCP's metadata and per-tensor extras on
    # top: 0.8 MiB for this model's 68 trainable tensors over two processes), and the disk the base weights took
    # given back once stage 2 ran (nothing after stage 1 reads them)
    for row in (killed, last):
        assert row["predicted_checkpoint_gib"] <= row["checkpoint_gib"] <= row["predicted_checkpoint_gib"] + 2**-10
        assert row["predicted_disk_gib"] == 2 * row["predicted_checkpoint_gib"] or row is last
        assert row["disk_free_gib"] > 0
    assert not (tmp_path / "work" / "weights").exists()
    # host memory by process: the launcher and each rank apart, each launch of the stage in turn
    first_launch = killed["host_by_process"][0]
    assert {"launch", "rank 0", "rank 1"} <= set(first_launch), first_launch
    assert all(r["peak_gib"] >= r["resident_max_gib"] > 0 for r in first_launch.values())
    assert len(killed["host_by_process"]) == 2  # the killed launch and its resume
    layouts = {s["layout"]: s for s in result["samples"]}
    assert set(layouts) == {"1", "sp2", "cfg2"} and all(s["exit_code"] == 0 for s in layouts.values())
    for name in ("sp2", "cfg2"):
        assert layouts[name]["max_rel_diff_vs_1"] < 1e-3, layouts[name]


def test_four_process_chain_kill_says_one_sentence_and_reshards_to_two(tmp_path):
    """The 4-GPU stage configs under torchrun with four processes: rank 1 killed in mid-step, the three others stop
    within seconds with ONE sentence that names rank 1 (the last survivor once printed a second one blaming rank 0,
    which had only left after it), resume on four and then on two processes."""
    out = tmp_path / "chain.json"
    cmd = [sys.executable, "-m", "benchmarks.stage_chain", "--workdir", str(tmp_path / "work"), "--preset", "tiny",
           "--device", "cpu", "--gpus", "4", "--durations", "3", "--kill-at", "3", "--reshard-gpus", "2",
           "--steps", "2", "--no-sample", "--out", str(out), "--set", "layout.height=64",
           "--set", "layout.width=96", "--set", "layout.text_tokens=8", "--set", "model.adapter=qkvo", *NO_PLOTS]
    run = run_launch(cmd, None, 540, cwd=ROOT, logs=lambda: sorted((tmp_path / "work").glob("*.log")))
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    (killed,) = json.loads(out.read_text())["stages"]
    assert killed["config"] == "stage1-3s-4gpu.toml" and killed["killed"] == "rank 1"
    assert killed["launch_exit_s"] < 30
    assert len(killed["sentences"]) == 1, killed["sentences"]
    assert killed["sentences"][0].startswith("tttv train: error: rank 1 stopped answering: its process")
    assert killed["resumed_steps_once"] and killed["reshard"]["gpus"] == 2 and killed["reshard"]["resumed_steps_once"]
    assert {"rank 0", "rank 1", "rank 2", "rank 3"} <= set(killed["host_by_process"][0])


def test_wan_recipe_chain_through_its_24gb_configs_and_sample_config(tmp_path):
    """--configs picks another recipe: Wan2.1's 24 GB stage configs with the tiny Wan model, its random base folder
    written by the backbone (save_wan_folder), every stage given the base and the previous stage (Wan's configs name
    a base); then the closing sample through --sample-config (the recipe's bf16 63-s sample config, its model and
    layout keys overridden as the chain's training was): without the chain's preset and base folder the sample
    config would build the 1.3B model and refuse the checkpoint. Offload's host pool is left to size itself (the
    63-s config asks for 38 GiB, more than a CI machine has)."""
    out = tmp_path / "chain.json"
    cmd = [sys.executable, "-m", "benchmarks.stage_chain", "--workdir", str(tmp_path / "work"), "--preset", "wan-tiny",
           "--device", "cpu", "--configs", "configs/wan2.1-1.3b/{stage}-24gb.toml", "--durations", "3", "9", "63",
           "--steps", "2", "--no-kill", "--sample-steps", "1",
           "--sample-config", "configs/wan2.1-1.3b/sample-63s-24gb.toml", "--out", str(out),
           "--set", "layout.height=32", "--set", "layout.width=32", "--set", "layout.text_tokens=16",
           "--set", "train.precision=fp32", "--set", "checkpointing.offload_host_gib=0", *NO_PLOTS]
    run = run_launch(cmd, None, 300, cwd=ROOT, logs=lambda: sorted((tmp_path / "work").glob("*.log")))
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    result = json.loads(out.read_text())
    assert [r["config"] for r in result["stages"]] == ["stage1-3s-24gb.toml", "stage2-9s-24gb.toml",
                                                       "stage5-63s-24gb.toml"]
    assert all(r["steps"] == [1, 2] for r in result["stages"])
    assert "initialised from" in (tmp_path / "work" / "stage-63s.log").read_text()
    (sample,) = result["samples"]
    assert sample["exit_code"] == 0 and sample["config"] == "configs/wan2.1-1.3b/sample-63s-24gb.toml"
    assert (tmp_path / "work" / "sample-63s.latents.safetensors").is_file()
    assert (tmp_path / "work" / "weights" / "transformer" / "config.json").is_file()
