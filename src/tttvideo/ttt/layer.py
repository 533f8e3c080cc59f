"""The TTT layer of the long-video DiT (SPEC sections 2-3).

`TTTLayer` maps a residual-order sequence [all text | all video] of width C to a sequence of the same shape:
projections wq/wk/wv, per-head L2-normalised Q/K, 3D RoPE with GLOBAL temporal positions on video Q/K, the
LayerNorm reconstruction target, the per-token inner learning rate eta, the per-segment interleave, padding to the
mini-batch (padded tokens carry eta = 0 and their outputs are dropped), the TTT scan, post-norm, wo, and the
inverse interleave.

`BidirectionalTTT` runs it twice with shared parameters, as in the paper: Z = X + tanh(alpha) * TTT(X), then
Z' = Z + tanh(beta) * reverse(TTT(reverse(Z))), with separate per-channel gates for text and video tokens.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tttvideo.layout import VideoLayout
from tttvideo.rope import apply_rope, rope_cos_sin
from tttvideo.ttt import ops

# eps of the reconstruction-target LayerNorm: the original normalises by (unbiased std + eps).
TARGET_LN_EPS = 1e-8


@lru_cache(maxsize=16)
def _layout_tensors(layout: VideoLayout, head_dim: int, theta: float, device: torch.device):
    """Index maps and RoPE tables of a layout on a device, shared by every layer of the model."""
    cos, sin = rope_cos_sin(layout.global_positions, head_dim, theta)
    return (
        layout.interleave_perm.to(device),
        layout.deinterleave_perm.to(device),
        layout.reverse_perm.to(device),
        cos.to(device),
        sin.to(device),
    )


class TTTLayer(nn.Module):
    def __init__(
        self,
        dim: int,
        num_heads: int,
        kind: str = "mlp",
        mini_batch_size: int = 64,
        base_lr: float = 0.1,
        scan_checkpoint_group_size: int = 16,
        rope_theta: float = 10000.0,
        backend: str = "auto",
        mlp_expansion: int = 4,
    ):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"width {dim} is not divisible by {num_heads} heads")
        if kind not in ("mlp", "linear"):
            raise ValueError(f"TTT kind must be 'mlp' or 'linear', got {kind!r}")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.kind = kind
        self.mini_batch_size = mini_batch_size
        self.base_lr = base_lr
        self.scan_checkpoint_group_size = scan_checkpoint_group_size
        self.rope_theta = rope_theta
        self.backend = backend

        H, D = num_heads, self.head_dim
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=True) for _ in range(4))
        # eta gate: one linear map of the full hidden state per head
        self.learnable_ttt_lr_weight = nn.Parameter(torch.empty(H, dim))
        self.learnable_ttt_lr_bias = nn.Parameter(torch.empty(H))
        self.ttt_norm_weight = nn.Parameter(torch.empty(H, D))
        self.ttt_norm_bias = nn.Parameter(torch.empty(H, D))
        self.post_norm = nn.LayerNorm(dim, eps=1e-6)
        hidden = mlp_expansion * D if kind == "mlp" else D
        self.W1 = nn.Parameter(torch.empty(H, D, hidden))
        self.b1 = nn.Parameter(torch.empty(H, hidden))
        if kind == "mlp":
            self.W2 = nn.Parameter(torch.empty(H, hidden, D))
            self.b2 = nn.Parameter(torch.empty(H, D))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """SPEC section 3: projections and inner weights N(0, 0.02), biases 0, ttt_norm identity."""
        for lin in (self.wq, self.wk, self.wv, self.wo):
            nn.init.normal_(lin.weight, std=0.02)
            nn.init.zeros_(lin.bias)
        nn.init.normal_(self.learnable_ttt_lr_weight, std=0.02)
        nn.init.zeros_(self.learnable_ttt_lr_bias)
        nn.init.ones_(self.ttt_norm_weight)
        nn.init.zeros_(self.ttt_norm_bias)
        self.post_norm.reset_parameters()
        nn.init.normal_(self.W1, std=0.02)
        nn.init.zeros_(self.b1)
        if self.kind == "mlp":
            nn.init.normal_(self.W2, std=0.02)
            nn.init.zeros_(self.b2)

    def inner_params(self) -> tuple[torch.Tensor, ...]:
        return (self.W1, self.b1, self.W2, self.b2) if self.kind == "mlp" else (self.W1, self.b1)

    def _reconstruction_target(self, v: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """LN_ttt(v - k) + k, with the original's (unbiased std + eps) normalisation; the scan regresses onto v - k."""
        d = v - k
        d = (d - d.mean(dim=-1, keepdim=True)) / (d.std(dim=-1, keepdim=True) + TARGET_LN_EPS)
        return self.ttt_norm_weight * d + self.ttt_norm_bias + k

    def eta(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token, per-head inner learning rate [B, L, H]: base_lr * sigmoid(theta_h . x + b_h) / D / b."""
        gate = F.linear(x, self.learnable_ttt_lr_weight.to(x.dtype), self.learnable_ttt_lr_bias.to(x.dtype))
        return self.base_lr * torch.sigmoid(gate.float()) / (self.head_dim * self.mini_batch_size)

    def forward(self, x: torch.Tensor, layout: VideoLayout) -> torch.Tensor:
        B, L, C = x.shape
        layout.check_sequence_length(L)
        if layout.mini_batch_size != self.mini_batch_size:
            raise ValueError(
                f"layout pads to mini-batch {layout.mini_batch_size} but the TTT layer uses {self.mini_batch_size}"
            )
        H, D = self.num_heads, self.head_dim
        interleave, deinterleave, _, cos, sin = _layout_tensors(layout, D, self.rope_theta, x.device)
        T = layout.total_text_tokens

        q = F.normalize(self.wq(x).view(B, L, H, D).float(), dim=-1)
        k = F.normalize(self.wk(x).view(B, L, H, D).float(), dim=-1)
        v = self.wv(x).view(B, L, H, D).float()
        # RoPE on video tokens only, positions by place in the sequence (heads move out of the way first)
        q_video = apply_rope(q[:, T:].transpose(1, 2), cos, sin).transpose(1, 2)
        k_video = apply_rope(k[:, T:].transpose(1, 2), cos, sin).transpose(1, 2)
        q = torch.cat([q[:, :T], q_video], dim=1)
        k = torch.cat([k[:, :T], k_video], dim=1)
        v = self._reconstruction_target(v, k)
        eta = self.eta(x)

        pad = layout.ttt_padding
        q, k, v = (self._to_scan_order(t.to(x.dtype), interleave, pad) for t in (q, k, v))
        eta = F.pad(eta[:, interleave].transpose(1, 2), (0, pad))  # padded tokens: eta = 0, no update

        scan = ops.ttt_mlp if self.kind == "mlp" else ops.ttt_linear
        out = scan(
            q, k, v, eta, self.ttt_norm_weight, self.ttt_norm_bias, *self.inner_params(),
            mini_batch_size=self.mini_batch_size,
            checkpoint_group_size=self.scan_checkpoint_group_size,
            backend=self.backend,
        )
        out = out[:, :, :L].transpose(1, 2).reshape(B, L, C).to(x.dtype)
        out = self.wo(self.post_norm(out))
        return out[:, deinterleave]

    @staticmethod
    def _to_scan_order(t: torch.Tensor, interleave: torch.Tensor, pad: int) -> torch.Tensor:
        """[B, L, H, D] residual order -> [B, H, L + pad, D] interleaved, zero-padded."""
        t = t[:, interleave].transpose(1, 2)
        return F.pad(t, (0, 0, 0, pad)).contiguous()


class BidirectionalTTT(nn.Module):
    """Forward and reverse TTT passes sharing all parameters, each behind per-modality tanh gates."""

    def __init__(self, dim: int, num_heads: int, gate_init: float = 0.1, **ttt_kwargs):
        super().__init__()
        self.ttt = TTTLayer(dim, num_heads, **ttt_kwargs)
        self.gate_init = gate_init
        self.forward_gate_text = nn.Parameter(torch.full((dim,), gate_init))
        self.forward_gate_video = nn.Parameter(torch.full((dim,), gate_init))
        self.reverse_gate_text = nn.Parameter(torch.full((dim,), gate_init))
        self.reverse_gate_video = nn.Parameter(torch.full((dim,), gate_init))
        # activation checkpointing of each pass (set by the model's checkpointing policy)
        self.checkpoint_forward = False
        self.checkpoint_reverse = False

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.ttt.reset_parameters()
        for gate in (self.forward_gate_text, self.forward_gate_video, self.reverse_gate_text, self.reverse_gate_video):
            gate.fill_(self.gate_init)

    def _pass(self, x: torch.Tensor, layout: VideoLayout, remat: bool) -> torch.Tensor:
        if remat and torch.is_grad_enabled():
            return checkpoint(self.ttt, x, layout, use_reentrant=False)
        return self.ttt(x, layout)

    @staticmethod
    def _gated(y: torch.Tensor, text_gate: torch.Tensor, video_gate: torch.Tensor, text_tokens: int) -> torch.Tensor:
        return torch.cat(
            [torch.tanh(text_gate).to(y.dtype) * y[:, :text_tokens], torch.tanh(video_gate).to(y.dtype) * y[:, text_tokens:]],
            dim=1,
        )

    def forward(self, x: torch.Tensor, layout: VideoLayout) -> torch.Tensor:
        T = layout.total_text_tokens
        z = x + self._gated(self._pass(x, layout, self.checkpoint_forward), self.forward_gate_text,
                            self.forward_gate_video, T)
        reverse = _layout_tensors(layout, self.ttt.head_dim, self.ttt.rope_theta, x.device)[2]
        back = self._pass(z[:, reverse], layout, self.checkpoint_reverse)[:, reverse]
        return z + self._gated(back, self.reverse_gate_text, self.reverse_gate_video, T)
