"""Exact resume: a run killed with SIGKILL after a checkpoint and resumed with --resume ends with parameters (and
optimizer state, and the EMA of the weights) bitwise equal to an uninterrupted run, on CPU. Both runs are
subprocesses of the real CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tttvideo.train.checkpoint import list_checkpoints, load_state

STEPS = 12
ARGS = [
    "layout.duration=6s", "data.demo_videos=3", "data.demo_text_encoder=table", "train.batch_size=1",
    "train.grad_accum=2", f"train.steps={STEPS}", "train.checkpoint_every=3", "train.keep_checkpoints=5",
    "train.log_every=1", "train.sample_at_end=false", "train.tensorboard=false", "train.warmup_steps=2",
    "train.text_dropout=0.5", "train.cpu_threads=1", "train.plots=false", "train.ema_decay=0.9",
]


def command(out: Path, *extra: str) -> list[str]:
    sets = [x for a in ARGS + [f"train.output_dir={out}", f"data.demo_dir={out.parent / 'data'}"] for x in ("--set", a)]
    return [sys.executable, "-m", "tttvideo", "train", "configs/demo.toml", *sets, *extra]


def run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.timeout(600)
def test_sigkill_then_resume_is_bitwise_identical(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    full, killed = tmp_path / "full", tmp_path / "killed"
    # the demo set is shared so that both runs read the very same files
    run(command(full))

    proc = subprocess.Popen(command(killed), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            cwd=Path(__file__).parents[1])
    deadline = time.monotonic() + 300
    try:
        while not list_checkpoints(killed) and time.monotonic() < deadline:
            assert proc.poll() is None, "the run ended before its first checkpoint"
            time.sleep(0.02)
        time.sleep(0.3)  # let it get into the next steps, so the kill lands mid-step
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    done = [s for s, _ in list_checkpoints(killed)]
    assert done and done[-1] < STEPS, f"killed too late to test anything: checkpoints {done}"

    run(command(killed, "--resume"))
    a = load_file(str(full / f"checkpoints/step-{STEPS:06d}/model.safetensors"))
    b = load_file(str(killed / f"checkpoints/step-{STEPS:06d}/model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after resume (killed after step {done[-1]})"
    # the EMA of the weights (train.ema_decay) continues exactly too
    ea = load_file(str(full / f"checkpoints/step-{STEPS:06d}/ema.safetensors"))
    eb = load_file(str(killed / f"checkpoints/step-{STEPS:06d}/ema.safetensors"))
    assert ea.keys() == b.keys() and all(torch.equal(ea[n], eb[n]) for n in ea), "EMA differs after resume"
    assert any(not torch.equal(ea[n], a[n]) for n in ea)  # it is an average, not a copy of the weights
    sa = load_state(full / f"checkpoints/step-{STEPS:06d}")
    sb = load_state(killed / f"checkpoints/step-{STEPS:06d}")
    for i, st in sa["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(st[key], sb["optimizer"]["state"][i][key])
    assert torch.equal(sa["noise"]["cpu"], sb["noise"]["cpu"]) and sa["data_position"] == sb["data_position"]
    # the resumed metrics continue the interrupted ones: every step once, same losses as the full run
    import json

    la = [json.loads(x)["loss"] for x in (full / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (killed / "metrics.jsonl").read_text().splitlines()]
    assert la == lb and len(la) == STEPS
