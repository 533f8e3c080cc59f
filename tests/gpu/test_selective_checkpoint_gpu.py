"""checkpointing.keep on CUDA (skipped without it): whole blocks checkpointed, keeping the SDPA outputs (and the
matrix products'), with the attention and block glue compiled and the TTT scan on its Triton kernels: the backward
launches no attention forward kernel (profiled; plain block checkpointing launches one a layer), and the gradients
equal those of plain block checkpointing (bf16 model, 128 tokens a frame,
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
    from tttvideo.config.loader import load_config
    from tttvideo.memory.profile.trace import kernel_kind
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
        """The gradients, and how many attention forward kernels the backward launched (the recomputes). A
        dispatch mode would count operators, but under one torch.compile runs the recompute eagerly, which then
        saves other tensors than the compiled forward: the profiler's kernel names do not interfere."""
        apply_checkpointing(model, cfg.checkpointing.__class__(block=True, keep=list(keep)))
        model.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(latents, text, t, layout).float(), target)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            loss.backward()
            torch.cuda.synchronize()
        forward_kernels = sum(e.count for e in prof.key_averages() if kernel_kind(e.key) == "attention"
                              and any(m in e.key.lower() for m in ("fprop", "fwd", "cutlassf")))
        return {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}, forward_kernels

    grads(())  # compile outside the comparison
    full, recomputed = grads(())
    assert recomputed == len(model.blocks)
    for keep in (("attention",), ("attention", "matmul")):
        kept, recomputed = grads(keep)
        assert recomputed == 0, keep
        assert kept.keys() == full.keys()
        for name, g in full.items():
            assert (kept[name] - g).abs().max() <= 1e-2 * g.abs().max() + 1e-6, (keep, name)
