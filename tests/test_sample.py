"""`tttv sample` end to end on CPU with the tiny model: mp4s with the right frame counts, the T5 and VAE paths with
small random models saved in the real formats, seed determinism, block offload bookkeeping, and exit 2 with one
line for bad input."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from tttvideo.cli import main
from tttvideo.config.loader import dump_toml, load_config
from tttvideo.data.video import read_frames
from tttvideo.layout import VideoLayout
from tttvideo.models import save_checkpoint
from tttvideo.sample.guidance import denoise
from tttvideo.sample.model import load_model
from tttvideo.sample.offload import BlockOffloader
from tttvideo.sample.scenes import load_stories

from tests.test_sample_guidance import NoBatchTwo  # the model as a card too small for batch 2 runs it

TINY = [
    'model.preset="tiny"', 'model.dtype="fp32"', 'model.adapter="sft"',
    # 32x48 px = 4x6 latents = 6 tokens per frame: the CPU cost of a step stays small
    "layout.height=32", "layout.width=48", "layout.text_tokens=16",
    "ttt.mini_batch_size=16", "ttt.scan_checkpoint_group_size=0", 'ttt.backend="reference"',
    'data.demo_text_encoder="table"', 'sample.device="cpu"',
]
RED = {"text": "a red circle moves right on a black background", "neg_text": "blurry"}
BLUE = {"text": "a blue square moves up on a grey background", "requires_scene_transition": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random model saved the way `tttv train` saves a checkpoint: model.safetensors + config.toml."""
    from tttvideo.models import build_model

    cfg = load_config(None, TINY)
    torch.manual_seed(0)
    model = build_model(cfg)
    folder = tmp_path_factory.mktemp("run") / "checkpoints" / "step-000001"
    save_checkpoint(model, folder / "model.safetensors")
    (folder / "config.toml").write_text(dump_toml(cfg))
    torch.save({}, folder / "state.pt")  # a checkpoint folder is complete with its training state
    return folder


def story_file(tmp_path, content, name="story.json"):
    p = tmp_path / name
    p.write_text(json.dumps(content))
    return p


def run_cli(*args):
    return main(["sample", *map(str, args)])


def test_tiny_end_to_end_writes_a_readable_mp4(tmp_path, checkpoint):
    out = tmp_path / "out.mp4"
    rc = run_cli("--checkpoint", checkpoint, "--scenes", story_file(tmp_path, [RED, BLUE]), "--out", out,
                 "--steps", 2, "--solver", "dpm++2m", "--cfg", 3)
    assert rc == 0
    video = read_frames(out)
    # 2 scenes = 6 s = 25 latent frames -> 1 + 4 * 24 = 97 frames at 16 fps, at the layout's resolution
    assert video.shape == (97, 32, 48, 3)
    assert video.std() > 0  # not a blank video
    saved = json.loads((tmp_path / "out.scenes.json").read_text())
    assert saved["sampling"]["frames"] == 97 and saved["sampling"]["duration_s"] == 6
    assert [s["text"] for s in saved["scenes"]] == [RED["text"], BLUE["text"]]


def test_several_stories_one_call_same_seed_same_video(tmp_path, checkpoint):
    """Two identical one-scene stories in one file: two videos, identical because each story starts from the same
    seed, so a story does not depend on what else is sampled with it."""
    out = tmp_path / "videos"
    rc = run_cli("--checkpoint", checkpoint.parent.parent, "--scenes", story_file(tmp_path, [[RED], [RED]]),
                 "--out", out, "--steps", 1, "--seed", 5)
    assert rc == 0
    a, b = read_frames(out / "story-000.mp4"), read_frames(out / "story-001.mp4")
    assert a.shape == (49, 32, 48, 3)
    assert (a == b).all()


