"""model.compile_block_glue on CUDA (skipped without it): a block's adaLN (LayerNorm + text / video modulation) and
gated residual add compiled by torch.compile against the same functions eager, at 3 s with 5B shapes (18,048 video
and 226 text tokens, 3,072 channels), bf16, forward and the gradients of every input. Tolerance 1e-2 relative to each
tensor's largest value (bf16; the compiled version computes the chain in fp32 and rounds once).

Run: `pytest tests/gpu/test_block_glue_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles for CUDA")


def test_compiled_block_glue_equals_eager_forward_and_backward():
    from tttvideo.device import compiled_on_cuda
    from tttvideo.models.cogvideox.block import gated_add, norm_modulate

    T, L, C = 226, 226 + 18048, 3072
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
    x, y = rand(1, L, C), rand(1, L, C)
    weight, bias = 1 + 0.1 * rand(C), 0.1 * rand(C)
    mods = [0.1 * rand(1, C) for _ in range(6)]
    w = torch.randn(1, L, C, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))

    def run(compile_glue: bool):
        leaves = [t.clone().requires_grad_() for t in (x, y, weight, bias, *mods)]
        x_, y_, wt, b, t_shift, t_scale, shift, scale, t_gate, gate = leaves
        h = compiled_on_cuda(norm_modulate, x_, compile_glue)(x_, wt, b, 1e-5, T, (t_shift, t_scale), (shift, scale))
        out = compiled_on_cuda(gated_add, x_, compile_glue)(x_, h * y_, T, t_gate, gate)
        (out.float() * w).sum().backward()
        return [out, *[t.grad for t in leaves]]

    for fast, eager in zip(run(True), run(False)):
        assert (fast.float() - eager.float()).abs().max() / eager.float().abs().max() < 1e-2
