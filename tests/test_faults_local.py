"""Faults of one process and of the outputs (docs/reliability.md): a cache file damaged mid-run or holding NaN/Inf,
the NaN-loss message, a changed train.steps on resume, captions that are not UTF-8, a closed stdout, third-party
noise and wrapped lines, and `tttv sample` writing story by story, atomically, under a lock, with a full disk."""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.cli_errors import one_error_line
from tests.test_sample import RED, checkpoint, story_file  # noqa: F401  (checkpoint is a fixture)
from tests.test_train_loop import _poison, tiny_config
from tttvideo.cli import main
from tttvideo.errors import UserError
from tttvideo.train.trainer import DamagedData, Trainer, TrainingDiverged

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------ cache mid-run
def _damage_after_start_up(monkeypatch):
    """Once the trainer has opened (and checked) its data set: cut one latent file short and put +inf into another
    one's logvar, keeping its header intact. Returns the two paths, filled in when the data set opens."""
    import tttvideo.train.trainer as trainer_mod
    from tttvideo.data.cache import save_latent

    real = trainer_mod.runfolder.open_dataset
    damaged: list[Path] = []

    def open_then_damage(*args, **kwargs):
        cache = real(*args, **kwargs)
        cut, inf = (cache.path(e.latent) for e in cache.entries[:2])
        cut.write_bytes(cut.read_bytes()[:200])
        tensors = load_file(str(inf))
        tensors["logvar"][0, 0, 0, 0] = math.inf
        save_latent(inf, tensors["mean"], tensors["logvar"], 1.0)
        damaged.extend([cut, inf])
        return cache

    monkeypatch.setattr(trainer_mod.runfolder, "open_dataset", open_then_damage)
    return damaged