def test_a_story_with_its_own_seed_is_sampled_from_it(tmp_path, checkpoint):
    """Story.seed (the Python API) replaces sample.seed for that story alone: the same story under seeds 5 and 6
    differs, and under seed 5 it equals the video `--seed 5` gives; the scenes file records the story's seed."""
    from dataclasses import replace

    from tttvideo.sample.pipeline import sample_stories

    cfg = load_config(checkpoint / "config.toml", ["sample.steps=1", "sample.seed=0"])
    [story] = load_stories(story_file(tmp_path, [RED]))
    results = sample_stories(cfg, [replace(story, name="s5", seed=5), replace(story, name="s6", seed=6)],
                             tmp_path / "own", checkpoint=checkpoint, progress=False)
    assert run_cli("--checkpoint", checkpoint.parent.parent, "--scenes", story_file(tmp_path, [RED]), "--out",
                   tmp_path / "cli.mp4", "--steps", 1, "--seed", 5) == 0
    five, six = (read_frames(r.video) for r in results)
    assert (five == read_frames(tmp_path / "cli.mp4")).all() and not (five == six).all()
    assert json.loads(results[1].scenes.read_text())["sampling"]["seed"] == 6


def test_latents_only_skips_the_mp4(tmp_path, checkpoint, capsys):
    """sample.write_video = false: the latents and scenes.json are written, no mp4, and the latents are the ones a
    run that writes the mp4 saves; with save_latents off as well it is one sentence, exit 2."""
    from safetensors.torch import load_file

    scenes = story_file(tmp_path, [RED])
    common = ("--checkpoint", checkpoint, "--scenes", scenes, "--steps", 1, "--set", "sample.save_latents=true")
    assert run_cli(*common, "--out", tmp_path / "full.mp4") == 0
    assert run_cli(*common, "--out", tmp_path / "lat.mp4", "--set", "sample.write_video=false") == 0
    assert not (tmp_path / "lat.mp4").exists() and (tmp_path / "lat.scenes.json").is_file()
    assert json.loads((tmp_path / "lat.scenes.json").read_text())["sampling"]["frames"] == 49
    full, lat = (load_file(str(tmp_path / f"{n}.latents.safetensors"))["latents"] for n in ("full", "lat"))
    assert torch.equal(full, lat)
    capsys.readouterr()
    assert run_cli("--checkpoint", checkpoint, "--scenes", scenes, "--out", tmp_path / "none.mp4", "--steps", 1,
                   "--set", "sample.write_video=false") == 2
    err = capsys.readouterr().err
    assert "sample.save_latents = true" in err and "Traceback" not in err


def test_denoise_seed_determinism(checkpoint, tmp_path):
    cfg = load_config(checkpoint / "config.toml", ["sample.steps=2", 'sample.solver="dpm++2m"', "sample.cfg=2"])
    model = load_model(cfg, checkpoint, torch.device("cpu")).model
    [story] = load_stories(story_file(tmp_path, [RED]))
    layout = VideoLayout.from_config(cfg.layout, cfg.ttt, story.duration_s)
    gen = torch.Generator().manual_seed(0)
    cond, uncond = torch.randn(1, 16, 64, generator=gen), torch.zeros(1, 16, 64)
    first = denoise(model, layout, cond, uncond, cfg.sample, torch.device("cpu"))
    again = denoise(model, layout, cond, uncond, cfg.sample, torch.device("cpu"))
    assert first.shape == (1, 13, 16, 4, 6)
    assert torch.equal(first, again)
    cfg.sample.seed = 1
    other = denoise(model, layout, cond, uncond, cfg.sample, torch.device("cpu"))
    assert not torch.allclose(first, other)
    # two passes instead of a batch of 2 compute the same guidance
    cfg.sample.seed, cfg.sample.cfg_batched = 0, False
    torch.testing.assert_close(denoise(model, layout, cond, uncond, cfg.sample, torch.device("cpu")), first,
                               rtol=1e-4, atol=1e-4)


def test_batch2_out_of_memory_falls_back_to_two_passes(checkpoint, tmp_path, caplog):
    cfg = load_config(checkpoint / "config.toml", ["sample.steps=2", "sample.cfg=3", 'sample.cfg_schedule="constant"'])
    model = load_model(cfg, checkpoint, torch.device("cpu")).model
    layout = VideoLayout.from_config(cfg.layout, cfg.ttt, load_stories_from([RED]).duration_s)
    cond, uncond = torch.randn(1, 16, 64), torch.zeros(1, 16, 64)
    cfg.sample.cfg_batched = False
    two_pass = denoise(model, layout, cond, uncond, cfg.sample, torch.device("cpu"))

    wrapped = NoBatchTwo(model)
    cfg.sample.cfg_batched = True
    with caplog.at_level(logging.WARNING, logger="tttvideo"):
        got = denoise(wrapped, layout, cond, uncond, cfg.sample, torch.device("cpu"))
    assert torch.equal(got, two_pass)
    assert wrapped.calls == [2, 1, 1, 1, 1]  # tried batch 2 once, then two passes for every step
    assert "two passes of batch 1" in caplog.text


