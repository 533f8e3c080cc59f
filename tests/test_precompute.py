"""`tttv precompute` end to end with a small random CogVideoX VAE and T5 saved in their real formats, on mp4 files
written here: good clips become a cache that LatentCache accepts, every kind of bad clip is reported and skipped,
a second run reuses what is on disk, and the stored tensors equal the encoders' outputs."""

from __future__ import annotations

import json
import string

import numpy as np
import pytest
import torch

from tttvideo.cli import main
from tttvideo.data.cache import LatentCache
from tttvideo.data.video import read_frames
from tttvideo.layout import VideoLayout

H, W, FPS = 32, 48, 16
LAYOUT = VideoLayout.create(6, H, W, text_tokens=12, mini_batch_size=16)  # 2 segments, 97 frames
WORDS = "a the red blue fox runs jumps city at night scene".split()


def write_mp4(path, frames, fps=FPS):
    import imageio_ffmpeg

    h, w = frames.shape[1:3]
    writer = imageio_ffmpeg.write_frames(str(path), (w, h), fps=fps, macro_block_size=1, quality=9)
    writer.send(None)
    for f in frames:
        writer.send(np.ascontiguousarray(f).tobytes())
    writer.close()


def clip(n, h=H, w=W, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, (1, h, w, 3))
    drift = np.arange(n)[:, None, None, None] * 2
    return ((base + drift) % 256).astype(np.uint8)


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    from diffusers import AutoencoderKLCogVideoX
    from transformers import T5Config, T5EncoderModel, T5Tokenizer

    root = tmp_path_factory.mktemp("pipeline")
    torch.manual_seed(0)
    vae = AutoencoderKLCogVideoX(block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1,
                                 norm_num_groups=4, scaling_factor=0.7)
    vae.save_pretrained(root / "vae")
    # a tiny Unigram vocabulary (what T5's sentencepiece model is) built offline
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [(c, -5.0) for c in string.ascii_lowercase + "<>_"] + [("\u2581" + w, -1.0) for w in WORDS]
    tok = T5Tokenizer(vocab=vocab, extra_ids=0)
    tok.save_pretrained(root / "tokenizer")
    t5 = T5EncoderModel(T5Config(vocab_size=len(vocab), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4))
    t5.save_pretrained(root / "text_encoder")
    return root


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("clips")
    videos = root / "videos"
    videos.mkdir()
    n = LAYOUT.num_frames
    for i in range(3):
        write_mp4(videos / f"good{i}.mp4", clip(n, seed=i))
    write_mp4(videos / "count.mp4", clip(n, seed=5))
    write_mp4(videos / "orphan.mp4", clip(n, seed=6))
    write_mp4(videos / "slow.mp4", clip(n, seed=7), fps=8)
    write_mp4(videos / "tall.mp4", clip(n, h=W, w=H, seed=8))
    write_mp4(videos / "short.mp4", clip(49, seed=9))
    (videos / "broken.mp4").write_bytes(b"\x00\x01 not a video" * 100)
    lines = [
        {"video": "good0.mp4", "captions": ["a red fox runs", "a city at night"], "scene_transition": [False, True]},
        {"video": "good1.mp4", "captions": ["the blue fox jumps", "the blue fox runs"]},
        {"video": "good2.mp4", "captions": ["a fox", "a fox"], "scene_start": [True, False],
         "scene_end": [False, True]},
        {"video": "count.mp4", "captions": ["a fox runs"]},
        {"video": "slow.mp4", "captions": ["a", "b"]},
        {"video": "tall.mp4", "captions": ["a", "b"]},
        {"video": "short.mp4", "captions": ["a", "b"]},
        {"video": "broken.mp4", "captions": ["a", "b"]},
        {"video": "missing.mp4", "captions": ["a", "b"]},
        {"video": "good9.mp4", "captions": ["a", "b"], "scene_transition": [True]},
    ]
    (root / "captions.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root


def run_cli(dataset, encoders, out, *extra):
    argv = ["precompute", "--videos", str(dataset / "videos"), "--captions", str(dataset / "captions.jsonl"),
            "--out", str(out), "--vae", str(encoders), "--t5", str(encoders),
            "--set", "layout.duration=6s", "--set", f"layout.height={H}", "--set", f"layout.width={W}",
            "--set", "layout.text_tokens=12", "--set", "ttt.mini_batch_size=16", "--set", "data.cache_dtype=fp32",
            "--set", "data.precompute_batch_size=2", "--set", "data.text_batch_size=3", "--set", "data.device=cpu",
            *extra]
    return main(argv)


def test_precompute_end_to_end(dataset, encoders, tmp_path, monkeypatch):
    import tttvideo.data.precompute as pre

    freed = []
    original_free = pre.free
    monkeypatch.setattr(pre, "free", lambda m: (freed.append(type(m).__name__), original_free(m)))
    out = tmp_path / "cache"
    assert run_cli(dataset, encoders, out) == 0
    assert freed == ["AutoencoderKLCogVideoX", "T5EncoderModel"]  # each encoder released after its phase

    report = json.loads((out / "report.json").read_text())
    problems = {p["video"]: p["problem"] for p in report["problems"]}
    assert report["samples"] == 3 and report["latents_encoded"] == 3 and report["texts_encoded"] == 6
    assert set(problems) == {"count.mp4", "orphan.mp4", "slow.mp4", "tall.mp4", "short.mp4", "broken.mp4",
                             "missing.mp4", "good9.mp4"}
    assert "1 caption(s) for the 2 3-s segment(s)" in problems["count.mp4"]
    assert problems["orphan.mp4"] == "no line in the captions file"
    assert "8 fps, not 16" in problems["slow.mp4"]
    assert "48x32 (HxW), not 32x48" in problems["tall.mp4"]
    assert "49 frames, not 97" in problems["short.mp4"]
    assert "cannot read" in problems["broken.mp4"]
    assert "not found" in problems["missing.mp4"]
    assert "scene_transition has 1 flag(s) for 2 caption(s)" in problems["good9.mp4"]

    cache = LatentCache(out / "manifest.jsonl", LAYOUT, latent_channels=4, text_dim=32)
    assert [e.id for e in cache.entries] == ["good0", "good1", "good2"]
    e0, e2 = cache.entries[0], cache.entries[2]
    assert e0.scene_start == [False, True] and e0.scene_end == [True, False]
    assert e2.scene_start == [True, False] and e2.scene_end == [False, True]

    # the stored posterior is the VAE's on the decoded frames; the prompts carry the scene tokens
    from diffusers import AutoencoderKLCogVideoX
    from safetensors import safe_open
    from transformers import AutoTokenizer, T5EncoderModel

    vae = AutoencoderKLCogVideoX.from_pretrained(encoders / "vae")
    frames = read_frames(dataset / "videos/good1.mp4")
    x = torch.from_numpy(frames).permute(3, 0, 1, 2)[None].float() / 127.5 - 1
    with torch.no_grad():
        dist = vae.encode(x).latent_dist
    with safe_open(str(out / "latents/good1.safetensors"), "pt") as f:
        torch.testing.assert_close(f.get_tensor("mean"), dist.mean[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(f.get_tensor("logvar"), dist.logvar[0], rtol=1e-4, atol=1e-5)
        assert float(f.metadata()["scaling_factor"]) == 0.7
    tok = AutoTokenizer.from_pretrained(encoders / "tokenizer")
    t5 = T5EncoderModel.from_pretrained(encoders / "text_encoder")
    prompt = "<start_scene>a city at night"
    ids = tok([prompt], padding="max_length", max_length=12, truncation=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = t5(ids)[0][0]
    with safe_open(str(out / "text/good0-001.safetensors"), "pt") as f:
        assert f.metadata()["caption"] == prompt
        torch.testing.assert_close(f.get_tensor("embedding"), want, rtol=1e-5, atol=1e-6)
    with safe_open(str(out / "text/good0-000.safetensors"), "pt") as f:
        assert f.metadata()["caption"] == "a red fox runs<end_scene>"
    # the prompt with the scene token is longer than 12 tokens: truncated and said so
    assert any("truncated to 12" in w["warning"] for w in report["warnings"])

    # second run: everything reused; a changed caption and a deleted latent are redone, nothing else
    freed.clear()
    assert run_cli(dataset, encoders, out) == 0
    again = json.loads((out / "report.json").read_text())
    assert again["latents_encoded"] == 0 and again["texts_encoded"] == 0 and again["latents_reused"] == 3
    assert freed == []  # nothing to encode: neither encoder was even loaded
    (out / "latents/good2.safetensors").unlink()
    text = (dataset / "captions.jsonl").read_text()
    edited = tmp_path / "captions.jsonl"
    edited.write_text(text.replace("the blue fox runs", "the red fox runs"))
    assert run_cli(dataset, encoders, out, "--captions", str(edited)) == 0
    third = json.loads((out / "report.json").read_text())
    assert third["latents_encoded"] == 1 and third["texts_encoded"] == 1 and third["texts_reused"] == 5


def test_precompute_needs_its_inputs(capsys):
    assert main(["precompute", "--videos", "x"]) == 2
    assert "precompute needs --captions" in capsys.readouterr().err
