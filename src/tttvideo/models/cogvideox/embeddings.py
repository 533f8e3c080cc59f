"""Input embeddings of CogVideoX: the 2x2 patch embedding of the latents and the projection of the T5 text features
into the model width (the timestep embedding is shared with Wan: `models.layers.TimestepEmbedding`).

Numerics follow diffusers' `CogVideoXPatchEmbed` for CogVideoX 1.0 (a Conv2d with stride =
kernel = patch, tokens in (frame, row, column) order).
"""

from __future__ import annotations

import torch
from torch import nn


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
