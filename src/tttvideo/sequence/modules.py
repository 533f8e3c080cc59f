"""Small pieces Mamba 2 and Gated DeltaNet share: the short causal convolution over the scan order and the gated
RMSNorm of their outputs (both as in the published layers), and the initialisation of their decay parameters."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class ShortConv(nn.Module):
    """Depthwise causal conv1d over the sequence (kernel 4) with SiLU: [B, L, C] -> [B, L, C]. Causal in the order
    it is given, so the reverse pass, which is given the reversed scan order, looks the other way."""

    def __init__(self, channels: int, kernel: int = 4):
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, kernel, groups=channels, padding=kernel - 1)

    def reset_parameters(self) -> None:
        self.conv.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        L = x.shape[1]
        return F.silu(self.conv(x.transpose(1, 2))[..., :L].transpose(1, 2))


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of y times SiLU(z) (Mamba 2's norm-then-gate and Gated DeltaNet's output gate): y, z
    [B, L, H, D] -> [B, L, H * D]."""

    def __init__(self, head_dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        yf = y.float()
        yf = yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (yf * F.silu(z.float())).to(z.dtype).flatten(2)


@torch.no_grad()
def init_decay(a_log: torch.Tensor, dt_bias: torch.Tensor, dt_min: float = 1e-3, dt_max: float = 0.1) -> None:
    """Mamba 2's initialisation: A = -U(1, 16) per head (stored as log(-A)), and the step size dt = softplus(raw +
    dt_bias) starting log-uniform in [dt_min, dt_max] (dt_bias the softplus inverse of that draw). Nothing on the
    meta device (tttvideo.initializers says why)."""
    if a_log.is_meta:
        return
    a_log.copy_(torch.empty_like(a_log).uniform_(1, 16).log())
    dt = torch.exp(torch.rand_like(dt_bias) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
