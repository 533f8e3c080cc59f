"""checkpointing.attention_by_window (Wan: both attentions one window at a time in training, each window
checkpointed): the same gradients as the plain step, and a config error for a backbone without it.

The model runs in float64, but Wan's block computes its norms and modulation in fp32 by design (as diffusers' does),
so the windowed form, whose matrix products sum in another order, differs from the whole-video one at fp32's
precision: measured 1e-6 of the largest element for the TTT learning-rate bias (the scan amplifies it), 2e-7 for
the cross-attention norm, 3e-8 elsewhere; a wrong merge of the shared frame or a wrong window's text is off by
O(1). The same bound as tests/test_ffn_chunks.py's for Wan."""

from __future__ import annotations

import pytest
import torch

from tttvideo.config.schema import CheckpointingConfig
from tttvideo.errors import ConfigError
from tttvideo.models import apply_checkpointing

from tests.test_ffn_chunks import SUB_BLOCK, cogvideox, step, wan

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("policy", [SUB_BLOCK, {}], ids=["sub-block", "none"])
def test_same_gradients_as_whole_video_attention(policy):
    """Two segments (a shared latent frame averaged over its two windows), TTT gates open."""
    plain, _, _ = step(wan, CheckpointingConfig(**policy), watch=False)
    windowed, _, _ = step(wan, CheckpointingConfig(**policy, attention_by_window=True), watch=False)
    assert windowed.keys() == plain.keys() and len(plain) > 20
    assert any("cross_attn.to_q" in n for n in plain) and any("attn.norm_q" in n for n in plain)
    for name, g in plain.items():
        torch.testing.assert_close(windowed[name], g, rtol=1e-6, atol=2e-6 * float(g.abs().max()), msg=name)


def test_forward_without_gradients_is_the_plain_forward():
    """Without gradients the switch changes nothing (the chunked inference form is memory.chunked_inference)."""
    net, (latents, text, t) = wan()
    with torch.no_grad():
        plain = net(latents, text, t)
        apply_checkpointing(net, CheckpointingConfig(attention_by_window=True))
        assert all(b.attention_by_window for b in net.blocks)
        torch.testing.assert_close(net(latents, text, t), plain, rtol=0, atol=0)


def test_refused_for_a_backbone_without_windows_one_at_a_time():
    net, _ = cogvideox()
    with pytest.raises(ConfigError, match="checkpointing.attention_by_window"):
        apply_checkpointing(net, CheckpointingConfig(attention_by_window=True))
