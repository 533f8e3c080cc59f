"""User mistakes that once ended in a Python traceback or were found only after the heavy work (a review of the
commands on a CPU): each is now one sentence, exit status 2, said before anything loads."""

from __future__ import annotations

import json

import pytest
import torch

from tests.cli_errors import one_error_line
from tests.test_sample import RED, checkpoint, story_file  # noqa: F401  (checkpoint is a fixture)
from tttvideo.cli import main
from tttvideo.config.loader import load_config
from tttvideo.device import resolve_device
from tttvideo.errors import ConfigError, UserError


@pytest.mark.parametrize("name", ["gpu", "cpu:abc", "cuda:x", "", "meta", "cuda:0 "])
def test_a_device_that_is_no_device_is_refused_where_the_config_loads(name):
    with pytest.raises(ConfigError, match="train.device in --set: .* is not a device; use 'auto', 'cpu', 'cuda'"):
        load_config(None, [f'train.device="{name}"'])
    with pytest.raises(UserError, match="--device is .* which is not a device"):
        resolve_device(name, "--device")


def test_device_names_that_are_devices_pass():
    cfg = load_config(None, ['train.device="cuda:1"', 'sample.device="cpu"', 'data.device="auto"'])
    assert (cfg.train.device, cfg.sample.device, cfg.data.device) == ("cuda:1", "cpu", "auto")
    assert resolve_device("cpu").type == "cpu"


@pytest.mark.parametrize("name, missing", [("cuda:1", "no CUDA device"), ("mps", "no Apple GPU")])
def test_an_accelerator_the_machine_lacks_is_one_sentence(monkeypatch, name, missing):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(UserError, match=f"--device is '{name}' but {missing}.*use 'cpu' or 'auto'"):
        resolve_device(name, "--device")


@pytest.mark.parametrize("argv, needle", [
    (["--patch-size", "0"], "patch size 0 must be positive"),
    (["--patch-size", "-2"], "patch size -2 must be positive"),
    (["--height", "0"], "height 0 must be positive"),
])
def test_layout_sizes_must_be_positive(capsys, argv, needle):
    one_error_line(capsys, ["layout", *argv], needle)


def test_plan_out_is_checked_before_planning(capsys, tmp_path, monkeypatch):
    import tttvideo.memory.plan.planner as planner

    monkeypatch.setattr(planner, "plan", lambda *a, **k: pytest.fail("planned before checking --out"))
    config = tmp_path / "run.toml"
    config.write_text('[layout]\nheight = 32\nwidth = 48\n')
    base = ["plan", str(config), "--gpu-mem", "24GiB"]
    scenes = tmp_path / "story.json"
    scenes.write_text("[]")
    one_error_line(capsys, [*base, "--out", str(scenes)], "a plan is a TOML config; name a .toml file")
    one_error_line(capsys, [*base, "--out", str(tmp_path)], "is a folder")
    one_error_line(capsys, [*base, "--out", str(config)], "is CONFIG itself")
    mine = tmp_path / "mine.toml"
    mine.write_text("[train]\nsteps = 5\n")
    one_error_line(capsys, [*base, "--out", str(mine)], "exists and is not a plan tttv plan wrote")
    assert mine.read_text() == "[train]\nsteps = 5\n" and json.loads(scenes.read_text()) == []


def test_an_earlier_plan_may_be_replaced(tmp_path):
    from tttvideo.cli.plan_cmd import check_plan_out
    from tttvideo.memory.plan.planner import PLAN_HEADER

    earlier = tmp_path / "plan.toml"
    earlier.write_text(PLAN_HEADER + "tttv plan ...\n")
    assert check_plan_out(str(earlier), None) == earlier


@pytest.mark.parametrize("content, needle", [
    ('[{"text": "a red ball"}]', "is not a costs table"),
    ('{"h100": 3}', "the 'h100' table is not one benchmarks/plan_calibration.py writes"),
])
def test_a_costs_file_that_is_no_costs_table(tmp_path, content, needle):
    from tttvideo.memory.plan.costs import load_costs

    path = tmp_path / "costs.json"
    path.write_text(content)
    with pytest.raises(UserError, match=needle):
        load_costs("h100", path)


def test_plan_of_an_unmeasured_preset_says_so(capsys):
    assert main(["plan", "configs/demo.toml", "--gpu-mem", "141GiB", "--gpus", "8"]) == 1
    err = capsys.readouterr().err
    assert "has measured costs" in err and "benchmarks/plan_calibration.py" in err and "more GPUs" not in err


def test_sample_checks_vae_and_text_encoder_folders_and_names_flags(capsys, tmp_path, checkpoint,  # noqa: F811
                                                                    monkeypatch):
    import tttvideo.sample.pipeline as pipeline

    monkeypatch.setattr(pipeline, "make_text_encoder", lambda *a, **k: pytest.fail("work started"))
    story = story_file(tmp_path, [RED])
    args = ["sample", "--checkpoint", str(checkpoint), "--scenes", str(story), "--out", str(tmp_path / "a.mp4")]
    one_error_line(capsys, [*args, "--vae", str(tmp_path / "nonexist")], "VAE folder", "does not exist")
    one_error_line(capsys, [*args, "--text-encoder", str(tmp_path / "nonexist")], "--text-encoder",
                   "text encoder folder", "does not exist")
    one_error_line(capsys, [*args, "--steps", "0"], "sample.steps in --steps: 0 is out of range")
    one_error_line(capsys, [*args, "--device", "gpu"], "sample.device in --device", "is not a device")
    one_error_line(capsys, [*args, "--set", "sample.steps=0"], "sample.steps in --set: 0 is out of range")


def test_a_top_level_key_and_a_folder_as_config(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("steps = 3\n[train]\nseed = 1\n")
    with pytest.raises(ConfigError, match="key 'steps' in .*run.toml stands outside any section; put it under"):
        load_config(config)
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "a.toml").write_text("")
    with pytest.raises(ConfigError, match=r"is not a file; configs in .*configs/: a.toml"):
        load_config(folder)


def test_a_run_folder_before_its_first_checkpoint(tmp_path):
    from tttvideo.runs import resolve_checkpoint

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("[train]\nsteps = 5\n")
    with pytest.raises(UserError, match="run folder .* holds no checkpoint yet"):
        resolve_checkpoint(run)
    with pytest.raises(UserError, match="is neither a model file"):
        resolve_checkpoint(tmp_path)


def test_an_unquoted_list_in_set_gets_the_quoted_form():
    with pytest.raises(ConfigError, match=r"""--set 'checkpointing.keep=\["attention", "matmul"\]'"""):
        load_config(None, ["checkpointing.keep=[attention, matmul]"])


def test_a_mistyped_command_and_an_unknown_option(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["trian", "configs/demo.toml"])
    assert exit_.value.code == 2
    assert "unknown command 'trian' (did you mean 'train'?)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["layout", "--bogus"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "usage: tttv layout" in err
    assert "tttv layout: error: unrecognized arguments: --bogus" in err
