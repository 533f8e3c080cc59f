"""Mamba 2 as a long-range layer: the published layer's structure with its SSD recurrence on
flash-linear-attention's kernel (`tttvideo.sequence.ops.simple_gla`).

One pass over the scan order: in_proj -> z (output gate), x, B, C per head (head dim D, state size D: B and C per
head, i.e. as many groups as heads) and dt per head; a short causal conv and SiLU on x, B, C; decay g = -exp(A_log)
dt with dt = softplus(dt_raw + dt_bias); the SSD recurrence with q = C, k = B, v = x dt (scale 1); y + D x; a gated
RMSNorm with z; out_proj. Parameters: 5 C^2 in the projections (in_proj 4 C^2 + C H, out_proj C^2) against TTT's
4 C^2 (q/k/v/o) plus its inner model."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tttvideo.errors import UserError
from tttvideo.layout import VideoLayout
from tttvideo.sequence import ops
from tttvideo.sequence.bidirectional import scan_permutations
from tttvideo.sequence.modules import GatedRMSNorm, ShortConv, init_decay

if TYPE_CHECKING:
    from tttvideo.parallel.sequence import SequenceParallel


def no_sequence_parallel(kind: str, sp: SequenceParallel | None) -> None:
    if sp is not None:
        raise UserError(f"model.sequence_layer = {kind!r} runs on one GPU; sequence parallelism (parallel.sp > 1) "
                        f"supports the TTT layer only")


class Mamba2Pass(nn.Module):
    def __init__(self, dim: int, num_heads: int, backend: str = "auto"):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"width {dim} is not divisible by {num_heads} heads")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.backend = backend
        self.in_proj = nn.Linear(dim, 4 * dim + num_heads)
        self.conv = ShortConv(3 * dim)
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.dt_bias = nn.Parameter(torch.empty(num_heads))
        self.D = nn.Parameter(torch.empty(num_heads))
        self.norm = GatedRMSNorm(self.head_dim)
        self.out_proj = nn.Linear(dim, dim)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for lin in (self.in_proj, self.out_proj):
            nn.init.normal_(lin.weight, std=0.02)
            nn.init.zeros_(lin.bias)
        self.conv.reset_parameters()
        init_decay(self.A_log, self.dt_bias)
        nn.init.ones_(self.D)
        self.norm.reset_parameters()

    def forward(self, x: torch.Tensor, layout: VideoLayout, reverse: bool = False,
                sp: SequenceParallel | None = None) -> torch.Tensor:
        """x [B, L, C] in residual order -> [B, L, C]; reverse: over the reversed scan order."""
        no_sequence_parallel("mamba2", sp)
        B, L, C = x.shape
        layout.check_sequence_length(L)
        scan_order, residual_order = scan_permutations(layout, x.device, reverse)
        H, D = self.num_heads, self.head_dim
        z, xbc, dt = self.in_proj(x[:, scan_order]).split([C, 3 * C, H], dim=-1)
        xs, b, c = self.conv(xbc).unflatten(-1, (3, H, D)).unbind(2)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        g = -torch.exp(self.A_log.float()) * dt
        y = ops.simple_gla(c, b, xs * dt[..., None].to(xs.dtype), g, 1.0, self.backend)
        y = y + self.D.to(y.dtype)[:, None] * xs
        out = self.out_proj(self.norm(y, z.unflatten(-1, (H, D))))
        return out[:, residual_order]
