"""memory.stream_frozen_weights on CUDA (skipped without it): the tiny model with LoRA and fp8 frozen weights, the
codes in pinned host memory and copied per layer, gives the same loss and the same gradients (bitwise: the same
kernels on the same values) as with the codes resident, with block checkpointing (the recompute copies again), and
the GPU holds less.

Run: `pytest tests/gpu/test_fp8_stream_gpu.py`, or `python tests/gpu/test_fp8_stream_gpu.py`.
"""

from __future__ import annotations

import sys

import torch

try:
    import pytest
except ImportError:  # the device image may lack pytest: the module also runs as a script
    pytest = None


def compare() -> dict:
    from tttvideo.config.schema import Config
    from tttvideo.models import build_model
    from tttvideo.models.fp8_storage import stream_fp8_weights

    cfg = Config()
    cfg.model.adapter, cfg.model.lora_rank, cfg.model.frozen_weights, cfg.model.dtype = "lora", 4, "fp8", "bf16"
    cfg.ttt.mini_batch_size, cfg.ttt.backend = 16, "reference"
    cfg.checkpointing.block = True
    results = []
    for stream in (False, True):
        torch.manual_seed(0)
        model = build_model(cfg, device="cuda")
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.1)
        moved = stream_fp8_weights(model) if stream else 0
        g = torch.Generator(device="cuda").manual_seed(1)
        latents = torch.randn(1, 25, 16, 4, 6, device="cuda", generator=g)
        text = torch.randn(1, 2, 5, 64, device="cuda", generator=g)
        out = model(latents, text, torch.tensor([300.0], device="cuda"))
        loss = out.float().pow(2).mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.item(), grads, moved))
    (l0, g0, _), (l1, g1, moved) = results
    same = g0.keys() == g1.keys() and all(torch.equal(g0[n], g1[n]) for n in g0)
    return {"loss_equal": l0 == l1, "grads_equal": same, "moved_bytes": moved, "grads": len(g0)}


def test_streamed_fp8_weights_same_gradients():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    r = compare()
    assert r["moved_bytes"] > 0 and r["grads"] > 0
    assert r["loss_equal"] and r["grads_equal"]


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("no CUDA GPU")
        sys.exit(0)
    r = compare()
    print(f"streamed fp8 weights: {r}")
    sys.exit(0 if r["loss_equal"] and r["grads_equal"] and r["moved_bytes"] > 0 else 1)