def test_block_offload_bookkeeping(checkpoint, caplog):
    cfg = load_config(checkpoint / "config.toml", [])
    model = load_model(cfg, checkpoint, torch.device("cpu")).model
    layout = VideoLayout.from_config(cfg.layout, cfg.ttt, load_stories_from([RED]).duration_s)
    gen = torch.Generator().manual_seed(0)
    x, text = torch.randn(1, 13, 16, 4, 6, generator=gen), torch.randn(1, 1, 16, 64, generator=gen)
    with torch.no_grad():
        expected = model(x, text, 500, layout)
    # off CUDA a plain offloader does nothing but say so
    with caplog.at_level(logging.INFO, logger="tttvideo"):
        idle = BlockOffloader(model.blocks, "cpu")
    assert not idle.enabled and "needs a CUDA device" in caplog.text
    # the synchronous mode runs the same swap/prefetch bookkeeping without streams
    off = BlockOffloader(model.blocks, "cpu", prefetch=1, synchronous=True)
    host_ptrs = [p.data_ptr() for p in model.blocks.parameters()]
    with torch.no_grad():
        got = model(x, text, 500, layout)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # every block was copied in once, plus block 0 prefetched for the next step (wrap-around)
    assert off.loads == len(model.blocks) + 1
    assert [p.data_ptr() for p in model.blocks.parameters()] == host_ptrs  # back on host storage after each block
    off.close()


def load_stories_from(scenes):
    from tttvideo.sample.scenes import Scene, Story

    return Story("s", "mem", [Scene(**s) for s in scenes])


def tiny_t5(folder, d_model=64):
    """A word-level tokenizer + a one-layer random T5 encoder, saved as a pipeline folder (tokenizer/,
    text_encoder/)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    words = sorted(set((RED["text"] + " " + BLUE["text"] + " blurry start_scene end_scene < >").split()))
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    tok.save_pretrained(folder / "tokenizer")
    torch.manual_seed(0)
    T5EncoderModel(T5Config(vocab_size=len(vocab), d_model=d_model, d_kv=16, d_ff=64, num_layers=1, num_heads=2)
                   ).save_pretrained(folder / "text_encoder")
    return folder


def test_t5_and_vae_folders(tmp_path, checkpoint):
    """The real-format path: T5 from a local folder, CogVideoX VAE (16 latent channels) from a local folder."""
    from diffusers import AutoencoderKLCogVideoX

    t5 = tiny_t5(tmp_path / "t5")
    torch.manual_seed(0)
    AutoencoderKLCogVideoX(block_out_channels=(4, 4, 4, 4), latent_channels=16, layers_per_block=1,
                           norm_num_groups=2).save_pretrained(tmp_path / "vae")
    out = tmp_path / "vae.mp4"
    rc = run_cli("--checkpoint", checkpoint / "model.safetensors", "--scenes", story_file(tmp_path, [RED]),
                 "--out", out, "--steps", 1, "--text-encoder", t5, "--vae", tmp_path / "vae")
    assert rc == 0
    assert read_frames(out).shape == (49, 32, 48, 3)


def test_t5_too_many_tokens_and_wrong_width(tmp_path, checkpoint, capsys):
    t5 = tiny_t5(tmp_path / "t5")
    wide = tiny_t5(tmp_path / "t5wide", d_model=32)
    capsys.readouterr()
    long = {"text": " ".join([RED["text"]] * 3)}  # 27 words + </s> > 16 tokens
    rc = run_cli("--checkpoint", checkpoint, "--scenes", story_file(tmp_path, [long]), "--out", tmp_path / "o.mp4",
                 "--text-encoder", t5)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "scene 0 of story 'story' has 28 tokens in its text" in err[0] and "takes 16 per scene" in err[0]
    rc = run_cli("--checkpoint", checkpoint, "--scenes", story_file(tmp_path, [RED]), "--out", tmp_path / "o.mp4",
                 "--text-encoder", wide)
    assert rc == 2 and "gives 32-d features but the model takes 64-d" in capsys.readouterr().err


@pytest.mark.parametrize(
    "scenes, extra, words",
    [
        ([{"text": ""}], [], "has empty text"),
        ("not json", [], "is not valid JSON"),
        ([RED, BLUE], ["--duration", "63s"], "asks for 63 s"),
        ([{"text": "word " * 30}], [], "has 30 tokens in its text"),
        (None, [], "does not exist"),
        ([RED], ["--checkpoint", "/"], "is neither a model file"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, checkpoint, capsys, scenes, extra, words):
    if scenes is None:
        path = tmp_path / "missing.json"
    elif isinstance(scenes, str):
        path = tmp_path / "bad.json"
        path.write_text(scenes)
    else:
        path = story_file(tmp_path, scenes)
    rc = run_cli("--checkpoint", checkpoint, "--scenes", path, "--out", tmp_path / "o.mp4", *extra)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("tttv sample: error:") and words in err[0]
    assert not (tmp_path / "o.mp4").exists()


def test_story_longer_than_training_warns_in_the_command_format(tmp_path, checkpoint, capsys):
    """The fixture's checkpoint was trained on 3-s videos (its config.toml); a 6-s story still samples, with one
    warning line on stderr in the command's own format (`tttv sample: warning: ...`, no log-handler columns)."""
    out = tmp_path / "long.mp4"
    assert run_cli("--checkpoint", checkpoint, "--scenes", story_file(tmp_path, [RED, BLUE]), "--out", out,
                   "--steps", 1) == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if "trained on videos of at most 3 s" in line]
    assert len(lines) == 1 and lines[0].startswith("tttv sample: warning: story 'story' is 6 s long")
    assert "WARNING" not in captured.out + captured.err and out.is_file()


