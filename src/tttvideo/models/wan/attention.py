"""Wan's attention layers with segment-local windows: self-attention over each 3-s window, cross-attention of each
window's video tokens to that segment's text.

Self-attention is Wan2.1's: q/k/v projections, RMSNorm over the whole inner width (all heads together) on q and k,
3D RoPE with the head dim split frame / row / column = D - 4 (D // 6), 2 (D // 6), 2 (D // 6) (44/42/42 for D = 128)
and rotated in adjacent pairs. Every window restarts its frame position at 0 (as in pretraining on 3-s clips), so one
RoPE table serves all windows. The windows are gathered into the batch dimension and attended in one SDPA call; a
latent frame shared by two windows takes the mean of their outputs (`tttvideo.models.attention.merge_windows`, the
scheme CogVideoX's `LocalAttention` uses).

Cross-attention takes its queries from the video tokens and its keys/values from the text features of the window's
segment (RMSNorm on q and k, no RoPE), window by window in the batch dimension, with the shared frame again averaged
over its two windows. With one segment both layers are exactly diffusers' `WanAttention` (self / cross).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from tttvideo.layout import VideoLayout
from tttvideo.models.attention import merge_windows, window_covers, window_glue


def wan_rope_split(head_dim: int) -> tuple[int, int, int]:
    """(frame, row, column) shares of the head dim in Wan's 3D RoPE."""
    side = 2 * (head_dim // 6)
    return head_dim - 2 * side, side, side


def wan_rope_cos_sin(positions: torch.Tensor, head_dim: int,
                     theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [N, 3] of (frame, row, column) -> cos, sin [N, head_dim] fp32, each angle repeated for its pair
    (angles in float64, as diffusers' WanRotaryPosEmbed tabulates them)."""
    angles = []
    for axis, size in enumerate(wan_rope_split(head_dim)):
        freqs = 1.0 / theta ** (torch.arange(0, size, 2, dtype=torch.float64) / size)
        angles.append(positions[:, axis].to(torch.float64)[:, None] * freqs[None, :])
    pairs = torch.cat(angles, dim=-1).repeat_interleave(2, dim=-1)
    return pairs.cos().float(), pairs.sin().float()


@lru_cache(maxsize=16)
def window_table(layout: VideoLayout, device: torch.device) -> torch.Tensor:
    """Per layout and device: the window gather index as [n, W] (`attention.window_glue`'s form; the identity with
    one window)."""
    return layout.flat_window_index().reshape(layout.num_segments, -1).to(device)


@lru_cache(maxsize=16)
def window_gather(layout: VideoLayout, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Per layout and device, shared by every layer: the window gather index [n W] over stream positions (None with
    one window: no gather) and the reciprocal count of windows covering each position [L, 1]."""
    if layout.total_text_tokens:
        raise ValueError("Wan's layout has no text in the stream; build it with tttvideo.models.wan.layout")
    n = layout.num_segments
    flat = window_table(layout, device).reshape(-1) if n > 1 else None  # a view: one index tensor serves both
    inv_count = (1.0 / layout.window_overlap_count.double()).float()[:, None]
    return flat, inv_count.to(device)


@lru_cache(maxsize=16)
def window_indices(layout: VideoLayout, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per layout and device: each window's stream positions [W]."""
    return tuple(layout.window_index(i).to(device) for i in range(layout.num_segments))


@lru_cache(maxsize=16)
def window_rope(layout: VideoLayout, head_dim: int, theta: float, device: torch.device):
    """The local RoPE cos/sin [W, D] of one window (frame positions restart at 0 in every window)."""
    cos, sin = wan_rope_cos_sin(layout.local_positions, head_dim, theta)
    return cos.to(device), sin.to(device)


def project_heads(x: torch.Tensor, proj: nn.Linear, norm: nn.RMSNorm | None, heads: int) -> torch.Tensor:
    """[B, L, C] -> [B, L, H, D]: projection, then the RMSNorm over all heads together (Wan's q/k norm)."""
    y = proj(x)
    if norm is not None:
        y = norm(y)
    return y.unflatten(-1, (heads, -1))


class WindowSelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, eps: float, rope_theta: float = 10000.0):
        super().__init__()
        self.num_heads, self.head_dim, self.rope_theta = num_heads, dim // num_heads, rope_theta
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q = nn.RMSNorm(dim, eps=eps)
        self.norm_k = nn.RMSNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor, layout: VideoLayout) -> torch.Tensor:
        """x [B, L, dim], the video tokens in stream order -> [B, L, dim]."""
        B, L, _ = x.shape
        flat, inv_count = window_gather(layout, x.device)
        cos, sin = window_rope(layout, self.head_dim, self.rope_theta, x.device)
        n = layout.num_segments
        q = project_heads(x, self.to_q, self.norm_q, self.num_heads)
        k = project_heads(x, self.to_k, self.norm_k, self.num_heads)
        v = project_heads(x, self.to_v, None, self.num_heads)
        # [B n, H, W, D], RoPE on q and k; without gradients one Triton pass (the q/k RMSNorms ran over all heads)
        q, k, v = window_glue(q, k, v, window_table(layout, x.device), cos, sin, None, None, compile_glue=False)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
        return self.to_out(merge_windows(out, flat, n, inv_count, L, window_covers(layout, x.device)))

    def window_forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """One window's tokens h [B, W, dim] (already normalised) -> its attention output [B, W, dim] BEFORE the
        output projection (the chunked forward averages the shared frames first, as `forward` does)."""
        q = project_heads(h, self.to_q, self.norm_q, self.num_heads)
        k = project_heads(h, self.to_k, self.norm_k, self.num_heads)
        v = project_heads(h, self.to_v, None, self.num_heads)
        one_window = torch.arange(h.shape[1], device=h.device)[None]  # the window's own tokens: nothing to gather
        q, k, v = window_glue(q, k, v, one_window, cos, sin, None, None, compile_glue=False)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
        return out.transpose(1, 2).flatten(2)


class SegmentCrossAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, eps: float):
        super().__init__()
        self.num_heads = num_heads
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q = nn.RMSNorm(dim, eps=eps)
        self.norm_k = nn.RMSNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor, text: torch.Tensor, layout: VideoLayout) -> torch.Tensor:
        """x [B, L, dim] video tokens; text [B, n, text_len, dim] (embedded, one entry per segment) -> [B, L, dim]."""
        B, L, C = x.shape
        n, H = text.shape[1], self.num_heads
        if n != layout.num_segments:
            layout.check_text_embeddings(n)
        flat, inv_count = window_gather(layout, x.device)
        q = project_heads(x, self.to_q, self.norm_q, H)
        if flat is not None:
            q = q[:, flat].reshape(B * n, -1, H, C // H)
        context = text.reshape(B * n, -1, C)
        k = project_heads(context, self.to_k, self.norm_k, H)
        v = project_heads(context, self.to_v, None, H)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=0.0,
                                             is_causal=False)
        return self.to_out(merge_windows(out, flat, n, inv_count, L, window_covers(layout, x.device)))

    def window_forward(self, h: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """One window's tokens h [B, W, dim] (already normalised) against its segment's embedded text [B, len, dim]
        -> [B, W, dim] before the output projection."""
        H = self.num_heads
        q = project_heads(h, self.to_q, self.norm_q, H).transpose(1, 2)
        k = project_heads(text, self.to_k, self.norm_k, H).transpose(1, 2)
        v = project_heads(text, self.to_v, None, H).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
        return out.transpose(1, 2).flatten(2)
