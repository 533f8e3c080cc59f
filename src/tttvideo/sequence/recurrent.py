"""What Mamba 2 and Gated DeltaNet share as long-range layers: one pass over the scan order of

    in_proj -> output gate z (C), three streams (3 C) through a short causal conv and SiLU, a few scalars per head
    -> the layer's recurrence (`mix`) -> a per-head RMSNorm gated by SiLU(z) -> out_proj

with the decay parameters A_log and dt_bias per head (Mamba 2's initialisation). Parameters: 5 C^2 in the
projections plus a few per head, against TTT's 4 C^2 (q/k/v/o) plus its inner model."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tttvideo import initializers as init
from tttvideo.errors import UserError
from tttvideo.layout import VideoLayout
from tttvideo.sequence.bidirectional import gather_tokens, scan_permutations
from tttvideo.sequence.modules import GatedRMSNorm, ShortConv, init_decay

if TYPE_CHECKING:
    from tttvideo.parallel.sequence import SequenceParallel


def no_sequence_parallel(kind: str, sp: SequenceParallel | None) -> None:
    if sp is not None:
        raise UserError(f"model.sequence_layer = {kind!r} runs on one GPU; sequence parallelism (parallel.sp > 1) "
                        f"supports the TTT layer only")


class GatedRecurrentPass(nn.Module):
    kind = ""  # the model.sequence_layer name, for messages
    head_scalars = 0  # per-head inputs of the recurrence besides the three streams (dt; beta and the decay's input)

    def __init__(self, dim: int, num_heads: int, backend: str = "auto"):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"width {dim} is not divisible by {num_heads} heads")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.backend = backend
        self.in_proj = nn.Linear(dim, 4 * dim + self.head_scalars * num_heads)
        self.conv = ShortConv(3 * dim)
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.dt_bias = nn.Parameter(torch.empty(num_heads))
        self.norm = GatedRMSNorm(self.head_dim)
        self.out_proj = nn.Linear(dim, dim)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for lin in (self.in_proj, self.out_proj):
            init.normal_(lin.weight, std=0.02)
            nn.init.zeros_(lin.bias)
        self.conv.reset_parameters()
        init_decay(self.A_log, self.dt_bias)
        self.norm.reset_parameters()

    def mix(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, scalars: torch.Tensor) -> torch.Tensor:
        """The recurrence over the scan order: the three streams [B, L, H, D], the per-head scalars [B, L, k H]
        -> [B, L, H, D]."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, layout: VideoLayout, reverse: bool = False,
                sp: SequenceParallel | None = None) -> torch.Tensor:
        """x [B, L, C] in residual order -> [B, L, C]; reverse: over the reversed scan order."""
        no_sequence_parallel(self.kind, sp)
        B, L, C = x.shape
        layout.check_sequence_length(L)
        scan_order, residual_order = scan_permutations(layout, x.device, reverse)
        H, D = self.num_heads, self.head_dim
        z, streams, scalars = self.in_proj(gather_tokens(x, scan_order)).split([C, 3 * C, self.head_scalars * H],
                                                                               dim=-1)
        a, b, c = self.conv(streams).unflatten(-1, (3, H, D)).unbind(2)
        out = self.out_proj(self.norm(self.mix(a, b, c, scalars), z.unflatten(-1, (H, D))))
        return gather_tokens(out, residual_order)
