"""Run safety in one process (issue 13): the run folder's lock, what happens to an earlier run (train.if_exists and
--resume / --new / --overwrite), output folders checked before any work, checkpoint manifests with the fallback to
the newest intact checkpoint (through the real CLI, `tttv train --resume` and `tttv sample`), a log that matches the
checkpoint after a resume or a restart, the progress display in a pipe and at 80 columns, and the signal handler.
The signal tests through real processes are in tests/test_train_signals.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest

from tttvideo import runs
from tttvideo.cli import main
from tttvideo.config.loader import load_config
from tttvideo.errors import UserError

from tests.cli_errors import one_error_line

pytestmark = pytest.mark.usefixtures("one_thread")

DEMO = str(Path(__file__).parents[1] / "configs" / "demo.toml")
CHEAP = ["layout.duration=3s", "train.batch_size=1", "data.demo_videos=3", "data.demo_text_encoder=table",
         "train.steps=4", "train.checkpoint_every=2", "train.keep_checkpoints=2", "train.log_every=1",
         "train.sample_at_end=false", "train.tensorboard=false", "train.warmup_steps=1", "train.cpu_threads=1"]


def train_argv(out: Path, *sets: str, flags: tuple[str, ...] = ()) -> list[str]:
    every = (*CHEAP, f"train.output_dir={out}", f"data.demo_dir={out.parent / 'data'}", *sets)
    return ["train", DEMO, *[x for s in every for x in ("--set", s)], *flags]


def steps_of(metrics: Path) -> list[int]:
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()]


def tensorboard_steps(folder: Path, tag: str = "train/loss") -> list[int]:
    """The steps of a scalar as TensorBoard shows them (the accumulator applies purge events)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ---------------------------------------------------------------------------------------------------- the lock
def test_lock_refuses_a_second_holder_naming_it(tmp_path, caplog):
    from tttvideo.locks import RunLock, current_holder

    with RunLock(tmp_path) as first:
        holder = current_holder(tmp_path)
        assert holder is not None and holder.pid == os.getpid() and holder.host == socket.gethostname()
        with pytest.raises(UserError) as err:
            RunLock(tmp_path).acquire()
        text = str(err.value)
        assert f"is in use by another run: pid {os.getpid()} on {socket.gethostname()} since " in text
        assert "--new" in text and str(tmp_path / ".lock") in text and "\n" not in text
        assert first.fd is not None
    assert current_holder(tmp_path) is None  # released: the next one takes it without a word
    with caplog.at_level("WARNING", logger="tttvideo"), RunLock(tmp_path) as again:
        assert again.took_over is None
    assert "stale" not in caplog.text


def test_stale_lock_of_a_dead_process_is_taken_over_with_a_message(tmp_path, caplog):
    from tttvideo.locks import RunLock

    pid = dead_pid()
    (tmp_path / ".lock").write_text(json.dumps({"pid": pid, "host": socket.gethostname(),
                                                "since": "2026-01-02T03:04:05+00:00", "command": "tttv train x"}))
    with caplog.at_level("WARNING", logger="tttvideo"), RunLock(tmp_path) as lock:
        assert lock.took_over is not None and lock.took_over.pid == pid
    assert (f"took over the stale lock of pid {pid} ({socket.gethostname()}, since 2026-01-02 03:04:05+00:00); "
            f"that process is gone") in caplog.text


# ---------------------------------------------------------------------------------------------------- if_exists
def test_second_demo_keeps_the_first_run_and_reuses_the_demo_set(tmp_path, capsys):
    """configs/demo.toml (train.if_exists = 'new'): running it twice keeps the first run untouched, trains the second
    in <output_dir>-2 and says so, and builds the demo set once."""
    out = tmp_path / "demo"
    assert main(train_argv(out, "train.steps=2")) == 0
    first = capsys.readouterr().out
    assert "demo set:" in first  # built
    before = {p: p.read_bytes() for p in (out / "checkpoints").rglob("*") if p.is_file()}
    assert main(train_argv(out, "train.steps=2")) == 0
    second = capsys.readouterr().out
    assert f"this run writes to {tmp_path / 'demo-2'}" in second.replace("\n", "")
    assert "demo set:" not in second  # reused, not built again
    assert {p: p.read_bytes() for p in (out / "checkpoints").rglob("*") if p.is_file()} == before
    assert steps_of(out / "metrics.jsonl") == [1, 2] and steps_of(tmp_path / "demo-2/metrics.jsonl") == [1, 2]
    saved = load_config(tmp_path / "demo-2/checkpoints/step-000002/config.toml")
    assert saved.train.output_dir == str(tmp_path / "demo-2")  # the saved config says where the run is


