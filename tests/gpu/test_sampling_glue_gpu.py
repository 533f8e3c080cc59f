"""The sampling forward's fused glue on CUDA (skipped without it), bf16 at 5B widths, against the paths it replaces:

- the TTT layer without gradients (`post_norm_rows` compiled: the scan output gathered to residual order and
  post-normalised in one pass) against the same layer with gradients (transpose, norm, output projection, gather);
- the gated residual add of the bidirectional wrapper compiled against eager;
- the post-norm's Triton kernel (`triton_post_norm`) against the fp32 reference and the compiled one at 3 s, and at
  a guided 63-s pass's shape (its output past 2^31 elements: 64-bit offsets) on the first and last rows;
- the MLP's first product with the GELU in cuBLASLt's epilogue (`linear_gelu`) against F.linear then F.gelu(tanh),
  and in fp32 closer to the tanh GELU than to the erf one (the form CogVideoX and Wan use).

Tolerance: 1e-2 of each tensor's largest value (bf16; fused forms round once where eager rounds twice).

Run: `pytest tests/gpu/test_sampling_glue_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles for CUDA")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def test_sampling_ttt_layer_equals_the_training_path():
    from tttvideo.config.schema import TTTConfig
    from tttvideo.layout import VideoLayout
    from tttvideo.ttt.layer import BidirectionalTTT

    lay = VideoLayout.create("9s", height=480, width=720, text_tokens=226, mini_batch_size=16)
    torch.manual_seed(0)
    block = BidirectionalTTT(3072, 48, TTTConfig(kind="mlp", scan_checkpoint_group_size=16)).cuda().bfloat16()
    with torch.no_grad():
        for g in block.gates():
            g.normal_()
        block.ttt.post_norm.weight.add_(0.3 * torch.randn_like(block.ttt.post_norm.weight))
    x = torch.randn(2, lay.total_tokens, 3072, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        sampled = block(x, lay)
        block.ttt.compile_glue = False
        eager = block(x, lay)
    trained = block(x.clone().requires_grad_(), lay).detach()  # the training path, eager gates
    assert rel(sampled, trained) < 1e-2 and rel(eager, trained) < 1e-2


@pytest.mark.parametrize("duration", ["3s", "63s"])
def test_post_norm_kernel(duration):
    from tttvideo.config.loader import load_config
    from tttvideo.layout import VideoLayout
    from tttvideo.ttt.layer import layout_tensors, post_norm_rows
    from tttvideo.ttt.triton_post_norm import post_norm_rows_forward

    cfg = load_config(None, ["ttt.sample_mini_batch_size=16"])  # the sampling layout: 351,168 tokens at 63 s
    lay = VideoLayout.from_config(cfg.layout, cfg.ttt, duration, phase="sample")
    L, pad = lay.total_tokens, lay.ttt_padding
    _, (_, index), _, _ = layout_tensors(lay, 64, 10000.0, torch.device("cuda"))  # the reverse pass's order
    gen = torch.Generator(device="cuda").manual_seed(0)
    scanned = torch.randn(2, 48, L + pad, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = (1 + 0.3 * torch.randn(3072, device="cuda", generator=gen)).bfloat16()
    b = (0.3 * torch.randn(3072, device="cuda", generator=gen)).bfloat16()
    with torch.no_grad():
        got = post_norm_rows_forward(scanned, index, w, b, 1e-6)
        assert got.shape == (2, L, 3072) and got.dtype == torch.bfloat16
        if duration == "3s":
            assert got.numel() < 2**31
            want = post_norm_rows(scanned.float(), index, w.float(), b.float(), 1e-6)
            compiled = torch.compile(post_norm_rows, dynamic=False)(scanned, index, w, b, 1e-6)
            assert rel(got, want) < 1e-2 and rel(got, want) <= 1.5 * rel(compiled, want) + 1e-3
        else:
            assert got.numel() > 2**31
            for rows in (slice(0, 1024), slice(L - 1024, L)):
                want = post_norm_rows(scanned.float(), index[rows], w.float(), b.float(), 1e-6)
                assert rel(got[:, rows], want) < 1e-2, rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mlp_gelu_epilogue(dtype):
    from tttvideo.models.layers import MLP, gelu_in_epilogue, linear_gelu

    torch.manual_seed(0)
    mlp = MLP(3072, 4 * 3072).cuda().to(dtype)
    x = torch.randn(2, 4096, 3072, device="cuda", dtype=dtype)
    with torch.no_grad():
        assert gelu_in_epilogue(mlp.fc1, x) == (dtype == torch.bfloat16)
        pre = F.linear(x, mlp.fc1.weight, mlp.fc1.bias)
        fused = linear_gelu(x, mlp.fc1.weight, mlp.fc1.bias)
        tanh, erf = F.gelu(pre, approximate="tanh"), F.gelu(pre)
        if dtype == torch.bfloat16:
            assert rel(fused, tanh) < 1e-2
            assert rel(mlp(x), mlp.fc2(tanh)) < 1e-2
        else:  # fp32 (TF32 off): the epilogue's GELU is the tanh form, well inside the tanh-erf gap
            assert (fused - tanh).abs().max() < 0.1 * (tanh - erf).abs().max()
