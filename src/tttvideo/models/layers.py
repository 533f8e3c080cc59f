"""Layers both backbones build from: the timestep embedding, the feed-forward MLP, and the token-chunked form of a
token-wise function that training uses to bound the MLP's working set.

Numerics of the embedding follow diffusers' `get_timestep_embedding` (fp32 sinusoid, `flip_sin_to_cos`,
`downscale_freq_shift`) and `TimestepEmbedding` (linear - SiLU - linear); the MLP is linear - GELU-tanh - linear, as
CogVideoX's (4x the width) and Wan's (8960 for 1536) feed-forward layers are.

`token_chunked` (`checkpointing.ffn_chunk_tokens`) runs a function that works token by token over chunks of the
stream, each chunk under its own non-reentrant checkpoint: forward keeps none of a chunk's intermediates (the MLP's
hidden layer, the GELU input it would save for backward, fp32 upcasts), and backward recomputes one chunk at a time,
so at most one chunk's hidden layer (chunk x hidden) exists at once instead of the whole video's (at 63 s, Wan's
394,680 x 8960 bf16 hidden layer is 6.6 GiB, twice with the GELU input). The cost is one more forward of the chunked
function in backward (inside a checkpointed block it runs three times instead of two). The gradients are those of
the plain function (tests/test_ffn_chunks.py): each token's rows go through the same operators.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def timestep_sinusoid(timesteps: torch.Tensor, dim: int, flip_sin_to_cos: bool = True, freq_shift: float = 0.0,
                      max_period: float = 10000.0) -> torch.Tensor:
    """[B] (possibly fractional) timesteps -> [B, dim] fp32 sinusoidal features ([cos | sin] if flipped)."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device)
    freqs = torch.exp(exponent / (half - freq_shift))
    angles = timesteps[:, None].float() * freqs[None, :]
    parts = [torch.cos(angles), torch.sin(angles)]
    emb = torch.cat(parts if flip_sin_to_cos else parts[::-1], dim=-1)
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


def token_chunked(fn: Callable[..., torch.Tensor], x: torch.Tensor, chunk_tokens: int, *args: Any) -> torch.Tensor:
    """fn(x, *args) for a token-wise `fn` of x [B, L, ...] -> [B, L, ...]: with gradients on and 0 < chunk_tokens < L,
    fn runs on chunks of `chunk_tokens` tokens, each checkpointed (recomputed in its own backward), and the chunks'
    outputs are concatenated; otherwise fn(x, *args) as it is. `args` (modulation vectors, gates) are shared by
    every chunk."""
    L = x.shape[1]
    if chunk_tokens <= 0 or chunk_tokens >= L or not torch.is_grad_enabled():
        return fn(x, *args)
    # split, not a slice per chunk: backward joins the chunks' gradients of x once (one [B, L, ...] tensor) instead
    # of widening each chunk's to the whole x and summing
    return torch.cat([checkpoint(fn, rows, *args, use_reentrant=False) for rows in x.split(chunk_tokens, dim=1)],
                     dim=1)


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x W^T + b) for x [..., in] as one cuBLASLt product whose epilogue adds the bias and applies the GELU
    (its tanh form, as `F.gelu(approximate="tanh")`): the hidden layer is written once instead of written, read and
    written again by a separate GELU (at 63 s a guided step's 2 x 351,168 x 12,288 bf16 hidden layer is 16 GiB a
    block). No autograd formula: for forwards without gradients (`gelu_in_epilogue`). Off CUDA the two ops, since
    the CPU's `_addmm_activation` takes the erf GELU."""
    if not x.is_cuda:
        return F.gelu(F.linear(x, weight, bias), approximate="tanh")
    out = torch._addmm_activation(bias, x.reshape(-1, x.shape[-1]), weight.t(), use_gelu=True)
    return out.view(*x.shape[:-1], weight.shape[0])


def gelu_in_epilogue(fc1: nn.Module, x: torch.Tensor) -> bool:
    """Whether `MLP.dense` runs its first product with the GELU in the product's epilogue (`linear_gelu`): no
    gradients, on CUDA, a plain nn.Linear with a bias (not an adapter's or an fp8 layer) in x's half dtype, no
    autocast (which would cast F.linear's operands but not these)."""
    return (not torch.is_grad_enabled() and x.is_cuda and type(fc1) is nn.Linear and fc1.bias is not None
            and x.dtype in (torch.bfloat16, torch.float16) and fc1.weight.dtype == x.dtype
            and not torch.is_autocast_enabled("cuda"))


class MLP(nn.Module):
    """linear -> GELU-tanh -> linear. With `chunk_tokens` (checkpointing.ffn_chunk_tokens, set by
    `models.checkpointing.apply_checkpointing`) training runs it over token chunks (`token_chunked`)."""

    def __init__(self, dim: int, hidden: int, bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)
        self.chunk_tokens = 0

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP on every token at once."""
        if gelu_in_epilogue(self.fc1, x):
            return self.fc2(linear_gelu(x, self.fc1.weight, self.fc1.bias))
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return token_chunked(self.dense, x, self.chunk_tokens)
