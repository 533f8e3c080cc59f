"""memory.chunked_inference on CUDA (skipped without it): two full-size CogVideoX-5B + TTT-MLP blocks (random init,
bf16, Triton TTT kernels, compiled glue) at 6 s, two segments, the chunked forward against the plain one, with one
and with three head groups. Tolerance 1e-2 relative (bf16; the difference is matmul summation order).

Run: `pytest tests/gpu/test_chunked_gpu.py`, or `python tests/gpu/test_chunked_gpu.py` (prints the errors).
"""

from __future__ import annotations

import dataclasses
import sys

import torch

try:
    import pytest
except ImportError:  # the device image may lack pytest: the module also runs as a script
    pytest = None


def errors() -> dict[str, float]:
    from tttvideo.config.schema import LayoutConfig, TTTConfig
    from tttvideo.layout import VideoLayout
    from tttvideo.models import get_preset, init_model
    from tttvideo.models.chunked_inference import ChunkPlan

    torch.manual_seed(0)
    spec = dataclasses.replace(get_preset("cogvideox-5b"), num_layers=2)
    ttt = TTTConfig(backend="triton")
    model = init_model(spec, ttt, True, dtype=torch.bfloat16, device="cuda").eval()
    model.set_ttt_gates(0.5)
    layout = VideoLayout.from_config(LayoutConfig(), ttt, "6s")
    g = torch.Generator(device="cuda").manual_seed(1)
    latents = torch.randn(1, layout.latent_frames, 16, layout.latent_height, layout.latent_width, device="cuda",
                          generator=g)
    text = torch.randn(1, layout.num_segments, layout.text_tokens, 4096, device="cuda", generator=g)
    out = {}
    with torch.no_grad():
        plain = model(latents, text, 500, layout).float()
        for groups in (1, 3):
            for block in model.blocks:
                block.inference_chunks = ChunkPlan(tokens=4096, ttt_head_groups=groups)
            chunked = model(latents, text, 500, layout).float()
            out[f"{groups} head group(s)"] = ((chunked - plain).norm() / plain.norm()).item()
    return out


def _skip_without_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def test_chunked_equals_plain_on_cuda():
    _skip_without_cuda()
    for name, err in errors().items():
        assert err < 1e-2, f"{name}: relative error {err:.2e}"


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("no CUDA GPU")
        sys.exit(0)
    result = errors()
    for name, err in result.items():
        print(f"chunked vs plain, {name}: relative error {err:.2e}")
    sys.exit(0 if all(e < 1e-2 for e in result.values()) else 1)
