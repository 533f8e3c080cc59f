"""The TTT layer of the long-video DiT.

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

from tttvideo.config.schema import TTTConfig
from tttvideo.layout import VideoLayout
from tttvideo.rope import apply_rope, rope_cos_sin
from tttvideo.ttt import ops

# eps of the reconstruction-target LayerNorm: the original normalises by (unbiased std + eps).
TARGET_LN_EPS = 1e-8


@lru_cache(maxsize=16)
def _layout_tensors(layout: VideoLayout, head_dim: int, theta: float, device: torch.device):
    """Index maps and RoPE tables of a layout on a device, shared by every layer of the model.

    The RoPE tables are in scan (interleaved) order over all tokens, with the identity rotation (cos 1, sin 0) on
    text tokens, so that one elementwise op rotates a whole scan-order sequence."""
    cos, sin = rope_cos_sin(layout.global_positions, head_dim, theta)
    text = layout.total_text_tokens
    cos = torch.cat([torch.ones(text, head_dim), cos])[layout.interleave_perm]
    sin = torch.cat([torch.zeros(text, head_dim), sin])[layout.interleave_perm]
    return (
        layout.interleave_perm.to(device),
        layout.deinterleave_perm.to(device),
        layout.reverse_perm.to(device),
        cos[:, None, :].to(device),  # [L, 1, D]: broadcast over heads
        sin[:, None, :].to(device),
    )


def scan_inputs(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_w: torch.Tensor,
    norm_b: torch.Tensor,
    pad: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The elementwise glue between the projections and the scan, in one function so that torch.compile can fuse
    it into a few kernels: qkv [B, L, 3, H, D] (scan order) -> [3, B, H, L + pad, D] in `dtype`, zero-padded:
    L2-normalised q/k with RoPE, and v replaced by the reconstruction target LN_ttt(v - k) + k, with the original's
    (unbiased std + eps) normalisation. Math in fp32."""
    q, k, v = qkv.unbind(2)  # fp32 per tensor: no fp32 copy of the whole q/k/v block at once
    q = apply_rope(F.normalize(q.float(), dim=-1), cos, sin)
    k = apply_rope(F.normalize(k.float(), dim=-1), cos, sin)
    d = v.float() - k
    d = (d - d.mean(dim=-1, keepdim=True)) / (d.std(dim=-1, keepdim=True) + TARGET_LN_EPS)
    v = norm_w * d + norm_b + k
    B, L, H, D = q.shape
    # cast, transpose and pad in one write per tensor, never a stacked fp32 copy of all three
    out = q.new_zeros((3, B, H, L + pad, D), dtype=dtype)
    for i, t in enumerate((q, k, v)):
        out[i, :, :, :L] = t.transpose(1, 2)
    return out


_compiled_scan_inputs = None


def _scan_inputs_fn(x: torch.Tensor, compile_glue: bool):
    """torch.compile'd glue on CUDA (one-time compile per layout shape); plain eager elsewhere."""
    global _compiled_scan_inputs
    if not (compile_glue and x.is_cuda):
        return scan_inputs
    if _compiled_scan_inputs is None:
        _compiled_scan_inputs = torch.compile(scan_inputs, dynamic=False)
    return _compiled_scan_inputs


MLP_EXPANSION = 4  # TTT-MLP hidden size = 4 x head dim (64 -> 256), as in the original


def inner_hidden(kind: str, head_dim: int, mlp_expansion: int = MLP_EXPANSION) -> int:
    """Width of the inner model's weight W1 (head_dim x hidden): the MLP's hidden size, or head_dim for Linear."""
    return mlp_expansion * head_dim if kind == "mlp" else head_dim


