"""model.compile_attention_glue on CUDA (skipped without it): local attention's q/k norms, window gather + RoPE and
overlap merge compiled by torch.compile against the same functions eager, at 9 s (3 windows, 5B shapes: 48 heads of
64), bf16, forward and the gradients of q, k, v and of the norms' weights and biases through the gather, and of the
attention output through the merge.
Tolerance 1e-2 relative to each tensor's largest value (bf16; RoPE is computed in fp32 by both, and the compiled
version may round once less).

Run: `pytest tests/gpu/test_attention_glue_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles for CUDA")


def test_compiled_glue_equals_eager_forward_and_backward():
    from tttvideo.device import compiled_on_cuda
    from tttvideo.layout import VideoLayout
    from tttvideo.models import attention

    layout = VideoLayout.create(9, 480, 720)
    index, cos, sin, inv_count = attention.window_tensors(layout, 64, 10000.0, torch.device("cuda"))
    n, flat, L = index.shape[0], index.reshape(-1), layout.total_tokens
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = [torch.randn(1, L, 48, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3)]
    affine = [1 + 0.1 * torch.randn(64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4)]

    def run(compile_glue: bool):
        inputs = [t.clone().requires_grad_() for t in qkv + affine]
        q, k, v, wq, bq, wk, bk = inputs
        q, k, v = compiled_on_cuda(attention.gather_windows, q, compile_glue)(q, k, v, flat, n, cos, sin,
                                                                             (wq, bq, 1e-6), (wk, bk, 1e-6))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        merged = compiled_on_cuda(attention.merge_windows, out, compile_glue)(out, flat, n, inv_count, L)
        w = torch.randn(merged.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
        (merged.float() * w).sum().backward()
        return [merged, *[t.grad for t in inputs]]

    for fast, eager in zip(run(True), run(False)):
        assert (fast.float() - eager.float()).abs().max() / eager.float().abs().max() < 1e-2
