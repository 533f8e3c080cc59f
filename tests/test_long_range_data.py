"""The long-range demo set (`data.demo_kind = "long-range"`) and its probe: a cut every segment, the colour named
only in the first caption and kept through the video; `score_persistence` reads the colour back from every later
scene (1.0 on the set's own latents at 3-18 s), and scores a video that forgets the colour at 0: the probe is live."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from tttvideo.data.cache import LatentCache
from tttvideo.data.demo import COLOURS, build_demo_cache, forgotten_colour, long_range_video, render_video
from tttvideo.data.demo_score import latent_frames, score_persistence
from tttvideo.layout import VideoLayout


def layout(seconds: int) -> VideoLayout:
    return VideoLayout.create(seconds, 64, 96, text_tokens=24, mini_batch_size=16)


@pytest.mark.parametrize("segments", [2, 3, 6])
def test_videos_cut_every_segment_and_name_the_colour_once(segments):
    rng = np.random.Generator(np.random.PCG64(7))
    for _ in range(20):
        v = long_range_video(rng, segments)
        assert len(v.scenes) == segments and len({s.colour for s in v.scenes}) == 1
        assert v.scenes[0].says_colour and not any(s.says_colour for s in v.scenes[1:])
        assert v.scenes[0].colour in v.scenes[0].caption
        assert not any(c in s.caption for s in v.scenes[1:] for c in COLOURS)
        assert v.scene_start == [False] + [True] * (segments - 1)  # every later segment opens a new scene
        assert all(a.caption != b.caption for a, b in zip(v.scenes, v.scenes[1:]))


@pytest.mark.parametrize("seconds", [9, 18])
def test_probe_recovers_the_kept_colour_and_fails_a_forgotten_one(seconds):
    rng = np.random.Generator(np.random.PCG64(seconds))
    lay = layout(seconds)
    for _ in range(4):
        video = long_range_video(rng, lay.num_segments)
        captions = [s.caption for s in video.scenes]
        kept = score_persistence(latent_frames(torch.from_numpy(render_video(video, lay, 16)).permute(1, 0, 2, 3)),
                                 captions)
        lost = score_persistence(latent_frames(torch.from_numpy(render_video(forgotten_colour(video), lay, 16)).permute(
            1, 0, 2, 3)), captions)
        assert kept.colour == video.scenes[0].colour and kept.chance == pytest.approx(1 / 6)
        assert kept.by_distance() == [True] * (lay.num_segments - 1)
        assert kept.first.colour_ok and lost.first.colour_ok  # the first scene is the same in both
        assert lost.by_distance() == [False] * (lay.num_segments - 1)
        assert kept.accuracy > lost.accuracy


def test_cache_of_the_long_range_kind(tmp_path):
    lay = layout(9)
    manifest = build_demo_cache(tmp_path / "lr", lay, 16, 32, videos=3, seed=1, text_encoder="table",
                                kind="long-range")
    scenes = build_demo_cache(tmp_path / "sc", lay, 16, 32, videos=3, seed=1, text_encoder="table")
    assert manifest.read_text() != scenes.read_text()  # the kind is part of what the set is
    cache = LatentCache(manifest, lay, 16, 32)
    for i, entry in enumerate(cache.entries):
        assert entry.scene_start == [False, True, True]
        frames = latent_frames(cache.sample(i, seed=0)["latents"])
        assert score_persistence(frames, entry.captions).accuracy == 1.0
    captions = list(cache.entries[-1].captions)
    assert "kept after each cut (+1: yes, +2: yes)" in score_persistence(frames, captions).summary()
    with pytest.raises(ValueError, match="names no colour"):
        score_persistence(frames, [captions[0], captions[0].replace("moves", "goes"), captions[2]])
