"""Gated DeltaNet as a long-range layer: the published layer's structure (flash-linear-attention's `GatedDeltaNet`,
expand 1; `tttvideo.sequence.recurrent`: q, k, v through a short causal conv, an output gate with RMSNorm, out_proj)
with its recurrence on fla's kernel (`tttvideo.sequence.ops.gated_delta_rule`): q and k L2-normalised per head, the
write strength beta = sigmoid(W_b x) and the decay g = -exp(A_log) softplus(W_a x + dt_bias) per head and token,
scale D^-1/2."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tttvideo.sequence import ops
from tttvideo.sequence.recurrent import GatedRecurrentPass


class GatedDeltaNetPass(GatedRecurrentPass):
    kind = "gated-deltanet"
    head_scalars = 2  # beta's and the decay's inputs

    def __init__(self, dim: int, num_heads: int, backend: str = "auto"):
        super().__init__(dim, num_heads, backend)
        self.reset_parameters()

    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scalars: torch.Tensor) -> torch.Tensor:
        b, a = scalars.float().chunk(2, dim=-1)
        g = -torch.exp(self.A_log.float()) * F.softplus(a + self.dt_bias.float())
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        return ops.gated_delta_rule(q, k, v, g, torch.sigmoid(b), self.head_dim ** -0.5, self.backend)
