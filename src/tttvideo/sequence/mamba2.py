"""Mamba 2 as a long-range layer: the published layer's structure (`tttvideo.sequence.recurrent`: in_proj to z, x,
B, C and dt, a short causal conv on x, B, C, a gated RMSNorm, out_proj) with its SSD recurrence on
flash-linear-attention's kernel (`tttvideo.sequence.ops.simple_gla`). B and C are per head (as many groups as
heads) with state size D; decay g = -exp(A_log) dt with dt = softplus(dt_raw + dt_bias); the recurrence takes
q = C, k = B, v = x dt (scale 1), and y + D x leaves it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tttvideo.sequence import ops
from tttvideo.sequence.recurrent import GatedRecurrentPass


class Mamba2Pass(GatedRecurrentPass):
    kind = "mamba2"
    head_scalars = 1  # dt

    def __init__(self, dim: int, num_heads: int, backend: str = "auto"):
        super().__init__(dim, num_heads, backend)
        self.D = nn.Parameter(torch.empty(num_heads))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.ones_(self.D)

    def mix(self, x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        dt = F.softplus(dt.float() + self.dt_bias.float())
        g = -torch.exp(self.A_log.float()) * dt
        y = ops.simple_gla(c, b, x * dt[..., None].to(x.dtype), g, 1.0, self.backend)
        return y + self.D.to(y.dtype)[:, None] * x
