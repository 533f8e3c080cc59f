"""The one guided denoising step (tttvideo.sample.guidance.GuidedPrediction) and the sampler's model holder."""

from __future__ import annotations

import logging

import pytest
import torch

from tttvideo.config.loader import load_config
from tttvideo.layout import VideoLayout
from tttvideo.models import build_model
from tttvideo.sample.guidance import GuidedPrediction
from tttvideo.sample.model import LoadedModel
from tttvideo.sample.solvers import guide

TINY = ['model.preset="tiny"', "layout.height=32", "layout.width=48", "layout.text_tokens=16",
        "ttt.mini_batch_size=16", 'ttt.backend="reference"']


@pytest.fixture(scope="module")
def setup():
    cfg = load_config(None, TINY)
    torch.manual_seed(0)
    model = build_model(cfg).eval().requires_grad_(False)
    layout = VideoLayout.from_config(cfg.layout, cfg.ttt, "6s")
    gen = torch.Generator().manual_seed(1)
    spec = model.spec
    x = torch.randn(1, layout.latent_frames, spec.in_channels, layout.latent_height, layout.latent_width,
                    generator=gen)
    cond = torch.randn(1, layout.num_segments, layout.text_tokens, spec.text_embed_dim, generator=gen)
    return model, layout, x, cond, torch.zeros_like(cond)


@torch.no_grad()
def test_batched_equals_two_passes_and_the_formula(setup):
    """Batch 2 and two passes of batch 1 agree within fp32 rounding (1e-5), and both are v_u + s (v_c - v_u)."""
    model, layout, x, cond, uncond = setup
    batched = GuidedPrediction(model, layout, cond, uncond, batched=True)(x, 500, 3.0)
    two = GuidedPrediction(model, layout, cond, uncond, batched=False)(x, 500, 3.0)
    torch.testing.assert_close(batched, two, rtol=1e-5, atol=1e-5)
    expected = guide(model(x, uncond, 500, layout).float(), model(x, cond, 500, layout).float(), 3.0)
    torch.testing.assert_close(two, expected, rtol=0, atol=0)
    assert batched.dtype == torch.float32


@torch.no_grad()
def test_guidance_one_is_the_conditional_prediction_alone(setup):
    model, layout, x, cond, uncond = setup
    calls = []
    handle = model.register_forward_pre_hook(lambda m, args: calls.append(args[0].shape[0]))
    try:
        v = GuidedPrediction(model, layout, cond, uncond, batched=True)(x, 500, 1.0)
    finally:
        handle.remove()
    assert calls == [1]
    torch.testing.assert_close(v, model(x, cond, 500, layout).float(), rtol=0, atol=0)


class NoBatchTwo(torch.nn.Module):
    """The model as a card too small for batch 2 runs it."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.spec, self.calls = inner, inner.spec, []

    def forward(self, x, *args):
        self.calls.append(x.shape[0])
        if x.shape[0] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return self.inner(x, *args)


@torch.no_grad()
def test_out_of_memory_falls_back_once_and_stays(setup, caplog):
    model, layout, x, cond, uncond = setup
    wrapped = NoBatchTwo(model)
    predict = GuidedPrediction(wrapped, layout, cond, uncond, batched=True)
    with caplog.at_level(logging.WARNING, logger="tttvideo"):
        first = predict(x, 500, 3.0)
        second = predict(x, 400, 3.0)
    assert wrapped.calls == [2, 1, 1, 1, 1] and not predict.batched
    assert caplog.text.count("two passes of batch 1") == 1
    two = GuidedPrediction(model, layout, cond, uncond, batched=False)
    torch.testing.assert_close(first, two(x, 500, 3.0), rtol=0, atol=0)
    torch.testing.assert_close(second, two(x, 400, 3.0), rtol=0, atol=0)


@torch.no_grad()
def test_out_of_memory_propagates_when_asked(setup):
    """Benchmarks record an OOM instead of falling back."""
    model, layout, x, cond, uncond = setup
    predict = GuidedPrediction(NoBatchTwo(model), layout, cond, uncond, batched=True, fall_back_on_oom=False)
    with pytest.raises(torch.OutOfMemoryError):
        predict(x, 500, 3.0)


def test_loaded_model_closes_its_offloader():
    class Offloader:
        closed = 0

        def close(self):
            Offloader.closed += 1

    with LoadedModel(torch.nn.Linear(1, 1), Offloader()) as loaded:
        pass
    assert Offloader.closed == 1 and loaded.offloader is None
    loaded.close()  # idempotent
    assert Offloader.closed == 1
