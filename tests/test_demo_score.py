"""The demo scorer is live: the demo set's own latents score 1.0 on every caption combination (also through the
identity decode and an mp4; the scenes set's bars and pillars and the long-range set's circles and squares), noise
scores at chance, captions that name something else score 0."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from tttvideo.config.loader import load_config
from tttvideo.data.cache import LatentCache
from tttvideo.data.demo import (BACKGROUNDS, COLOURS, DIRECTIONS, LONG_RANGE_SHAPES, SHAPES, DemoVideo, Scene,
                                build_demo_cache, render_video)
from tttvideo.data.demo_score import (CHANCE, CHANCE_OVERALL, REGION_DISTANCE, _nearest, background_colour,
                                      latent_frames, parse_caption, score_frames, score_video_file, segment_bounds)
from tttvideo.layout import VideoLayout

# the layout `make demo` trains and samples at (8x8 latent frames): the score must be exact where it is used
_DEMO = load_config("configs/demo.toml")
LAYOUT = VideoLayout.from_config(_DEMO.layout, _DEMO.ttt)


def two_scene_frames(first: Scene, second: Scene) -> np.ndarray:
    video = DemoVideo([first, second], [False, True], [True, False])
    latent = torch.from_numpy(render_video(video, LAYOUT, 16)).permute(1, 0, 2, 3)  # [T, C, h, w]
    return latent_frames(latent)


def other(table, name):
    names = list(table)
    return names[(names.index(name) + 1) % len(names)]


def test_chance_levels():
    assert CHANCE == {"colour": 1 / 6, "background": 1 / 4, "direction": 1 / 4, "shape": 1 / 2}
    assert CHANCE_OVERALL == pytest.approx(0.2917, abs=1e-4)


def test_captions_and_segments():
    p = parse_caption("<start_scene>a red pillar moves left on a navy background<end_scene>")
    assert (p.colour, p.shape, p.direction, p.background) == ("red", "pillar", "left", "navy")
    assert parse_caption("a red circle moves left on a navy background").shape == "circle"  # the long-range set's
    with pytest.raises(ValueError):
        parse_caption("a purple bar moves left on a navy background")
    with pytest.raises(ValueError):
        parse_caption("a red triangle moves left on a navy background")
    assert segment_bounds(25, 2) == [(0, 13), (13, 25)]  # latent frames of 6 s
    assert segment_bounds(97, 2) == [(0, 49), (49, 97)]  # decoded frames of 6 s
    assert segment_bounds(37, 3) == [(0, 13), (13, 25), (25, 37)]


def combinations(shapes, every_colour=True):
    names = list(COLOURS)
    for i, (shape, bg, direction) in enumerate(itertools.product(shapes, BACKGROUNDS, DIRECTIONS)):
        for colour in names if every_colour else names[i % len(names) : i % len(names) + 1]:
            yield shape, colour, bg, direction


@pytest.mark.parametrize("shapes", [SHAPES, LONG_RANGE_SHAPES])
def test_ground_truth_scores_perfect_on_every_combination(shapes):
    """Every (shape, colour, background, direction) of the demo set, as the first and (other shape) second scene;
    the long-range set's circles and squares in every (shape, background, direction), the colours taking turns."""
    for shape, colour, bg, direction in combinations(shapes, every_colour=shapes == SHAPES):
        first = Scene(shape, colour, bg, direction, 0.5)
        second = Scene(other(shapes, shape), other(COLOURS, colour), other(BACKGROUNDS, bg),
                       other(DIRECTIONS, direction), 0.5)
        score = score_frames(two_scene_frames(first, second), [first.caption, second.caption])
        assert score.overall == 1.0, score.summary()
        assert [s.frames for s in score.scenes] == [(0, 13), (13, 25)]


def test_ground_truth_cache_and_mp4_score_perfect(tmp_path):
    """The real cache's latents, and the same latents through the identity decode into an H.264 mp4."""
    from tttvideo.sample.decode import IdentityDecoder
    from tttvideo.sample.pipeline import write_video

    manifest = build_demo_cache(tmp_path / "data", LAYOUT, channels=16, text_dim=64, videos=4, seed=0,
                                text_encoder="table")
    cache = LatentCache(manifest, LAYOUT, 16, 64)
    for i, entry in enumerate(cache.entries):
        lat = cache.sample(i, seed=0)["latents"]
        assert score_frames(latent_frames(lat), entry.captions).overall == 1.0
    entry = cache.entries[0]
    video = tmp_path / "gt.mp4"
    frames = write_video(IdentityDecoder(), cache.sample(0, seed=0)["latents"][None], video, 16)
    assert frames == 97
    (tmp_path / "gt.scenes.json").write_text(json.dumps({"scenes": [{"text": c} for c in entry.captions]}))
    score = score_video_file(video)  # captions from the story beside the video, pooled by 8
    assert score.overall == 1.0, score.summary()
    assert [s.frames for s in score.scenes] == [(0, 49), (49, 97)]


