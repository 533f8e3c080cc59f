"""The latent cache: manifest, shape checks against the layout, posterior sampling, deterministic resumable order."""

from __future__ import annotations

import json

import pytest
import torch

from tttvideo.data.cache import (CacheEntry, LatentCache, position_seed, read_manifest, save_latent, save_text,
                                 write_manifest)
from tttvideo.data.loader import MicroBatchSampler, PositionDataset, make_loader
from tttvideo.errors import UserError
from tttvideo.layout import VideoLayout

LAYOUT = VideoLayout.create(6, 32, 48, text_tokens=4, mini_batch_size=16)  # 2 segments, 25 latent frames of 4x6
C, D = 3, 8


def make_cache(root, n=5, scaling=0.7, latent_shape=None, text_shape=None, segments=None):
    entries = []
    g = torch.Generator().manual_seed(0)
    shape = latent_shape or (C, LAYOUT.latent_frames, LAYOUT.latent_height, LAYOUT.latent_width)
    for i in range(n):
        mean = torch.randn(shape, generator=g)
        logvar = torch.full(shape, -2.0)
        save_latent(root / f"latents/s{i}.safetensors", mean, logvar, scaling)
        texts = []
        for s in range(segments or LAYOUT.num_segments):
            rel = f"text/s{i}-{s}.safetensors"
            emb = torch.full(text_shape or (LAYOUT.text_tokens, D), float(10 * i + s))
            save_text(root / rel, emb, f"cap {i} {s}", 3)
            texts.append(rel)
        entries.append(CacheEntry(id=f"s{i}", latent=f"latents/s{i}.safetensors", text=texts,
                                  captions=[f"cap {i} {s}" for s in range(len(texts))],
                                  scene_start=[False] * len(texts), scene_end=[False] * len(texts)))
    write_manifest(root / "manifest.jsonl", entries)
    return root / "manifest.jsonl"


def test_roundtrip_and_posterior_sample(tmp_path):
    manifest = make_cache(tmp_path)
    assert [e.id for e in read_manifest(manifest)] == [f"s{i}" for i in range(5)]
    cache = LatentCache(manifest, LAYOUT, C, D)
    item = cache.sample(2, seed=123)
    assert item["latents"].shape == (LAYOUT.latent_frames, C, LAYOUT.latent_height, LAYOUT.latent_width)
    assert item["text"].shape == (2, 4, D)
    assert torch.equal(item["text"][:, 0, 0], torch.tensor([20.0, 21.0]))
    # latent = (mean + exp(logvar/2) eps) * scaling, eps from the given seed: same seed same draw, other seed differs
    from safetensors.torch import load_file

    raw = load_file(str(tmp_path / "latents/s2.safetensors"))
    eps = torch.randn(raw["mean"].shape, generator=torch.Generator().manual_seed(123))
    want = ((raw["mean"] + torch.exp(torch.tensor(-1.0)) * eps) * 0.7).permute(1, 0, 2, 3)
    torch.testing.assert_close(item["latents"], want, rtol=1e-6, atol=1e-6)
    assert torch.equal(cache.sample(2, seed=123)["latents"], item["latents"])
    assert not torch.equal(cache.sample(2, seed=124)["latents"], item["latents"])


def test_shape_mismatches_name_the_file(tmp_path):
    manifest = make_cache(tmp_path / "a", latent_shape=(C, 13, 4, 6))
    with pytest.raises(UserError, match=r"latents/s0.safetensors holds mean of shape \[3, 13, 4, 6\].*\[3, 25, 4, 6\]"):
        LatentCache(manifest, LAYOUT, C, D)
    manifest = make_cache(tmp_path / "b", text_shape=(5, D))
    with pytest.raises(UserError, match=r"text/s0-0.safetensors has shape \[5, 8\].*\[4, 8\]"):
        LatentCache(manifest, LAYOUT, C, D)
    manifest = make_cache(tmp_path / "c", segments=3)
    with pytest.raises(UserError, match="has 3 text embedding file.*2 segment"):
        LatentCache(manifest, LAYOUT, C, D)
    manifest = make_cache(tmp_path / "d")
    with pytest.raises(UserError, match="model expects|needs \\[channels"):
        LatentCache(manifest, LAYOUT, 16, D)
    (tmp_path / "d/text/s3-1.safetensors").unlink()
    with pytest.raises(UserError, match="s3-1.safetensors does not exist"):
        LatentCache(manifest, LAYOUT, C, D)
    (tmp_path / "d/latents/s1.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="s1.safetensors is not a readable safetensors"):
        LatentCache(manifest, LAYOUT, C, D)


def test_manifest_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        read_manifest(tmp_path / "nope.jsonl")
    bad = tmp_path / "m.jsonl"
    bad.write_text('{"id": "a", "latent": "x", "text": []}\n{oops\n')
    with pytest.raises(UserError, match="line 2 is not valid JSON"):
        read_manifest(bad)
    bad.write_text(json.dumps({"id": "a", "latent": "x", "text": [], "colour": 1}) + "\n")
    with pytest.raises(UserError, match="unknown key 'colour'"):
        read_manifest(bad)
    bad.write_text(json.dumps({"id": "a", "text": []}) + "\n")
    with pytest.raises(UserError, match="lacks latent"):
        read_manifest(bad)


def test_order_is_a_function_of_position(tmp_path):
    cache = LatentCache(make_cache(tmp_path, n=5), LAYOUT, C, D)
    ds = PositionDataset(cache, seed=7)
    epoch0 = [ds.index(p) for p in range(5)]
    epoch1 = [ds.index(p) for p in range(5, 10)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(5))  # every sample once per epoch
    assert epoch0 != epoch1 or epoch0 != sorted(epoch0)  # shuffled
    assert [PositionDataset(cache, seed=7).index(p) for p in range(10)] == epoch0 + epoch1
    assert [PositionDataset(cache, seed=8).index(p) for p in range(10)] != epoch0 + epoch1
    assert position_seed(7, 3) != position_seed(7, 4) != position_seed(8, 3)

    # a loader started at optimizer step 3 yields exactly the batches the loader from step 0 yields from step 3 on
    full = make_loader(cache, 7, 0, batch_size=2, grad_accum=2)
    it = iter(full)
    batches = [next(it) for _ in range(10)]
    resumed = iter(make_loader(cache, 7, 3, batch_size=2, grad_accum=2))
    for want in batches[6:]:
        got = next(resumed)
        assert torch.equal(got["position"], want["position"])
        assert torch.equal(got["latents"], want["latents"])
        assert torch.equal(got["text"], want["text"])
    assert batches[0]["position"].tolist() == [0, 1] and batches[1]["position"].tolist() == [2, 3]


def test_positions_split_over_ranks():
    a = MicroBatchSampler(0, batch_size=2, grad_accum=2, rank=0, world_size=2)
    b = MicroBatchSampler(0, batch_size=2, grad_accum=2, rank=1, world_size=2)
    seen = [p for s in (a, b) for m in range(2) for p in s.positions(1, m)]
    assert sorted(seen) == list(range(8, 16))  # step 1 of a global batch of 8, no overlap between ranks


def test_workers_do_not_change_the_batches(tmp_path):
    cache = LatentCache(make_cache(tmp_path, n=4), LAYOUT, C, D)
    a = iter(make_loader(cache, 1, 0, 2, 1, num_workers=0))
    b = iter(make_loader(cache, 1, 0, 2, 1, num_workers=1))
    for _ in range(3):
        x, y = next(a), next(b)
        assert torch.equal(x["latents"], y["latents"]) and torch.equal(x["index"], y["index"])
