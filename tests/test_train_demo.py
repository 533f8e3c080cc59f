"""The main job, shortened for CI: `tttv train configs/demo.toml` trains the tiny model on the synthetic set, writes
checkpoints, TensorBoard events and metrics, reports a falling loss and writes one multi-scene mp4."""

from __future__ import annotations

import json

import pytest

from tttvideo.cli import main


@pytest.mark.timeout(300)
def test_demo_main_job_shortened(tmp_path, capsys):
    out = tmp_path / "demo"
    code = main(["train", "configs/demo.toml", "--set", "train.steps=40", "--set", "train.log_every=10",
                 "--set", "train.checkpoint_every=20", "--set", f"train.output_dir={out}", "--set", "sample.steps=4",
                 "--set", f"data.demo_dir={tmp_path / 'demo-data'}", "--set", "train.plots=false"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert (out / "checkpoints/step-000040/model.safetensors").is_file()
    assert (out / "checkpoints/step-000020/state.safetensors").is_file()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 40
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.9 * first, f"loss did not fall: {first:.4f} -> {last:.4f}"
    assert "loss: mean of the first 10 steps" in printed and "lower" in printed

    # one multi-scene video from the trained model, at the layout's frame count and resolution
    import imageio_ffmpeg

    video = out / "samples/step-000040.mp4"
    assert video.is_file() and str(video) in printed.replace("\n", "")
    frames, _ = imageio_ffmpeg.count_frames_and_secs(str(video))
    assert frames == 97  # 6 s at 16 fps + 1
    story = json.loads((out / "samples/step-000040.scenes.json").read_text())
    assert len(story["scenes"]) == 2 and story["scenes"][1]["requires_scene_transition"]
    # train.plots = false: the video is scored all the same, but neither picture is drawn nor named
    # (tests/test_demo_learns.py checks both where they are on, the default)
    assert "demo score" in printed and "look at what it learned" not in printed
    assert not (out / "frames.png").exists() and not (out / "loss.png").exists()
