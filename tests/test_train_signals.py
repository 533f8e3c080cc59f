"""Run safety through real `tttv train` processes: SIGTERM and SIGINT save the step they interrupt and print the
command that resumes it (exit 143 / 130), and the resumed run ends bitwise where an uninterrupted one does; after a
SIGKILL past a checkpoint the resumed log (metrics.jsonl and TensorBoard) holds each step once; a second run on a
running folder refuses naming the holder, and the lock of a killed run is taken over with a message."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tttvideo.cli import main
from tttvideo.train.checkpoint import list_checkpoints, load_state

ROOT = Path(__file__).parents[1]
STEPS = 12
ARGS = [
    "layout.duration=3s", "data.demo_videos=3", "data.demo_text_encoder=table", "train.batch_size=1",
    "train.grad_accum=2", f"train.steps={STEPS}", "train.checkpoint_every=4", "train.keep_checkpoints=5",
    "train.log_every=1", "train.sample_at_end=false", "train.tensorboard=true", "train.warmup_steps=2",
    "train.text_dropout=0.5", "train.cpu_threads=1", "train.plots=false",
]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def argv(out: Path, *extra: str) -> list[str]:
    sets = [x for a in ARGS + [f"train.output_dir={out}", f"data.demo_dir={out.parent / 'data'}"] for x in ("--set", a)]
    return ["train", "configs/demo.toml", *sets, *extra]


def tttv(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "tttvideo", *args]


def start(out: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    """A `tttv train` process writing stdout + stderr to a file (a pipe could fill up and stall it)."""
    log = out.parent / f"{out.name}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(tttv(argv(out, *extra)), stdout=f, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT)
    return proc, log


def logged_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


def wait_for(proc: subprocess.Popen, what, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert proc.poll() is None, "the run ended before the test could interrupt it"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def tensorboard_scalars(folder: Path, tag: str = "train/loss") -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()  # applies the purge events a resumed writer leaves
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def assert_same_end(a: Path, b: Path) -> None:
    """Parameters, AdamW moments, noise stream and data position bitwise equal at the last step; each step logged
    once with the same loss, in metrics.jsonl and in TensorBoard."""
    last = f"checkpoints/step-{STEPS:06d}"
    pa, pb = load_file(str(a / last / "model.safetensors")), load_file(str(b / last / "model.safetensors"))
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    sa, sb = load_state(a / last), load_state(b / last)
    for i, st in sa["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(st[key], sb["optimizer"]["state"][i][key]), (i, key)
    assert torch.equal(sa["noise"]["cpu"], sb["noise"]["cpu"]) and sa["data_position"] == sb["data_position"]
    ma = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    mb = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in mb] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in ma] == [m["loss"] for m in mb]
    ta, tb = tensorboard_scalars(a / "tensorboard"), tensorboard_scalars(b / "tensorboard")
    assert [s for s, _ in tb] == list(range(1, STEPS + 1)) and ta == tb


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The uninterrupted run every interrupted one is compared with (the demo set it writes is shared)."""
    out = tmp_path_factory.mktemp("signals") / "full"
    proc = subprocess.run(tttv(argv(out)), capture_output=True, text=True, timeout=300, cwd=ROOT, env=ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out


def stop_with(out: Path, signum: int, exit_code: int, after_steps: int) -> tuple[int, str]:
    """Start a run in `out`, send `signum` once `after_steps` steps are logged, expect `exit_code`; returns the last
    logged step and the run's output."""
    proc, log = start(out)
    try:
        wait_for(proc, lambda: len(logged_steps(out)) >= after_steps)
        proc.send_signal(signum)
        assert proc.wait(timeout=120) == exit_code
    finally:
        proc.kill()
    return logged_steps(out)[-1], log.read_text()


@pytest.mark.timeout(600)
def test_sigterm_saves_prints_the_resume_command_and_resumes_bitwise(full_run):
    out = full_run.parent / "term"
    step, text = stop_with(out, signal.SIGTERM, 143, after_steps=5)  # past the checkpoint of step 4
    assert 4 < step < STEPS, text
    assert f"stopped by SIGTERM after step {step} of {STEPS}" in text, text
    assert [s for s, _ in list_checkpoints(out)][-1] == step  # the interrupted step is saved
    command = text.split("resume with: ", 1)[1].splitlines()[0]
    words = shlex.split(command)
    assert words[:2] == ["tttv", "train"] and words[-1] == "--resume" and f"train.output_dir={out}" in words
    resumed = subprocess.run([sys.executable, "-m", "tttvideo", *words[1:]], capture_output=True, text=True,
                             timeout=300, cwd=ROOT, env=ENV)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"resumed from {out / f'checkpoints/step-{step:06d}'}" in resumed.stdout.replace("\n", "")
    assert_same_end(full_run, out)


@pytest.mark.timeout(600)
def test_sigint_saves_the_interrupted_step_and_exits_130(full_run):
    out = full_run.parent / "int"
    step, text = stop_with(out, signal.SIGINT, 130, after_steps=2)  # before the first periodic checkpoint (step 4)
    assert step < STEPS and f"stopped by SIGINT after step {step} of {STEPS}" in text, text
    assert [s for s, _ in list_checkpoints(out)][-1] == step and "--resume" in text
    assert "Traceback" not in text


@pytest.mark.timeout(600)
def test_sigkill_past_a_checkpoint_then_resume_logs_each_step_once(full_run):
    out = full_run.parent / "killed"
    proc, _ = start(out)
    try:
        while True:  # stop it where steps past its newest checkpoint are logged (not right after a save)
            wait_for(proc, lambda: len(logged_steps(out)) >= 6)
            proc.send_signal(signal.SIGSTOP)
            saved = [s for s, _ in list_checkpoints(out)]
            if saved and logged_steps(out)[-1] > saved[-1]:
                break
            proc.send_signal(signal.SIGCONT)
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    saved = [s for s, _ in list_checkpoints(out)]
    assert saved and logged_steps(out)[-1] > saved[-1], (saved, logged_steps(out))
    assert max(s for s, _ in tensorboard_scalars(out / "tensorboard")) > saved[-1]  # logged past the checkpoint
    resumed = subprocess.run(tttv(argv(out, "--resume")), capture_output=True, text=True, timeout=300, cwd=ROOT,
                             env=ENV)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert_same_end(full_run, out)


@pytest.mark.timeout(600)
def test_second_run_refuses_naming_the_holder_and_a_dead_holders_lock_is_taken_over(tmp_path, capsys):
    out = tmp_path / "run"
    proc, log = start(out, "--set", "train.steps=100000", "--set", "train.checkpoint_every=2")
    try:
        wait_for(proc, lambda: len(logged_steps(out)) >= 3)
        # the run that used to delete it: --overwrite on the folder of a running run
        assert main(argv(out, "--overwrite")) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert f"is in use by another run: pid {proc.pid} on {socket.gethostname()} since " in err, err
        assert proc.poll() is None and list_checkpoints(out), "the running run lost its checkpoints"
        assert main(argv(out, "--resume")) == 2 and f"pid {proc.pid}" in capsys.readouterr().err
        # --new leaves the running run alone and trains beside it
        assert main(argv(out, "--new", "--set", "train.steps=1")) == 0
        assert f"this run writes to {out.parent / 'run-2'}" in capsys.readouterr().out.replace("\n", "")
        assert list_checkpoints(out.parent / "run-2")
    finally:
        proc.send_signal(signal.SIGKILL)  # dies holding the lock: the kernel lets it go, its record stays
        proc.wait()
    newest = [s for s, _ in list_checkpoints(out)][-1]
    assert main(argv(out, "--resume", "--set", f"train.steps={newest}")) == 0
    captured = capsys.readouterr()
    assert f"took over the stale lock of pid {proc.pid} ({socket.gethostname()}, since " in captured.err
    assert "that process is gone" in captured.err and "nothing to do" in captured.out
