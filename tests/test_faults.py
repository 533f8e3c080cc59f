"""Faults a user can make, through the real command line: each is one sentence on stderr that names the file, key
or flag, exit status 2, no traceback, and nothing written where the command should not write. docs/reliability.md
lists these with the rest of the faults tried (checkpoints, concurrency, signals, disk, kernels)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.cli_errors import one_error_line

DEMO = str(Path(__file__).parents[1] / "configs" / "demo.toml")
# the demo config at its cheapest: one 3-s segment, 3 videos, the word-vector text table, one step
CHEAP = ["layout.duration=3s", "data.demo_videos=3", "data.demo_text_encoder=table", "train.steps=1",
         "train.sample_at_end=false", "train.tensorboard=false"]


def train_args(out: Path, *sets: str, config: str = DEMO) -> list[str]:
    return ["train", config, *[x for s in (*CHEAP, f"train.output_dir={out}", *sets) for x in ("--set", s)]]


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory):
    """The demo set of the CHEAP layout, written once: manifest.jsonl, latents/ and text/."""
    from tttvideo.config.loader import load_config
    from tttvideo.data.demo import build_demo_cache
    from tttvideo.layout import VideoLayout
    from tttvideo.models.backbone import get_preset

    cfg = load_config(DEMO, CHEAP)
    spec = get_preset(cfg.model.preset)
    layout = VideoLayout.from_config(cfg.layout, cfg.ttt)
    return build_demo_cache(tmp_path_factory.mktemp("cache"), layout, spec.in_channels, spec.text_embed_dim, videos=3,
                            text_encoder="table")


def damaged_copy(manifest: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "cache"
    shutil.copytree(manifest.parent, copy)
    return copy / manifest.name


# ---------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("sets, needles", [
    (["train.stepz=3"], ["unknown key 'train.stepz'", "did you mean 'train.steps'"]),
    (["train.steps=abc"], ["train.steps", "expected int"]),
    (["train.lr=-1"], ["train.lr", "out of range"]),
    (["ttt.kind=gru"], ["ttt.kind"]),
    (["layout.height=60"], ["height 60", "multiple of 16"]),
    (["layout.duration=10s"], ["'10s'", "any multiple of 3"]),
], ids=["unknown-key", "wrong-type", "out-of-range", "bad-choice", "height", "duration"])
def test_config_and_layout_mistakes(capsys, tmp_path, sets, needles):
    one_error_line(capsys, train_args(tmp_path / "run", *sets), *needles)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_missing_and_broken_config_files(capsys, tmp_path):
    one_error_line(capsys, ["train", str(tmp_path / "nope.toml")], "nope.toml", "does not exist")
    broken = tmp_path / "broken.toml"
    broken.write_text("[train]\nsteps = = 3\n")
    one_error_line(capsys, ["train", str(broken)], "broken.toml")
    loop = tmp_path / "loop.toml"
    loop.write_text('include = "loop.toml"\n')
    one_error_line(capsys, ["train", str(loop)], "loop.toml")


# ---------------------------------------------------------------------------------------------------- data
def test_data_mistakes(capsys, tmp_path, demo_cache):
    run = tmp_path / "run"
    one_error_line(capsys, train_args(run, f"data.manifest={tmp_path / 'none.jsonl'}"), "none.jsonl",
                  "does not exist")

    bad_json = damaged_copy(demo_cache, tmp_path / "a")
    bad_json.write_text(bad_json.read_text() + "{not json\n")
    one_error_line(capsys, train_args(run, f"data.manifest={bad_json}"), str(bad_json), "not valid JSON")

    gone = damaged_copy(demo_cache, tmp_path / "b")
    victim = sorted((gone.parent / "latents").iterdir())[0]
    victim.unlink()
    one_error_line(capsys, train_args(run, f"data.manifest={gone}"), victim.name, "does not exist")

    cut = damaged_copy(demo_cache, tmp_path / "c")
    victim = sorted((cut.parent / "latents").iterdir())[0]
    victim.write_bytes(victim.read_bytes()[:100])
    one_error_line(capsys, train_args(run, f"data.manifest={cut}"), victim.name)

    # a cache of 3-s videos read by a 6-s config
    one_error_line(capsys, train_args(run, f"data.manifest={demo_cache}", "layout.duration=6s"), "latent")
    assert not (run / "checkpoints").exists()


# ---------------------------------------------------------------------------------------------------- weights
def test_weight_mistakes(capsys, tmp_path):
    from tttvideo.config.loader import load_config
    from tttvideo.models import build_model, save_checkpoint

    run = tmp_path / "run"
    one_error_line(capsys, train_args(run, f"model.pretrained_path={tmp_path / 'nothing'}"), "model.pretrained_path")
    one_error_line(capsys, train_args(run, f"train.init_from={tmp_path / 'nothing'}"), "train.init_from")
    # a checkpoint of another model (the demo's preset with TTT-Linear instead of TTT-MLP)
    torch.manual_seed(0)
    other = save_checkpoint(build_model(load_config(DEMO, ["ttt.kind=linear"])), tmp_path / "linear.safetensors")
    one_error_line(capsys, train_args(run, f"train.init_from={other}"), str(other), "does not fit this model")
    story = tmp_path / "story.json"
    story.write_text('[{"text": "a red circle moves right"}]')
    for name, content in (("zeros.safetensors", b"\x00" * 64), ("cut.safetensors", other.read_bytes()[:-100])):
        bad = tmp_path / name
        bad.write_bytes(content)
        one_error_line(capsys, ["sample", "--checkpoint", str(bad), "--scenes", str(story), "--out",
                               str(tmp_path / "o.mp4")], str(bad), "not a readable safetensors file")
    # the demo model's checkpoint sampled with a 5B config: refused from the file's header, before 5B is built
    one_error_line(capsys, ["sample", "--checkpoint", str(other), "--scenes", str(story), "--out",
                           str(tmp_path / "o.mp4"), "--set", "model.preset=cogvideox-5b"],
                  "saved from model 'tiny-4ch', not 'cogvideox-5b'", "model.preset")
    assert not (tmp_path / "o.mp4").exists()


# ---------------------------------------------------------------------------------------------------- kernels
def test_triton_backend_without_a_gpu_is_a_config_error(capsys, tmp_path, monkeypatch):
    """ttt.backend = 'triton' on a CPU run fails before the model or the demo set is built."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    one_error_line(capsys, train_args(tmp_path / "run", "ttt.backend=triton"), "ttt.backend", "CUDA GPU",
                  "'auto'")
    assert not (tmp_path / "run" / "data").exists()


