"""checkpointing.keep on CUDA (skipped without it): whole blocks checkpointed, keeping the SDPA outputs (and the
matrix products'), with the attention and block glue compiled and the TTT scan on its Triton kernels: the backward
never runs SDPA again, and the gradients equal those of plain block checkpointing (bf16 model, 128 tokens a frame,
tolerance 1e-2 relative to each gradient's largest value: the kernels are the same, only the attention backward's
atomics may sum in another order).

Run: `pytest tests/gpu/test_selective_checkpoint_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA kernels and torch.compile")


def test_kept_attention_is_not_recomputed_and_gradients_match():
    from tests.test_model import OpCounter
    from tttvideo.config.loader import load_config
    from tttvideo.layout import VideoLayout
    from tttvideo.models import apply_checkpointing, build_model

    cfg = load_config(None, ["model.preset=tiny", 'model.pretrained_path=""', "model.dtype=bf16",
                             "model.adapter=sft", "model.compile_attention_glue=true",
                             "model.compile_block_glue=true", "ttt.mini_batch_size=16", "checkpointing.block=true",
                             "layout.height=128", "layout.width=256", "layout.text_tokens=8"])
    torch.manual_seed(0)
    model = build_model(cfg, "cuda")
    model.set_ttt_gates(0.5)  # the TTT branch counts in the gradients
    layout = VideoLayout.from_config(cfg.layout, cfg.ttt, 6)
    gen = torch.Generator(device="cuda").manual_seed(1)
    latents = torch.randn(1, layout.latent_frames, 16, layout.latent_height, layout.latent_width, device="cuda",
                          dtype=torch.bfloat16, generator=gen)
    text = torch.randn(1, layout.num_segments, layout.text_tokens, 64, device="cuda", dtype=torch.bfloat16,
                       generator=gen)
    target = torch.randn(latents.shape, device="cuda", generator=gen)
    t = torch.tensor([500], device="cuda")

    def grads(keep):
        apply_checkpointing(model, cfg.checkpointing.__class__(block=True, keep=list(keep)))
        model.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(latents, text, t, layout).float(), target)
        with OpCounter() as counter:
            loss.backward()
        return {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}, counter

    grads(())  # compile outside the comparison
    full, counted = grads(())
    assert counted.of("attention") == len(model.blocks)
    for keep in (("attention",), ("attention", "matmul")):
        kept, counter = grads(keep)
        assert counter.of("attention") == 0, keep
        assert kept.keys() == full.keys()
        for name, g in full.items():
            assert (kept[name] - g).abs().max() <= 1e-2 * g.abs().max() + 1e-6, (keep, name)