def test_a_continued_scene_is_one_scene():
    scene = Scene("pillar", "yellow", "navy", "up", 0.5)
    cut = Scene("bar", "green", "grey", "right", 0.5)
    layout = VideoLayout.create(9, 64, 96, text_tokens=24, mini_batch_size=16)
    video = DemoVideo([scene, scene, cut], [False, False, True], [False, True, False])
    latent = torch.from_numpy(render_video(video, layout, 16)).permute(1, 0, 2, 3)
    score = score_frames(latent_frames(latent), [scene.caption, scene.caption, cut.caption])
    assert [s.frames for s in score.scenes] == [(0, 25), (25, 37)] and score.overall == 1.0


def test_wrong_captions_score_zero():
    rng = np.random.default_rng(0)
    for _ in range(20):
        first = Scene(str(rng.choice(SHAPES)), str(rng.choice(list(COLOURS))), str(rng.choice(list(BACKGROUNDS))),
                      str(rng.choice(list(DIRECTIONS))), 0.5)
        second = Scene(other(SHAPES, first.shape), other(COLOURS, first.colour), other(BACKGROUNDS, first.background),
                       other(DIRECTIONS, first.direction), 0.5)
        frames = two_scene_frames(first, second)
        wrong = [Scene(other(SHAPES, s.shape), other(COLOURS, s.colour), other(BACKGROUNDS, s.background),
                       other(DIRECTIONS, s.direction), 0.5).caption for s in (first, second)]
        score = score_frames(frames, wrong)
        assert score.overall == 0.0, score.summary()


@pytest.mark.parametrize("kind", ["gaussian", "uniform"])
def test_noise_scores_at_chance(kind):
    """Noise (the sampler's starting point, or uniform colour noise) against random captions: no attribute beats its
    chance level by more than the spread of 240 scenes allows, and the overall score stays near 0.29."""
    rng = np.random.default_rng(1)
    scores = []
    for _ in range(120):
        captions = [Scene(str(rng.choice(SHAPES)), str(rng.choice(list(COLOURS))), str(rng.choice(list(BACKGROUNDS))),
                          str(rng.choice(list(DIRECTIONS))), 0.5).caption for _ in range(2)]
        if captions[0] == captions[1]:
            continue
        if kind == "gaussian":
            frames = np.clip(rng.standard_normal((25, 8, 12, 3)), -1, 1).astype(np.float32)
        else:
            frames = rng.integers(0, 256, (25, 8, 12, 3), dtype=np.uint8)
        scores.append(score_frames(frames, captions))
    scenes = [s for sc in scores for s in sc.scenes]
    for attribute, chance in CHANCE.items():
        acc = np.mean([getattr(s, f"{attribute}_ok") for s in scenes])
        # a binomial's 3 sigma over ~240 scenes is at most 0.1
        assert acc <= chance + 0.1, (attribute, acc)
    overall = np.mean([sc.overall for sc in scores])
    assert overall <= CHANCE_OVERALL + 0.06, overall


def test_a_flat_frame_shows_no_shape():
    frames = np.zeros((25, 8, 12, 3), dtype=np.uint8)  # black, nothing on it
    score = score_frames(frames, ["a red bar moves right on a black background"] * 2)
    (scene,) = score.scenes
    assert scene.background_ok and not (scene.colour_ok or scene.direction_ok or scene.shape_ok)
    assert score.overall == 0.25


def test_colour_of_a_shape_on_a_noisy_background():
    """A white pillar on grey where faint purple noise covers a third of the background, just past REGION_DISTANCE: the
    region's plain mean is a grey nearer magenta than white; weighted by distance from the background (the shape's
    core counts most) it is white, as a sampled demo scene with a noisy background showed."""
    rng = np.random.default_rng(0)
    frames = np.empty((12, 16, 16, 3), dtype=np.float32)
    frames[:] = (0.33, 0.31, 0.27)
    noise = rng.random((12, 16, 16)) < 0.3
    frames[noise] += (0.2, 0.1, 0.25)  # 0.34 from the background: inside the region
    for i in range(12):
        frames[i, 3:13, 12 - i // 2:14 - i // 2] = 0.95  # a pillar moving left
    region = np.linalg.norm(frames - background_colour(frames), axis=-1) > REGION_DISTANCE
    assert _nearest(frames[region].mean(0), COLOURS) == "magenta"  # what the unweighted mean would say
    (scene,) = score_frames(frames * 2 - 1, ["a white pillar moves left on a grey background"]).scenes
    assert scene.colour == "white" and scene.shape == "pillar" and scene.direction == "left", scene
