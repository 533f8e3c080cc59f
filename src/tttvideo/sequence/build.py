"""The long-range layer a config names (`model.sequence_layer`), wrapped in the gates it runs behind."""

from __future__ import annotations

from torch import nn

from tttvideo.config.schema import ModelConfig, TTTConfig
from tttvideo.sequence.bidirectional import GatedBidirectional

# "ttt" is TTT-MLP or TTT-Linear by ttt.kind; "none" (model.use_ttt = false) builds no layer at all
SEQUENCE_LAYERS = ("ttt", "none", "full-attention", "mamba2", "gated-deltanet")


def configured_layer(model: ModelConfig) -> str:
    """The long-range layer a model config builds: model.sequence_layer, or "none" with model.use_ttt = false."""
    return model.sequence_layer if model.use_ttt else "none"


def sequence_layer(kind: str, dim: int, num_heads: int, ttt: TTTConfig, rope_theta: float) -> nn.Module | None:
    """The gated layer of one block; the TTT settings' backend ("triton" = fla's kernels for Mamba 2 and Gated
    DeltaNet) and gate_init apply to every kind."""
    if kind == "none":
        return None
    if kind == "ttt":
        from tttvideo.ttt.layer import BidirectionalTTT

        return BidirectionalTTT(dim, num_heads, ttt)
    if kind == "full-attention":
        from tttvideo.sequence.full_attention import FullAttentionPass

        return GatedBidirectional(FullAttentionPass(dim, num_heads, rope_theta), dim, ttt.gate_init,
                                  bidirectional=False)
    if kind == "mamba2":
        from tttvideo.sequence.mamba2 import Mamba2Pass

        return GatedBidirectional(Mamba2Pass(dim, num_heads, ttt.backend), dim, ttt.gate_init)
    if kind == "gated-deltanet":
        from tttvideo.sequence.gated_deltanet import GatedDeltaNetPass

        return GatedBidirectional(GatedDeltaNetPass(dim, num_heads, ttt.backend), dim, ttt.gate_init)
    raise ValueError(f"unknown sequence layer {kind!r}; one of {SEQUENCE_LAYERS}")
