"""3D rotary position embedding, shared by local attention and the TTT layer.

The head dimension is split t/h/w = D/4, 3D/8, 3D/8 (16/24/24 for D = 64) and rotated in adjacent pairs
(x[2i], x[2i+1]), the convention of CogVideoX and of the original TTT code. Positions come from
`tttvideo.layout.VideoLayout` (local per attention window, global for TTT).
"""

from __future__ import annotations

import torch


def rope_split(head_dim: int) -> tuple[int, int, int]:
    if head_dim % 16:
        raise ValueError(f"3D RoPE needs a head dim divisible by 16, got {head_dim}")
    return head_dim // 4, head_dim // 8 * 3, head_dim // 8 * 3


def _axis_angles(pos: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2] / dim))
    return pos.to(torch.float64)[:, None] * freqs[None, :]


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [N, 3] of (t, h, w) -> cos, sin [N, head_dim] in float32, each angle repeated for its pair."""
    dt, dh, dw = rope_split(head_dim)
    angles = torch.cat(
        [
            _axis_angles(positions[:, 0], dt, theta),
            _axis_angles(positions[:, 1], dh, theta),
            _axis_angles(positions[:, 2], dw, theta),
        ],
        dim=-1,
    ).repeat_interleave(2, dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of the last dim. x [..., N, D]; cos/sin [N, D]. Computed in fp32, returned in x.dtype."""
    xf = x.float()
    pairs = xf.unflatten(-1, (-1, 2))
    rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
    return (xf * cos + rotated * sin).to(x.dtype)