def test_shared_demo_set_in_use_is_reused_and_never_rewritten(tmp_path, capsys):
    """While another run trains on the demo set (its shared lock), a run of the same settings reuses it and one of
    other settings is refused naming data.demo_dir, instead of rebuilding it under the first run."""
    from tttvideo.locks import DataLock

    assert main(train_argv(tmp_path / "a", "train.steps=1")) == 0  # builds tmp_path/data
    reader = DataLock(tmp_path / "data")
    reader.shared()
    try:
        stamp = (tmp_path / "data/demo.json").read_text()
        assert main(train_argv(tmp_path / "b", "train.steps=1")) == 0
        capsys.readouterr()
        one_error_line(capsys, train_argv(tmp_path / "c", "train.steps=1", "data.demo_videos=4"),
                       f"data.demo_dir {tmp_path / 'data'} holds a demo set of other settings",
                       "another run is training on")
        assert (tmp_path / "data/demo.json").read_text() == stamp
    finally:
        reader.release()
    assert main(train_argv(tmp_path / "c", "train.steps=1", "data.demo_videos=4")) == 0  # free: rebuilt


def test_refuse_names_the_three_flags_and_overwrite_says_what_it_removed(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(train_argv(out, "train.steps=2", "train.if_exists=refuse")) == 0
    capsys.readouterr()
    one_error_line(capsys, train_argv(out, "train.if_exists=refuse"), "already holds checkpoints (newest step-000002)",
                   "--resume", "--new", "--overwrite")
    assert main(train_argv(out, "train.steps=1", "train.if_exists=refuse", flags=("--overwrite",))) == 0
    printed = capsys.readouterr().out.replace("\n", "")
    assert f"removed the earlier run's checkpoints, metrics.jsonl in {out}" in printed
    assert [s for s, _ in runs.list_checkpoints(out)] == [1] and steps_of(out / "metrics.jsonl") == [1]
    with pytest.raises(SystemExit):  # one choice at a time
        main(train_argv(out, flags=("--new", "--overwrite")))


def test_old_overwrite_key_is_read_as_if_exists(tmp_path, caplog):
    """Configs saved by earlier versions (and `tttv sample` reads the run's) still load."""
    old = tmp_path / "old.toml"
    old.write_text("[train]\noverwrite = true\n")
    with caplog.at_level("WARNING", logger="tttvideo"):
        assert load_config(old).train.if_exists == "overwrite"
    assert "old spelling of train.if_exists" in caplog.text
    assert load_config(None, ["train.overwrite=false"]).train.if_exists == "refuse"


# ---------------------------------------------------------------------------------------------------- outputs
@pytest.mark.parametrize("where, needle", [
    ("/proc/tttvideo-test/run", "cannot be created"),
    ("/proc", "is not writable"),
    ("FILE", "is a file, not a folder"),
    ("FILE/sub", "cannot be created"),
], ids=["proc-missing", "proc-read-only", "a-file", "under-a-file"])
def test_unwritable_output_dir_fails_before_any_work(capsys, tmp_path, monkeypatch, where, needle):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    target = where.replace("FILE", str(a_file))

    def no_work(*args, **kwargs):
        raise AssertionError("work started before train.output_dir was checked")

    import tttvideo.models as models

    monkeypatch.setattr(models, "build_model", no_work)
    argv = ["train", DEMO, *[x for s in (*CHEAP, f"train.output_dir={target}") for x in ("--set", s)]]
    one_error_line(capsys, argv, "train.output_dir", target, needle)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits (the /proc cases cover read-only)")
def test_read_only_folder_by_permissions(capsys, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        one_error_line(capsys, train_argv(ro / "run"), "train.output_dir", "cannot be created")
    finally:
        ro.chmod(0o700)


def test_unwritable_demo_dir_fails_before_any_work(capsys, tmp_path):
    one_error_line(capsys, train_argv(tmp_path / "run", "data.demo_dir=/proc/tttvideo-demo"), "data.demo_dir",
                   "/proc/tttvideo-demo", "cannot be created")
    assert not Path("/proc/tttvideo-demo").exists()


# ---------------------------------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A 4-step run with checkpoints at steps 2 and 4 (each with its manifest), made once."""
    out = tmp_path_factory.mktemp("trained") / "run"
    assert main(train_argv(out)) == 0
    return out


@pytest.fixture
def run_copy(trained_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained_run, copy)
    shutil.copytree(trained_run.parent / "data", tmp_path / "data")
    return copy


def test_checkpoint_manifest_lists_sizes_hashes_step_and_meta(trained_run):
    folder = trained_run / "checkpoints/step-000004"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["step"] == 4 and manifest["meta"]["global_batch"] == 1 and manifest["meta"]["data_position"] == 4
    assert set(manifest["files"]) == {"model.safetensors", "state.safetensors", "config.toml"}
    for name, entry in manifest["files"].items():
        assert entry["size"] == (folder / name).stat().st_size and entry["sha256"] == runs.file_digest(folder / name)
    assert runs.verify_checkpoint(folder) == ""


def test_verify_names_hash_mismatch_missing_and_accepts_old_checkpoints(run_copy):
    folder = run_copy / "checkpoints/step-000004"
    model = folder / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-1] ^= 0xFF  # same size, one bit pattern changed in the last tensor
    model.write_bytes(bytes(data))
    assert runs.verify_checkpoint(folder).startswith("model.safetensors: hash mismatch")
    (folder / "config.toml").unlink()
    older = run_copy / "checkpoints/step-000002"
    (older / "state.safetensors").unlink()
    assert runs.verify_checkpoint(older) == "state.safetensors: missing"
    # written before manifests: checked by reading the headers
    legacy = run_copy / "legacy"
    shutil.copytree(run_copy / "checkpoints/step-000004", legacy)
    shutil.copy(older / "model.safetensors", legacy / "model.safetensors")
    (legacy / "manifest.json").unlink()
    assert runs.verify_checkpoint(legacy) == ""
    with open(legacy / "state.safetensors", "r+b") as f:
        f.truncate(1000)
    assert runs.verify_checkpoint(legacy).startswith("state.safetensors: unreadable")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", ["model.safetensors", "state.safetensors"])
def test_truncated_newest_checkpoint_falls_back_for_sample_and_resume(run_copy, tmp_path, capsys, victim):
    """The newest checkpoint's file cut in half: `tttv sample RUN` and `tttv train --resume` warn naming the file
    and use step 2; the resumed run rewrites step 4 intact."""
    damaged = run_copy / "checkpoints/step-000004" / victim
    with open(damaged, "r+b") as f:
        f.truncate(damaged.stat().st_size // 2)
    story = tmp_path / "story.json"
    story.write_text('[{"text": "a red circle moves right on a black background"}]')
    capsys.readouterr()

    assert main(["sample", "--checkpoint", str(run_copy), "--scenes", str(story), "--out", str(tmp_path / "v.mp4"),
                 "--steps", "1"]) == 0
    out, err = capsys.readouterr()
    assert f"checkpoint {damaged.parent} is damaged, {victim}: size mismatch" in err
    assert f"using {run_copy / 'checkpoints/step-000002'} instead" in err and "Traceback" not in err
    assert f"config: {run_copy / 'checkpoints/step-000002/config.toml'}" in out.replace("\n", "")
    assert (tmp_path / "v.mp4").is_file()

    assert main(train_argv(run_copy, flags=("--resume",))) == 0
    out, err = capsys.readouterr()
    assert f"checkpoint {damaged.parent} is damaged, {victim}: size mismatch" in err
    assert f"resumed from {run_copy / 'checkpoints/step-000002'} at step 2" in out.replace("\n", "")
    assert runs.verify_checkpoint(damaged.parent) == ""  # rewritten by the resumed run
    assert steps_of(run_copy / "metrics.jsonl") == [1, 2, 3, 4]


def test_no_intact_checkpoint_is_one_sentence(run_copy, tmp_path, capsys):
    for step in (2, 4):
        path = run_copy / f"checkpoints/step-{step:06d}/model.safetensors"
        with open(path, "r+b") as f:
            f.truncate(100)
    story = tmp_path / "story.json"
    story.write_text('[{"text": "a red circle"}]')
    capsys.readouterr()
    one_error_line(capsys, train_argv(run_copy, flags=("--resume",)), f"{run_copy} has no intact checkpoint",
                   "step-000004/model.safetensors: size mismatch", "step-000002/model.safetensors: size mismatch")
    one_error_line(capsys, ["sample", "--checkpoint", str(run_copy), "--scenes", str(story), "--out",
                            str(tmp_path / "v.mp4")], "has no intact checkpoint", "--checkpoint")
    one_error_line(capsys, train_argv(tmp_path / "next", f"train.init_from={run_copy}"), "train.init_from",
                   "has no intact checkpoint")


def test_disk_full_while_saving_is_one_sentence_and_leaves_no_partial_checkpoint(tmp_path, capsys, monkeypatch):
    import errno

    from tttvideo.train import checkpoint

    real, calls = checkpoint.write_state, []

    def full_disk(state, path):
        calls.append(path)
        if len(calls) == 2:  # the state of the second checkpoint (step 4)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(state, path)

    monkeypatch.setattr(checkpoint, "write_state", full_disk)
    one_error_line(capsys, train_argv(tmp_path / "run"), "cannot write checkpoint step-000004",
                   "No space left on device", "--resume from its newest checkpoint, step-000002")
    assert [p.name for p in (tmp_path / "run/checkpoints").iterdir()] == ["step-000002"]  # no partial folder


def test_disk_full_inside_safetensors_with_space_left_is_one_sentence(tmp_path, capsys, monkeypatch):
    """safetensors wraps the OS error in its own exception, and a 10-GiB model file fails with gigabytes free: a
    torchrun rank 0 printed a SafetensorError traceback for it (two H200s, 3-s stage)."""
    from tttvideo.train import checkpoint

    real, calls = checkpoint.write_state, []

    class SafetensorError(Exception):  # safetensors' own, which is no OSError
        pass

    def full_disk(state, path):
        calls.append(path)
        if len(calls) == 2:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(state, path)

    monkeypatch.setattr(checkpoint, "write_state", full_disk)
    one_error_line(capsys, train_argv(tmp_path / "run"), "cannot write checkpoint step-000004",
                   "No space left on device;", "--resume from its newest checkpoint, step-000002")
    assert [p.name for p in (tmp_path / "run/checkpoints").iterdir()] == ["step-000002"]


# ---------------------------------------------------------------------------------------------------- the log
def _tiny(tmp_path, *extra):
    return load_config(DEMO, [*CHEAP, "train.tensorboard=true", f"train.output_dir={tmp_path / 'run'}",
                              f"data.demo_dir={tmp_path / 'data'}", *extra])


def test_restart_at_step_zero_starts_a_fresh_log(tmp_path):
    """A run killed before its first checkpoint leaves metrics and TensorBoard events; --resume starts at step 0
    and the log then holds each step once, as TensorBoard does."""
    from tttvideo.train.trainer import Trainer

    Trainer(_tiny(tmp_path, "train.steps=3", "train.checkpoint_every=100"), quiet=True).run()
    shutil.rmtree(tmp_path / "run/checkpoints")  # as if killed before it saved
    Trainer(_tiny(tmp_path), resume=True, quiet=True).run()
    assert steps_of(tmp_path / "run/metrics.jsonl") == [1, 2, 3, 4]
    assert tensorboard_steps(tmp_path / "run/tensorboard") == [1, 2, 3, 4]


def test_a_short_runs_loss_windows_do_not_overlap(tmp_path):
    """The summary's first and last loss means cover log_every steps each, or half a run too short for that:
    never the same steps twice."""
    from tttvideo.train.trainer import Trainer

    result = Trainer(_tiny(tmp_path, "train.steps=5", "train.log_every=20"), quiet=True).run()
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 5 and result.loss_window == 2
    assert result.first_loss == pytest.approx(sum(losses[:2]) / 2, rel=1e-6)
    assert result.last_loss == pytest.approx(sum(losses[-2:]) / 2, rel=1e-6)


@pytest.mark.parametrize("earlier_run", [False, True])
def test_resume_without_a_checkpoint_says_which_case(tmp_path, earlier_run):
    """--resume with no checkpoint starts at step 0 either way (a preemptible job's first launch passes it too);
    an empty folder is named as holding no run, since a mistyped train.output_dir looks the same."""
    import contextlib

    from rich.console import Console

    from tttvideo.train import runfolder

    folder = tmp_path / "run"
    folder.mkdir()
    if earlier_run:
        (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    out = StringIO()
    with contextlib.ExitStack() as stack:
        assert runfolder.claim(folder, "resume", stack, Console(file=out, width=300)) == (folder, None)
    said = out.getvalue()
    assert ("holds no earlier run" in said) is not earlier_run
    assert ("no checkpoint in" in said) is earlier_run and "step 0" in said


def test_resume_drops_what_was_logged_after_the_checkpoint(tmp_path):
    """Steps 5 and 6 logged after checkpoint 4 (their checkpoint lost, as a kill leaves it) and a line cut off
    mid-write: after the resume, metrics.jsonl and TensorBoard hold steps 1..8 once each."""
    from tttvideo.train.trainer import Trainer

    Trainer(_tiny(tmp_path, "train.steps=6", "train.checkpoint_every=4"), quiet=True).run()
    shutil.rmtree(tmp_path / "run/checkpoints/step-000006")
    with open(tmp_path / "run/metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')
    Trainer(_tiny(tmp_path, "train.steps=8", "train.checkpoint_every=4"), resume=True, quiet=True).run()
    assert steps_of(tmp_path / "run/metrics.jsonl") == list(range(1, 9))
    assert tensorboard_steps(tmp_path / "run/tensorboard") == list(range(1, 9))


# ---------------------------------------------------------------------------------------------------- progress
def _monitor_output(tmp_path, terminal: bool) -> str:
    from rich.console import Console

    from tttvideo.train.monitor import TrainMonitor

    train = load_config(None, ["train.log_every=10", "train.tensorboard=false"]).train
    console = Console(file=StringIO(), width=80, force_terminal=terminal)
    values = {"loss": 0.2989, "lr": 2e-3, "lr_ssm": 2e-3, "grad_norm": 1.0, "step_time": 0.33,
              "tokens_per_s": 1943.0, "memory_gib": 0.53}
    with TrainMonitor(tmp_path, train, 300, 0, console) as monitor:
        for step in range(1, 31):
            monitor.step(step, values)
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", console.file.getvalue())


def test_progress_in_a_pipe_is_plain_lines_with_step_and_eta(tmp_path):
    text = _monitor_output(tmp_path, terminal=False)
    lines = text.splitlines()
    assert len(lines) == 3 and "━" not in text, text  # one line per log_every steps, no bar
    for line, step in zip(lines, (10, 20, 30)):
        assert re.fullmatch(rf"step\s+{step}/300  loss 0\.2989  lr 2\.00e-03  0\.33 s/step  1,943 tok/s  "
                            rf"mem 0\.53 GiB  ETA \d+:\d\d:\d\d", line), line


def test_progress_bar_at_80_columns_keeps_step_count_and_eta(tmp_path):
    text = _monitor_output(tmp_path, terminal=True)
    bar = [part for part in re.split(r"[\r\n]", text) if part.startswith("train")][-1]
    assert len(bar) <= 80 and "30/300" in bar and re.search(r"ETA \d+:\d\d:\d\d", bar), bar


# ---------------------------------------------------------------------------------------------------- signals
def test_stop_signals_first_asks_second_aborts_and_handlers_come_back():
    from tttvideo.train.stop import StopSignals

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM  # asked to stop; nothing raised
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
