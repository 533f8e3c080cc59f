"""Full attention over the whole video as a long-range layer: every token (all segments' text and video) attends
to every other, with the local attention's per-head q/k LayerNorm and 3D RoPE at GLOBAL positions on video tokens
(time counts across segments, as in the TTT layer). Attention already sees both directions, so it runs one gated
pass (`GatedBidirectional(..., bidirectional=False)`). Parameters: 4 C^2 (q/k/v/o), as TTT's projections. Its cost
grows with the square of the video's length: the baseline the paper could not afford beyond short videos."""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tttvideo import initializers as init
from tttvideo.layout import VideoLayout
from tttvideo.rope import apply_rope, rope_cos_sin
from tttvideo.sequence.recurrent import no_sequence_parallel

if TYPE_CHECKING:
    from tttvideo.parallel.sequence import SequenceParallel


@lru_cache(maxsize=16)
def global_rope(layout: VideoLayout, head_dim: int, theta: float, device: torch.device):
    """RoPE cos/sin [L, D] over residual order: the identity on text tokens, global (t, h, w) on video tokens."""
    cos, sin = rope_cos_sin(layout.global_positions, head_dim, theta)
    text = layout.total_text_tokens
    return (torch.cat([torch.ones(text, head_dim), cos]).to(device),
            torch.cat([torch.zeros(text, head_dim), sin]).to(device))


class FullAttentionPass(nn.Module):
    def __init__(self, dim: int, num_heads: int, rope_theta: float = 10000.0, qk_norm_eps: float = 1e-6):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"width {dim} is not divisible by {num_heads} heads")
        self.num_heads, self.head_dim, self.rope_theta = num_heads, dim // num_heads, rope_theta
        self.qkv = nn.Linear(dim, 3 * dim)
        self.norm_q = nn.LayerNorm(self.head_dim, eps=qk_norm_eps)
        self.norm_k = nn.LayerNorm(self.head_dim, eps=qk_norm_eps)
        self.out = nn.Linear(dim, dim)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for lin in (self.qkv, self.out):
            init.normal_(lin.weight, std=0.02)
            nn.init.zeros_(lin.bias)
        self.norm_q.reset_parameters()
        self.norm_k.reset_parameters()

    def forward(self, x: torch.Tensor, layout: VideoLayout, reverse: bool = False,
                sp: SequenceParallel | None = None) -> torch.Tensor:
        """x [B, L, C] in residual order -> [B, L, C] (`reverse` is ignored: the layer has no direction)."""
        no_sequence_parallel("full-attention", sp)
        B, L, C = x.shape
        layout.check_sequence_length(L)
        H, D = self.num_heads, self.head_dim
        cos, sin = global_rope(layout, D, self.rope_theta, x.device)
        q, k, v = self.qkv(x).unflatten(-1, (3, H, D)).unbind(2)
        q, k, v = self.norm_q(q).transpose(1, 2), self.norm_k(k).transpose(1, 2), v.transpose(1, 2)
        out = F.scaled_dot_product_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        return self.out(out.transpose(1, 2).reshape(B, L, C))