# ---------------------------------------------------------------------------------------------------- disk
@pytest.fixture(scope="module")
def tiny_model_file(tmp_path_factory):
    from tttvideo.config.loader import load_config
    from tttvideo.models import build_model, save_checkpoint

    torch.manual_seed(0)
    return save_checkpoint(build_model(load_config(DEMO, CHEAP)), tmp_path_factory.mktemp("m") / "model.safetensors")


@pytest.mark.parametrize("where", ["/proc/tttvideo-test/out", "FILE/sub"], ids=["proc", "under-a-file"])
def test_unwritable_outputs_fail_before_any_work(capsys, tmp_path, tiny_model_file, monkeypatch, where):
    """sample --out, profile --out and precompute --out that cannot be written: one sentence naming the flag,
    before the text encoder, the model or a step runs."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    target = Path(where.replace("FILE", str(a_file)))
    story = tmp_path / "story.json"
    story.write_text('[{"text": "a red circle moves right"}]')

    def no_work(*args, **kwargs):
        raise AssertionError("work started before the output was checked")

    import tttvideo.memory.profile.drivers as drivers
    import tttvideo.sample.pipeline as pipeline

    monkeypatch.setattr(pipeline, "make_text_encoder", no_work)
    monkeypatch.setattr(drivers, "profile", no_work)
    one_error_line(capsys, ["sample", "--checkpoint", str(tiny_model_file), "--scenes", str(story), "--out",
                           str(target / "video.mp4")], "--out", "cannot be created")
    one_error_line(capsys, ["profile", DEMO, "--out", str(target)], "--out", "cannot be created")
    one_error_line(capsys, ["precompute", DEMO, "--videos", str(tmp_path), "--captions", str(story), "--vae",
                           str(tmp_path), "--t5", str(tmp_path), "--out", str(target)], "--out", "cannot be created")


def test_output_path_that_is_a_file_or_folder(capsys, tmp_path, tiny_model_file):
    from tttvideo.errors import UserError
    from tttvideo.outputs import check_writable_dir, check_writable_file

    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(UserError, match="is a file, not a folder"):
        check_writable_dir(a_file, "--out")
    with pytest.raises(UserError, match="is a folder; give a file path"):
        check_writable_file(tmp_path, "--out")
    assert check_writable_dir(tmp_path / "new" / "deep", "--out").is_dir()
    assert not list((tmp_path / "new" / "deep").iterdir())  # the probe is gone


def test_missing_mp4_writer_is_found_before_any_work(capsys, tmp_path, tiny_model_file, monkeypatch):
    """Without imageio-ffmpeg, `tttv sample` and a training run that ends with a video say so before denoising or
    training (on the GPU machine where this was found, sampling failed after all denoising steps)."""
    import sys

    import tttvideo.sample.pipeline as pipeline

    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # what an absent package looks like to import
    monkeypatch.setattr(pipeline, "make_text_encoder",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("work started")))
    story = tmp_path / "story.json"
    story.write_text('[{"text": "a red circle moves right"}]')
    one_error_line(capsys, ["sample", "--checkpoint", str(tiny_model_file), "--scenes", str(story), "--out",
                            str(tmp_path / "o.mp4")], "imageio-ffmpeg", "pip install")
    one_error_line(capsys, train_args(tmp_path / "run", "train.sample_at_end=true"), "imageio-ffmpeg",
                   "train.sample_at_end")
    assert not (tmp_path / "run" / "data").exists() and not (tmp_path / "o.mp4").exists()


def test_latents_only_sampling_needs_no_mp4_writer(capsys, tmp_path, tiny_model_file, monkeypatch):
    """`sample.write_video = false` writes latents, no mp4: a machine without imageio-ffmpeg samples (the full-size
    stage chain's sample was refused on the GPU machine for a package it would not have used)."""
    import sys

    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)
    story = tmp_path / "story.json"
    story.write_text('[{"text": "a red circle moves right"}]')
    from tttvideo.cli import main

    code = main(["sample", str(DEMO), "--checkpoint", str(tiny_model_file), "--scenes", str(story), "--out",
                 str(tmp_path / "o.mp4"), "--set", "sample.write_video=false", "--set", "sample.save_latents=true",
                 "--set", "sample.steps=1"])
    assert code == 0, capsys.readouterr().err
    assert list(tmp_path.glob("o*.safetensors")) and not (tmp_path / "o.mp4").exists()