class TTTLayer(nn.Module):
    """One TTT pass over the whole sequence. Its settings come from a TTTConfig, except the mini-batch size, which
    belongs to the layout the layer is called with (the layout pads the sequence to it, and the inner learning rate
    divides by it): `VideoLayout.from_config` reads `ttt.mini_batch_size`, nothing else does."""

    def __init__(self, dim: int, num_heads: int, config: TTTConfig | None = None, mlp_expansion: int = MLP_EXPANSION):
        super().__init__()
        config = config if config is not None else TTTConfig()
        if dim % num_heads:
            raise ValueError(f"width {dim} is not divisible by {num_heads} heads")
        if config.kind not in ("mlp", "linear"):
            raise ValueError(f"TTT kind must be 'mlp' or 'linear', got {config.kind!r}")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.kind = config.kind
        self.base_lr = config.base_lr
        self.scan_checkpoint_group_size = config.scan_checkpoint_group_size
        self.rope_theta = config.rope_theta
        # backend and compile_glue may be switched on a built layer (benchmarks compare them)
        self.backend = config.backend
        self.compile_glue = config.compile_glue

        H, D = num_heads, self.head_dim
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=True) for _ in range(4))
        # eta gate: one linear map of the full hidden state per head
        self.learnable_ttt_lr_weight = nn.Parameter(torch.empty(H, dim))
        self.learnable_ttt_lr_bias = nn.Parameter(torch.empty(H))
        self.ttt_norm_weight = nn.Parameter(torch.empty(H, D))
        self.ttt_norm_bias = nn.Parameter(torch.empty(H, D))
        self.post_norm = nn.LayerNorm(dim, eps=1e-6)
        hidden = inner_hidden(self.kind, D, mlp_expansion)
        self.W1 = nn.Parameter(torch.empty(H, D, hidden))
        self.b1 = nn.Parameter(torch.empty(H, hidden))
        if self.kind == "mlp":
            self.W2 = nn.Parameter(torch.empty(H, hidden, D))
            self.b2 = nn.Parameter(torch.empty(H, D))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """As the original initialises them: projections and inner weights N(0, 0.02), biases 0, ttt_norm identity."""
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

    def eta(self, x: torch.Tensor, mini_batch_size: int) -> torch.Tensor:
        """Per-token, per-head inner learning rate [B, L, H]: base_lr * sigmoid(theta_h . x + b_h) / D / b."""
        gate = F.linear(x, self.learnable_ttt_lr_weight.to(x.dtype), self.learnable_ttt_lr_bias.to(x.dtype))
        return self.base_lr * torch.sigmoid(gate.float()) / (self.head_dim * mini_batch_size)

    def forward(self, x: torch.Tensor, layout: VideoLayout) -> torch.Tensor:
        B, L, C = x.shape
        layout.check_sequence_length(L)
        H, D = self.num_heads, self.head_dim
        interleave, deinterleave, _, cos, sin = _layout_tensors(layout, D, self.rope_theta, x.device)
        pad = layout.ttt_padding

        # Everything runs in scan order: one gather of x replaces a gather of each of q, k, v and eta, and all
        # per-token ops commute with the permutation.
        xs = x[:, interleave]
        w_qkv = torch.cat([self.wq.weight, self.wk.weight, self.wv.weight])
        b_qkv = torch.cat([self.wq.bias, self.wk.bias, self.wv.bias])
        qkv = F.linear(xs, w_qkv, b_qkv).view(B, L, 3, H, D)
        q, k, v = _scan_inputs_fn(x, self.compile_glue)(
            qkv, cos, sin, self.ttt_norm_weight, self.ttt_norm_bias, pad, x.dtype
        )
        eta = F.pad(self.eta(xs, layout.mini_batch_size).transpose(1, 2), (0, pad))  # padded tokens: eta = 0, no update

        scan = ops.ttt_mlp if self.kind == "mlp" else ops.ttt_linear
        out = scan(
            q, k, v, eta, self.ttt_norm_weight, self.ttt_norm_bias, *self.inner_params(),
            mini_batch_size=layout.mini_batch_size,
            checkpoint_group_size=self.scan_checkpoint_group_size,
            backend=self.backend,
        )
        out = out[:, :, :L].transpose(1, 2).reshape(B, L, C).to(x.dtype)
        out = self.wo(self.post_norm(out))
        return out[:, deinterleave]


class BidirectionalTTT(nn.Module):
    """Forward and reverse TTT passes sharing all parameters, each behind per-modality tanh gates."""

    def __init__(self, dim: int, num_heads: int, config: TTTConfig | None = None):
        super().__init__()
        config = config if config is not None else TTTConfig()
        self.ttt = TTTLayer(dim, num_heads, config)
        gate_init = self.gate_init = config.gate_init
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
