"""Gated DeltaNet as a long-range layer: the published layer's structure (flash-linear-attention's `GatedDeltaNet`,
expand 1) with its recurrence on fla's kernel (`tttvideo.sequence.ops.gated_delta_rule`).

One pass over the scan order: q, k, v projections with a short causal conv and SiLU, q and k L2-normalised per head;
the write strength beta = sigmoid(W_b x) and decay g = -exp(A_log) softplus(W_a x + dt_bias) per head and token;
the gated delta rule (scale D^-1/2); a per-head RMSNorm gated by SiLU(W_g x); o_proj. Parameters: 5 C^2 (q, k, v,
output gate, o) + 2 C H against TTT's 4 C^2 (q/k/v/o) plus its inner model."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tttvideo.layout import VideoLayout
from tttvideo.sequence import ops
from tttvideo.sequence.bidirectional import scan_permutations
from tttvideo.sequence.mamba2 import no_sequence_parallel
from tttvideo.sequence.modules import GatedRMSNorm, ShortConv, init_decay

if TYPE_CHECKING:
    from tttvideo.parallel.sequence import SequenceParallel


class GatedDeltaNetPass(nn.Module):
    def __init__(self, dim: int, num_heads: int, backend: str = "auto"):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"width {dim} is not divisible by {num_heads} heads")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.backend = backend
        # q, k, v, the output gate, then beta and the decay's input, in one matmul
        self.in_proj = nn.Linear(dim, 4 * dim + 2 * num_heads)
        self.conv = ShortConv(3 * dim)
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.dt_bias = nn.Parameter(torch.empty(num_heads))
        self.norm = GatedRMSNorm(self.head_dim)
        self.o_proj = nn.Linear(dim, dim)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for lin in (self.in_proj, self.o_proj):
            nn.init.normal_(lin.weight, std=0.02)
            nn.init.zeros_(lin.bias)
        self.conv.reset_parameters()
        init_decay(self.A_log, self.dt_bias)
        self.norm.reset_parameters()

    def forward(self, x: torch.Tensor, layout: VideoLayout, reverse: bool = False,
                sp: SequenceParallel | None = None) -> torch.Tensor:
        """x [B, L, C] in residual order -> [B, L, C]; reverse: over the reversed scan order."""
        no_sequence_parallel("gated-deltanet", sp)
        B, L, C = x.shape
        layout.check_sequence_length(L)
        scan_order, residual_order = scan_permutations(layout, x.device, reverse)
        H, D = self.num_heads, self.head_dim
        qkv, gate, b, a = self.in_proj(x[:, scan_order]).split([3 * C, C, H, H], dim=-1)
        q, k, v = self.conv(qkv).unflatten(-1, (3, H, D)).unbind(2)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        beta = torch.sigmoid(b.float())
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())
        o = ops.gated_delta_rule(q, k, v, g, beta, D ** -0.5, self.backend)
        out = self.o_proj(self.norm(o, gate.unflatten(-1, (H, D))))
        return out[:, residual_order]
