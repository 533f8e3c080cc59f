"""The disk a run's checkpoints take (`tttvideo.memory.guard.disk`; `tttv plan`'s line: `tttvideo.memory.plan.disk`):
the count against the files a CPU run of the tiny model writes (model file, optimizer state, EMA; full and
fp8-partial), the folder's peak, the plan's line, the trainer's warning at the start and its early pruning before a
save on a nearly full disk."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from tttvideo.config.schema import TrainConfig
from tttvideo.memory.guard.disk import checkpoint_disk, checkpoints_at_once, space_warning
from tttvideo.memory.plan.disk import planned_disk
from tttvideo.memory.techniques import ModelBytes
from tttvideo.runs import EMA_FILE, MODEL_FILE, STATE_FILE
from tttvideo.train import checkpoint as ckpt
from tttvideo.train.trainer import Trainer

from tests.test_train_loop import tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


def payload(path: Path) -> int:
    """Bytes of a safetensors file's tensors: the file less its 8-byte length and JSON header."""
    with open(path, "rb") as f:
        (header,) = struct.unpack("<Q", f.read(8))
    return path.stat().st_size - 8 - header


@pytest.mark.parametrize("extra", [
    ["model.adapter=sft", "train.optimizer=adamw"],
    ["model.adapter=qkvo", "model.frozen_weights=fp8", "train.optimizer=adamw8bit", "train.ema_decay=0.9"],
], ids=["sft-adamw", "qkvo-fp8-adamw8bit-ema"])
def test_count_is_what_a_run_writes(tmp_path, extra):
    if "train.optimizer=adamw8bit" in extra:
        pytest.importorskip("torchao.optim")
    cfg = tiny_config(tmp_path, "train.steps=2", "train.checkpoint_every=1", "train.keep_checkpoints=1",
                      "train.plots=false", "train.cpu_threads=1", *extra)
    Trainer(cfg, quiet=True).run()
    written = ckpt.latest_checkpoint(cfg.train.output_dir)
    planned = planned_disk(cfg)
    # the tensors byte for byte: parameters (fp8-stored frozen layers left out), fp32 EMA
    assert payload(written / MODEL_FILE) == planned.model_file
    assert planned.partial == ("model.frozen_weights=fp8" in extra)
    if planned.ema_file:
        assert payload(written / EMA_FILE) == planned.ema_file
    # the state file: the optimizer's state and a few KiB of counters and random states
    assert planned.optimizer_state <= payload(written / STATE_FILE) <= planned.optimizer_state + 64 * 1024
    # the whole folder: headers, config and manifest on top, a few percent of this tiny model
    assert planned.each <= ckpt.folder_bytes(written) <= planned.each * 1.25 + 256 * 1024
    # from the built model (what the trainer counts with) as from the meta one (what `tttv plan` counts with)
    from tttvideo.models import build_model

    assert checkpoint_disk(ModelBytes.of(build_model(cfg)), cfg) == planned


def test_the_folder_holds_one_more_than_it_keeps_while_writing():
    def at_once(steps, every, keep):
        return checkpoints_at_once(TrainConfig(steps=steps, checkpoint_every=every, keep_checkpoints=keep))

    assert at_once(1000, 100, 3) == 4  # three kept and the next one assembled beside them
    assert at_once(2, 1, 1) == 2  # a killed stage's chain: the newest kept beside the one being written
    assert at_once(2, 500, 3) == 1  # only the last step saves
    assert at_once(250, 100, 3) == 3  # 100, 200 and the last step


def test_space_warning_says_when_the_first_save_would_fail(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path)
    planned = planned_disk(cfg)
    free = {"bytes": planned.each // 2}
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(0, 0, free["bytes"]))
    said = space_warning(tmp_path / "not-made-yet" / "run", planned)
    assert said and "its first save will fail" in said and "train.output_dir" in said
    free["bytes"] = planned.each + 1  # one fits, not all the kept ones beside the next
    said = space_warning(tmp_path / "run", planned)
    assert said and "pruned early" in said
    assert space_warning(tmp_path / "run", planned, held=planned.peak) is None  # a resume: they are already there
    free["bytes"] = planned.peak
    assert space_warning(tmp_path / "run", planned) is None


def fake_checkpoint(root: Path, step: int, size: int) -> Path:
    folder = root / "checkpoints" / f"step-{step:06d}"
    folder.mkdir(parents=True)
    (folder / MODEL_FILE).write_bytes(b"\0" * size)
    (folder / STATE_FILE).write_bytes(b"\0")
    return folder


def test_make_room_prunes_the_oldest_but_never_the_newest(tmp_path, monkeypatch):
    folders = [fake_checkpoint(tmp_path, s, 1000) for s in (1, 2, 3)]
    free = {"bytes": 500}

    def usage(path):  # each pruned checkpoint frees its bytes
        gone = sum(1000 for f in folders if not f.exists())
        return shutil._ntuple_diskusage(0, 0, free["bytes"] + gone)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    assert ckpt.make_room(tmp_path, 1200) == folders[:1]  # 1500 free after one goes
    assert ckpt.make_room(tmp_path, 10_000) == folders[1:2]  # not enough even so: the newest stays
    assert folders[2].exists() and ckpt.make_room(tmp_path, 10_000) == []


def test_trainer_warns_at_the_start_and_prunes_before_a_save(tmp_path, monkeypatch, caplog):
    cfg = tiny_config(tmp_path, "train.steps=3", "train.checkpoint_every=1", "train.keep_checkpoints=3",
                      "train.plots=false", "train.cpu_threads=1")
    each = planned_disk(cfg).each
    # room for two checkpoints and a bit: the third save prunes the first early instead of failing
    room = 2 * each + each // 2

    def usage(path):
        used = sum(ckpt.folder_bytes(p) for _, p in ckpt.list_checkpoints(cfg.train.output_dir))
        return shutil._ntuple_diskusage(0, 0, max(0, room - used))

    monkeypatch.setattr(shutil, "disk_usage", usage)
    with caplog.at_level("WARNING"):
        Trainer(cfg, quiet=True).run()
    said = caplog.text
    assert "older ones will be pruned early" in said  # at the start: 4 at once do not fit
    assert "pruned step-000001 early" in said
    steps = [s for s, _ in ckpt.list_checkpoints(cfg.train.output_dir)]
    assert steps == [2, 3]
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 3


def test_plan_prints_the_disk_line(tmp_path, capsys):
    from tttvideo.cli import main

    main(["plan", "configs/demo.toml", "--gpu-mem", "80GB", "--set", "train.keep_checkpoints=2",
          "--set", "train.steps=1000", "--set", "train.checkpoint_every=100"])
    out = capsys.readouterr().out
    assert "disk (" in out and "): a checkpoint" in out and "holds up to 3 at once (train.keep_checkpoints = 2" in out
