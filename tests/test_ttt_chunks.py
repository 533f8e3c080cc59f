"""checkpointing.ttt_chunk_tokens and ttt_head_groups (the TTT layer's token-wise parts over token chunks and its
scan over groups of heads, in training): the same gradients as the whole-sequence layer, for the layer alone and
inside both backbones' checkpointed steps.

The layer alone runs in float64 except its eta gate's sigmoid, which it computes in fp32 by design: chunking
changes which rows a matrix product computes together, a last-bit change that the gate's fp32 rounding can turn
into one fp32 ulp of eta. Measured: 4e-8 of the largest element for the learning-rate bias's gradient, 4e-9 for
w_k, 1e-10 elsewhere; a chunk written to the wrong place or a lost pad is off by O(1). The backbones' steps reuse
tests/test_ffn_chunks.py's comparison and bound (Wan's fp32 norms)."""

from __future__ import annotations

import pytest
import torch

from tttvideo.config.schema import CheckpointingConfig, TTTConfig
from tttvideo.models.wan.layout import wan_layout_from_latents
from tttvideo.ttt.layer import TTTLayer
from tests.test_ffn_chunks import SUB_BLOCK, cogvideox, step, wan

pytestmark = pytest.mark.usefixtures("one_thread")


def _layer_grads(chunk: int, groups: int = 1, backend: str = "reference") -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    layer = TTTLayer(32, 2, TTTConfig(mini_batch_size=16, scan_checkpoint_group_size=2, backend=backend)).double()
    layout = wan_layout_from_latents(25, 4, 6, 2, 16)  # two segments, 150 tokens: padded to the mini-batch
    x = torch.randn(1, layout.total_tokens, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x.requires_grad_()
    layer.chunk_tokens, layer.head_groups = chunk, groups
    for reverse in (False, True):
        y = layer(x, layout, reverse=reverse)
        (y * torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(2))).sum().backward()
    grads = {n: p.grad for n, p in layer.named_parameters()}
    grads["x"] = x.grad
    assert layout.ttt_padding > 0 and layout.total_tokens % 7
    return grads


@pytest.mark.parametrize("groups", [1, 2], ids=["all heads", "2 head groups"])
def test_layer_gradients_equal_the_whole_sequence_layer(groups):
    plain, chunked = _layer_grads(0), _layer_grads(7, groups)
    assert len(plain) > 10
    for name, g in plain.items():
        torch.testing.assert_close(chunked[name], g, rtol=1e-6, atol=2e-7 * float(g.abs().max()), msg=name)


@pytest.mark.parametrize("build", [cogvideox, wan], ids=["cogvideox", "wan"])
def test_model_gradients_equal_the_plain_step(build):
    plain, _, _ = step(build, CheckpointingConfig(**SUB_BLOCK), watch=False)
    chunked, _, _ = step(build, CheckpointingConfig(**SUB_BLOCK, ttt_chunk_tokens=7, ttt_head_groups=2), watch=False)
    assert chunked.keys() == plain.keys()
    for name, g in plain.items():
        torch.testing.assert_close(chunked[name], g, rtol=1e-6, atol=1e-6 * float(g.abs().max()), msg=name)


def test_head_groups_without_chunks_are_refused():
    from tttvideo.errors import ConfigError
    from tttvideo.models import apply_checkpointing

    net, _ = wan()
    with pytest.raises(ConfigError, match="checkpointing.ttt_chunk_tokens"):
        apply_checkpointing(net, CheckpointingConfig(ttt_head_groups=2))
