"""Input embeddings of CogVideoX: the sinusoidal timestep embedding and its MLP, the 2x2 patch embedding of the
latents and the projection of the T5 text features into the model width.

Numerics follow diffusers' `get_timestep_embedding` (fp32 sinusoid, `flip_sin_to_cos`, `downscale_freq_shift`),
`TimestepEmbedding` (linear - SiLU - linear) and `CogVideoXPatchEmbed` for CogVideoX 1.0 (a Conv2d with stride =
kernel = patch, tokens in (frame, row, column) order).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def timestep_sinusoid(
    timesteps: torch.Tensor, dim: int, flip_sin_to_cos: bool = True, freq_shift: float = 0.0, max_period: float = 10000.0
) -> torch.Tensor:
    """[B] (possibly fractional) timesteps -> [B, dim] fp32 sinusoidal features ([cos | sin] if flipped)."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device)
    freqs = torch.exp(exponent / (half - freq_shift))
    angles = timesteps[:, None].float() * freqs[None, :]
    emb = torch.cat([torch.cos(angles), torch.sin(angles)] if flip_sin_to_cos else [torch.sin(angles), torch.cos(angles)],
                    dim=-1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb


class TimestepEmbedding(nn.Module):
    """Sinusoid of width `dim` (the model width, as in diffusers) -> linear -> SiLU -> linear -> time_embed_dim."""

    def __init__(self, dim: int, time_embed_dim: int, flip_sin_to_cos: bool = True, freq_shift: float = 0.0):
        super().__init__()
        self.dim, self.flip_sin_to_cos, self.freq_shift = dim, flip_sin_to_cos, freq_shift
        self.linear1 = nn.Linear(dim, time_embed_dim)
        self.linear2 = nn.Linear(time_embed_dim, time_embed_dim)

    def forward(self, timesteps: torch.Tensor) -> torch.Tensor:
        # the sinusoid is always fp32; the MLP runs in the parameters' dtype
        emb = timestep_sinusoid(timesteps, self.dim, self.flip_sin_to_cos, self.freq_shift)
        emb = emb.to(self.linear1.weight.dtype)
        return self.linear2(F.silu(self.linear1(emb)))


class PatchEmbed(nn.Module):
    """Latents [B, T, C, H, W] -> video tokens [B, T * H/p * W/p, dim]; text [B, L, text_dim] -> [B, L, dim]."""

    def __init__(self, in_channels: int, dim: int, text_embed_dim: int, patch_size: int, bias: bool = True):
        super().__init__()
        self.patch_size = patch_size
        self.patch = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size, bias=bias)
        self.text = nn.Linear(text_embed_dim, dim)

    def video(self, latents: torch.Tensor) -> torch.Tensor:
        B, T, C, H, W = latents.shape
        x = self.patch(latents.reshape(B * T, C, H, W))  # [B T, dim, H/p, W/p]
        return x.flatten(2).transpose(1, 2).reshape(B, -1, x.shape[1])