def test_trained_duration_comes_from_the_model_file_first(tmp_path, checkpoint, caplog):
    """A model file that carries its trained duration needs no config beside it; within that length, no word."""
    from tttvideo.models import build_model
    from tttvideo.models.weights import trained_duration
    from tttvideo.sample.model import warn_beyond_training

    cfg = load_config(checkpoint / "config.toml", [])
    alone = save_checkpoint(build_model(cfg), tmp_path / "alone" / "model.safetensors", trained_duration_s=6)
    assert trained_duration(alone) == 6 and trained_duration(checkpoint / "model.safetensors") == 3
    stories = [load_stories_from([RED, BLUE]), load_stories_from([RED, BLUE, RED])]
    with caplog.at_level(logging.WARNING, logger="tttvideo"):
        layouts = [VideoLayout.from_config(cfg.layout, cfg.ttt, s.duration_s) for s in stories]
        warn_beyond_training(alone, stories, layouts)
    assert len(caplog.records) == 1 and "is 9 s long" in caplog.text and "at most 6 s" in caplog.text


def test_sampling_dtype_is_bf16_on_a_gpu_for_fp32_master_weights_and_the_config_elsewhere():
    """A run's config trains with model.dtype = "fp32" and the sampler runs no autocast: on a GPU `sample.dtype =
    "auto"` builds the model in bf16 (a 63-s Wan guided step took 292 s in fp32, 41 s in bf16, on an H200); a CPU
    keeps the config's dtype, and an explicit sample.dtype wins everywhere."""
    from tttvideo.dtypes import sampling_dtype

    assert sampling_dtype("fp32", "auto", cuda=True) == "bf16"
    assert sampling_dtype("fp32", "auto", cuda=False) == "fp32"
    assert sampling_dtype("fp16", "auto", cuda=True) == "fp16"
    assert sampling_dtype("fp32", "fp32", cuda=True) == "fp32"
    assert sampling_dtype("bf16", "fp32", cuda=False) == "fp32"


def test_load_model_builds_the_sampling_dtype(checkpoint):
    """load_model builds the model in sample.dtype, the fp32 checkpoint's weights cast as they load (on the CPU
    here: the explicit setting; "auto" keeps the config's fp32 there)."""
    cfg = load_config(checkpoint / "config.toml")
    assert cfg.model.dtype == "fp32" and cfg.sample.dtype == "auto"
    with load_model(cfg, checkpoint, torch.device("cpu")) as loaded:
        assert next(loaded.model.parameters()).dtype == torch.float32
    cfg.sample.dtype = "bf16"
    with load_model(cfg, checkpoint, torch.device("cpu")) as loaded:
        assert next(loaded.model.parameters()).dtype == torch.bfloat16