def test_damaged_cache_files_mid_run_are_passed_over_named_and_counted(tmp_path, monkeypatch, caplog):
    """3 samples, 2 damaged after the start-up check (SafetensorError; +inf in logvar): every step trains on the
    intact one, each file is named once in a warning with the demo set's own advice, and the losses stay near 1
    (an +inf logvar gave losses of 518 and 563)."""
    damaged = _damage_after_start_up(monkeypatch)
    cfg = tiny_config(tmp_path, "train.steps=3", "train.checkpoint_every=3")
    with caplog.at_level(logging.WARNING, logger="tttvideo"):
        result = Trainer(cfg, quiet=True).run()
    assert result.steps_done == 3
    warnings = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(warnings) == 2, warnings
    for path, why in zip(damaged, ("cannot be read", "logvar holds 0 NaN and 1 Inf")):
        [line] = [w for w in warnings if str(path) in w]
        assert why in line and "delete the folder" in line and "precompute" not in line
    losses = [json.loads(x)["loss"] for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(0 < x < 5 for x in losses), losses


def test_too_many_damaged_files_save_and_stop_with_one_sentence(tmp_path, monkeypatch):
    _damage_after_start_up(monkeypatch)
    cfg = tiny_config(tmp_path, "train.steps=3", "train.checkpoint_every=3", "data.max_damaged_samples=0")
    with pytest.raises(DamagedData) as stop:
        Trainer(cfg, quiet=True).run()
    text = str(stop.value)
    assert "more than data.max_damaged_samples = 0" in text and "--resume" in text
    saved = Path(text.split("checkpoint saved in ")[1].split(" at step")[0])
    assert saved.is_dir() and (saved / "model.safetensors").is_file()


def test_damaged_file_at_start_up_advice_depends_on_the_cache(tmp_path):
    """A file of the built-in demo set (demo.json beside its manifest) is rebuilt by deleting the folder; a file of
    a precomputed cache by rerunning precompute."""
    from tttvideo.data.cache import LatentCache
    from tttvideo.data.demo import build_demo_cache
    from tttvideo.layout import VideoLayout

    cfg = tiny_config(tmp_path)
    layout = VideoLayout.from_config(cfg.layout, cfg.ttt)
    manifest = build_demo_cache(tmp_path / "demo", layout, 16, 64, videos=2, text_encoder="table")
    victim = sorted((manifest.parent / "latents").iterdir())[0]
    victim.write_bytes(victim.read_bytes()[:100])
    with pytest.raises(UserError, match=r"demo set is synthetic: delete the folder .*demo \(data.demo_dir\)") as err:
        LatentCache(manifest, layout, 16, 64)
    assert "precompute" not in str(err.value)
    (manifest.parent / "demo.json").unlink()
    with pytest.raises(UserError, match="rerun `tttv precompute`"):
        LatentCache(manifest, layout, 16, 64)


# ------------------------------------------------------------------------------------------------ NaN / resume
def test_nan_message_names_the_samples_and_gives_advice_that_applies(tmp_path, monkeypatch):
    _poison(monkeypatch, {1})
    with pytest.raises(TrainingDiverged) as first:
        Trainer(tiny_config(tmp_path / "a"), quiet=True).run()
    text = str(first.value)
    assert "no checkpoint was written yet: start the run over with --overwrite" in text
    assert "resume from it" not in text and "train.on_nonfinite = 'skip'" in text
    assert "the step read sample(s) demo-000" in text and ".safetensors" in text
    monkeypatch.undo()
    _poison(monkeypatch, {1, 2})
    with pytest.raises(TrainingDiverged) as skipped:
        Trainer(tiny_config(tmp_path / "b", "train.on_nonfinite=skip", "train.max_nonfinite_skips=1"),
                quiet=True).run()
    text = str(skipped.value)
    assert "after 1 skipped step(s)" in text and "a larger train.max_nonfinite_skips" in text
    assert "on_nonfinite = 'skip'" not in text


def test_changed_steps_on_resume_warns_with_the_learning_rate_jump(tmp_path, caplog):
    Trainer(tiny_config(tmp_path, "train.steps=2", "train.checkpoint_every=2", "train.decay=cosine"),
            quiet=True).run()
    with caplog.at_level(logging.WARNING, logger="tttvideo"):
        Trainer(tiny_config(tmp_path, "train.steps=4", "train.checkpoint_every=4", "train.decay=cosine"),
                quiet=True, if_exists="resume").run()
    [line] = [r.getMessage() for r in caplog.records if "train.steps is 4" in r.getMessage()]
    assert "a schedule of 2 steps" in line and "keep train.steps = 2" in line
    assert "so at step 3 train.lr is" in line and "instead of" in line


def test_changed_steps_past_the_old_schedules_end_says_the_rate_stays():
    import dataclasses

    from tttvideo.config.schema import TrainConfig
    from tttvideo.train.optim import schedule_change

    train = TrainConfig(steps=3, lr=1e-4, lr_ssm=1e-3, lr_end=1e-6, warmup_steps=0, decay="linear", decay_ssm="cosine")
    # step 3 is the last of the new schedule and past the old one's end: both give lr_end
    line = schedule_change(2, train, step=2)
    assert "train.lr stays 1e-06" in line and "train.lr_ssm stays 1e-06" in line and "instead of" not in line
    longer = schedule_change(2, dataclasses.replace(train, steps=4), step=1)
    assert "at step 2 train.lr is 6.7e-05 instead of 1e-06" in longer


# ------------------------------------------------------------------------------------------------ precompute
def _vae_folder(root: Path) -> Path:
    """A folder that passes precompute's up-front VAE check (config.json); these runs stop before loading it."""
    folder = root / "vae"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text("{}")
    return folder


def test_captions_that_are_not_utf8_are_one_sentence(capsys, tmp_path):
    captions = tmp_path / "captions.jsonl"
    captions.write_bytes(b'{"video": "a.mp4", "captions": ["a red circle"]}\n'
                         b'{"video": "b.mp4", "captions": ["caf\xe9 au lait"]}\n')
    one_error_line(capsys, ["precompute", "--videos", str(tmp_path), "--captions", str(captions), "--vae",
                            str(_vae_folder(tmp_path)), "--t5", str(tmp_path), "--out", str(tmp_path / "cache")],
                   str(captions), "line 2", "not valid UTF-8", "0xe9")


# ------------------------------------------------------------------------------------------------ every command
class _ClosedPipe:
    def write(self, text):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    def isatty(self):
        return False

    def fileno(self):
        raise OSError("no file descriptor")


def test_closed_stdout_ends_quietly(capsys, monkeypatch):
    """`tttv config keys | head`: the reader goes away; no BrokenPipeError traceback."""
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert main(["config", "keys"]) == 1
    assert capsys.readouterr().err == ""


def test_third_party_import_noise_is_dropped_and_nothing_else(caplog, monkeypatch):
    from tttvideo.cli.library_noise import NOISE, _DropNoise

    monkeypatch.delenv("TTTV_VERBOSE", raising=False)
    assert main(["config", "keys", "ttt"]) == 0
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load /x/torchao/_C_mxfp8.abi3.so: Could not load this library")
        logging.getLogger("torch.utils._pytree").warning(
            "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile ...")
        logging.getLogger("torchao").warning("something torchao wants you to know")
    assert [r.getMessage() for r in caplog.records] == ["something torchao wants you to know"]
    for name in NOISE:  # TTTV_VERBOSE=1 brings them back
        logger = logging.getLogger(name)
        logger.filters = [f for f in logger.filters if not isinstance(f, _DropNoise)]
    monkeypatch.setenv("TTTV_VERBOSE", "1")
    assert main(["config", "keys", "ttt"]) == 0
    assert not any(isinstance(f, _DropNoise) for name in NOISE for f in logging.getLogger(name).filters)
    monkeypatch.delenv("TTTV_VERBOSE")
    main(["config", "keys", "ttt"])  # the filters back, as every command leaves them


def test_output_to_a_pipe_is_not_wrapped(capsys, tmp_path, monkeypatch):
    """rich wrapped lines at 80 columns when stdout is no terminal, cutting printed paths in two."""
    monkeypatch.delenv("COLUMNS", raising=False)
    captions = tmp_path / "captions.jsonl"
    captions.write_text('{"video": "missing.mp4", "captions": ["a red circle"]}\n')
    out = tmp_path / ("a-folder-name-long-enough-that-the-printed-path-passes-eighty-columns" * 2)
    assert main(["precompute", "--videos", str(tmp_path), "--captions", str(captions), "--vae",
                 str(_vae_folder(tmp_path)), "--t5", str(tmp_path), "--out", str(out)]) == 1
    printed = capsys.readouterr().out
    assert any(str(out / "report.json") in line for line in printed.splitlines()), printed
    assert "COLUMNS" not in os.environ  # given back after the command


# ------------------------------------------------------------------------------------------------ sample outputs
def test_each_story_is_written_as_soon_as_it_is_denoised(tmp_path, checkpoint, monkeypatch):  # noqa: F811
    """A crash while denoising the second story keeps the first one's mp4 and scenes.json, and leaves no file
    (final or temporary) of the second."""
    from tttvideo.config.loader import load_config
    import tttvideo.sample.pipeline as pipeline
    from tttvideo.sample.scenes import load_stories

    real, calls = pipeline.denoise, {"n": 0}

    def crash_on_second(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("the machine went away")
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "denoise", crash_on_second)
    cfg = load_config(checkpoint / "config.toml", ["sample.steps=1"])
    stories = load_stories(story_file(tmp_path, [[RED], [RED]]))
    out = tmp_path / "videos"
    with pytest.raises(RuntimeError, match="went away"):
        pipeline.sample_stories(cfg, stories, out, checkpoint=checkpoint, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["story-000.mp4", "story-000.scenes.json"]


def test_mp4_appears_under_its_name_only_when_complete(tmp_path):
    """The mp4 is renamed into place only when ffmpeg has finished it; an interrupted or unfinished one (ffmpeg
    could not write its index: a full disk, which imageio does not report) never takes the final name."""
    import numpy as np

    from tttvideo.sample.video import Mp4Writer, mp4_problem

    path = tmp_path / "v.mp4"
    frames = np.zeros((4, 16, 16, 3), dtype=np.uint8)
    with Mp4Writer(path, fps=16) as w:
        w.append(frames)
        assert not path.exists()  # a kill here leaves no truncated v.mp4 (ffmpeg writes its temporary)
    assert path.is_file() and not w.tmp.exists() and mp4_problem(path) == ""
    with pytest.raises(KeyboardInterrupt):
        with Mp4Writer(tmp_path / "cut.mp4", fps=16) as w:
            w.append(frames)
            raise KeyboardInterrupt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.mp4"]
    whole = path.read_bytes()
    for cut in (len(whole) - 100, len(whole) // 2, 6):
        (tmp_path / "short.mp4").write_bytes(whole[:cut])
        assert mp4_problem(tmp_path / "short.mp4"), cut


def test_full_disk_while_writing_keeps_the_written_stories(capsys, tmp_path, checkpoint, monkeypatch):  # noqa: F811
    import tttvideo.sample.pipeline as pipeline

    real, calls = pipeline.write_scenes, {"n": 0}

    def full_on_second(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "write_scenes", full_on_second)
    out = tmp_path / "videos"
    one_error_line(capsys, ["sample", "--checkpoint", str(checkpoint), "--scenes",
                            str(story_file(tmp_path, [[RED], [RED], [RED]])), "--out", str(out), "--steps", "1"],
                   "cannot write", "story-001.scenes.json", "No space left on device", "MiB free",
                   f"kept ({out / 'story-000.mp4'})", "'story-001' (2 of 3)")
    assert (out / "story-000.mp4").is_file() and (out / "story-000.scenes.json").is_file()
    assert not [p for p in out.iterdir() if p.name.startswith(".story")]


def test_second_sample_to_the_same_out_refuses_and_sp_needs_torchrun(capsys, tmp_path, checkpoint,  # noqa: F811
                                                                     monkeypatch):
    import tttvideo.sample.pipeline as pipeline
    from tttvideo.outputs import output_lock

    def no_work(*args, **kwargs):
        raise AssertionError("work started")

    monkeypatch.setattr(pipeline, "make_text_encoder", no_work)
    story = story_file(tmp_path, [RED])
    out = tmp_path / "one.mp4"
    args = ["sample", "--checkpoint", str(checkpoint), "--scenes", str(story), "--out", str(out), "--steps", "1"]
    with output_lock([out], out):  # another sample is writing one.mp4
        one_error_line(capsys, args, "--out", "is in use by another run: pid", ".one.mp4.lock", "another --out")
    one_error_line(capsys, [*args, "--set", "parallel.sp=2"], "parallel.sp = 2", "WORLD_SIZE",
                   "torchrun --nproc_per_node 2", "--set parallel.sp=1")
    assert not out.exists()



def test_a_rank_leaves_without_the_interpreters_teardown(tmp_path):
    """A torchrun rank ends with os._exit once its output and its log handlers are flushed: leaving on a user error
    with its process group up (whose teardown now and then aborted a gloo rank after its sentence: torchrun then
    reported exit -6, not 2), on a bug (its traceback, status 1), and after a complete run that closed its group
    (objects still holding its process groups went in the teardown, where a rank that had written everything once
    died with SIGABRT: the fp8 resume test of tests/test_parallel_train.py failed so in CI). A process that is no
    launch's rank keeps the teardown, whether it never had a group or holds one of its own around a complete
    command (an in-process caller). The child's atexit line shows whether the teardown ran; its buffered log line
    (a MemoryHandler, written out only when flushed) shows that the handlers were flushed."""
    import subprocess

    script = (
        "import atexit, logging, logging.handlers, sys, torch.distributed as dist\n"
        "from tttvideo.cli import main\n"
        "import tttvideo.cli.config_cmd as config_cmd\n"
        "import tttvideo.parallel.group as group\n"
        "mode = sys.argv[1]\n"
        "if mode != 'none':\n"
        f"    dist.init_process_group('gloo', init_method='file://{tmp_path}/pg-' + mode, rank=0, world_size=1)\n"
        "    group._started = mode != 'caller'\n"
        "if mode == 'closed':\n"
        "    dist.destroy_process_group()\n"
        f"    target = logging.FileHandler('{tmp_path}/log.txt')\n"
        "    handler = logging.handlers.MemoryHandler(1000, flushLevel=logging.CRITICAL, target=target)\n"
        "    logging.getLogger('tttvideo').addHandler(handler)\n"
        "    logging.getLogger('tttvideo').warning('the last line')\n"
        "if mode == 'bug':\n"
        "    config_cmd.run = lambda args: 1 / 0\n"
        "atexit.register(lambda: print('teardown', flush=True))\n"
        "error = mode in ('group', 'none')\n"
        "raise SystemExit(main(['train', 'no-such-config.toml'] if error else ['config', 'keys', 'ttt']))\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    for mode, status, teardown in (("group", 2, False), ("none", 2, True), ("closed", 0, False), ("bug", 1, False),
                                   ("caller", 0, True)):
        run = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, env=env,
                             timeout=120)
        assert run.returncode == status, (mode, run.stderr[-2000:])
        assert ("teardown" in run.stdout) == teardown, mode
        if status == 2:
            assert "tttv train: error:" in run.stderr and "no-such-config.toml" in run.stderr
        elif status == 1:
            assert "ZeroDivisionError" in run.stderr and "Traceback" in run.stderr
        else:
            assert "ttt.kind" in run.stdout  # the command's output came out before the exit
    assert (tmp_path / "log.txt").read_text() == "the last line\n"


def test_a_failed_write_into_a_missing_folder_still_says_the_disks_free_space(tmp_path):
    """The folder a failed write was to make may not exist: the free space is that of its nearest existing parent."""
    from tttvideo.outputs import write_failure

    err = OSError(28, "No space left on device")
    said = write_failure(tmp_path / "not" / "made" / "out.mp4", err)
    assert said.startswith("No space left on device; ") and said.endswith(" MiB free on its disk")
