"""A guided step's two passes on two CUDA streams (`sample.cfg_concurrent`, `sample.concurrent.PassPair`) give
the two sequential passes' prediction bit for bit: the same kernels at the same shapes, only their order on the
card differs. Also: the TTT kernels' side streams (`ttt.ops._concurrent`) are per calling stream, so two passes do
not queue their head groups behind each other's. Skipped without CUDA.

Run: `pytest tests/gpu/test_concurrent_passes_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA streams")


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_concurrent_passes_equal_sequential(backend):
    from tttvideo.config.loader import load_config
    from tttvideo.layout import VideoLayout
    from tttvideo.models import build_model
    from tttvideo.sample.guidance import GuidedPrediction

    cfg = load_config(None, ['model.preset="tiny"', 'model.dtype="bf16"', "layout.height=64", "layout.width=96",
                             "layout.text_tokens=16", "ttt.scan_checkpoint_group_size=0",
                             f'ttt.backend="{backend}"'])
    torch.manual_seed(0)
    model = build_model(cfg, device=torch.device("cuda")).eval().requires_grad_(False)
    with torch.no_grad():
        for m in model.ttt_modules():  # gates open, so the TTT layers move the prediction
            for g in m.gates():
                g.fill_(0.5)
    layout = VideoLayout.from_config(cfg.layout, cfg.ttt, "6s", phase="sample")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, layout.latent_frames, model.spec.in_channels, layout.latent_height, layout.latent_width,
                    generator=gen).cuda().bfloat16()
    text = torch.randn(1, layout.num_segments, layout.text_tokens, model.spec.text_embed_dim,
                       generator=gen).cuda().bfloat16()
    uncond = torch.randn_like(text)
    with torch.no_grad():
        serial = GuidedPrediction(model, layout, text, uncond, batched=False)(x, 500, 4.0)
        both = GuidedPrediction(model, layout, text, uncond, batched=False, concurrent=True)
        assert both.pair is not None
        first = both(x, 500, 4.0)  # the pair's warm-up call: sequential
        assert torch.equal(first, serial)
        for _ in range(3):
            assert torch.equal(both(x, 500, 4.0), serial)
        both.pair.close()


def test_side_streams_per_calling_stream():
    from tttvideo.ttt import ops

    dev = torch.device("cuda")
    seen = {}
    for name, stream in (("a", torch.cuda.Stream()), ("b", torch.cuda.Stream())):
        with torch.cuda.stream(stream):
            ops._concurrent(lambda p: torch.full((4,), float(p), device=dev), [1, 2], dev)
            seen[name] = ops._side_streams[dev, stream.cuda_stream]
    assert not {s.cuda_stream for s in seen["a"]} & {s.cuda_stream for s in seen["b"]}
