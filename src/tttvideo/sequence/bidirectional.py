"""The gated bidirectional wrapper every long-range layer runs in, as the paper runs TTT:

    Z  = X + tanh(alpha) * f(X)                 (f: one pass over the sequence in scan order)
    Z' = Z + tanh(beta) * f_reverse(Z)          (the same parameters over the reversed scan order)

with separate per-channel gates for text and video tokens. Scan order is the layout's interleave: each 3-s
segment's text, then its video, segment after segment (`VideoLayout.interleave_perm`); the reverse pass walks the
reversed sequence in the same interleave (`reverse_interleave_perm`). A layer that sees the whole sequence at once
(full attention) runs one pass."""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tttvideo.device import compiled_on_cuda
from tttvideo.layout import VideoLayout
from tttvideo.sequence.chunks import ChunkPlan

if TYPE_CHECKING:
    from tttvideo.parallel.sequence import SequenceParallel


@lru_cache(maxsize=16)
def scan_permutations(layout: VideoLayout, device: torch.device, reverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual -> scan order gather, scan -> residual order gather) of one direction, on `device`."""
    if reverse:
        return layout.reverse_interleave_perm.to(device), layout.reverse_deinterleave_perm.to(device)
    return layout.interleave_perm.to(device), layout.deinterleave_perm.to(device)


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[:, index] for x [B, L, ...]. With B > 1 it is one gather of rows of the flattened [B * L, ...] tensor:
    torch indexes dim 1 behind a batch dim with a generic kernel about 7x slower than its row gather (H100, B = 2,
    18,048 tokens of 3,072 bf16: 0.55 ms against 0.08 ms at B = 1)."""
    B = x.shape[0]
    if B == 1:
        return x[:, index]
    rows = index[None, :] + torch.arange(0, B * x.shape[1], x.shape[1], device=index.device)[:, None]
    return x.flatten(0, 1)[rows.flatten()].unflatten(0, (B, index.numel()))


def gated(y: torch.Tensor, text_gate: torch.Tensor, video_gate: torch.Tensor, text_tokens: int) -> torch.Tensor:
    """tanh(gate) * y with the text gate on the first `text_tokens` tokens and the video gate on the rest."""
    return torch.cat([torch.tanh(text_gate).to(y.dtype) * y[:, :text_tokens],
                      torch.tanh(video_gate).to(y.dtype) * y[:, text_tokens:]], dim=1)


def gated_add(x: torch.Tensor, y: torch.Tensor, text_tokens: int, text_gate: torch.Tensor,
              video_gate: torch.Tensor) -> torch.Tensor:
    """x + gate * y with gates [B, C] (or [1, C]) per modality: the text gate on the first `text_tokens` tokens, the
    video gate on the rest. One rounding per element (addcmul); compiled (`compiled_on_cuda`), one pass over the
    stream."""
    return torch.cat(
        [
            torch.addcmul(x[:, :text_tokens], y[:, :text_tokens], text_gate[:, None]),
            torch.addcmul(x[:, text_tokens:], y[:, text_tokens:], video_gate[:, None]),
        ],
        dim=1,
    )


class GatedBidirectional(nn.Module):
    """A long-range layer `inner` (forward(x, layout, reverse, sp) -> same shape, residual order) behind the gates.

    The inner layer is the attribute `ttt` whatever it is, so that the trainer's parameter groups (the long-range
    layer's learning rate) and checkpoints name every kind the same way."""

    def __init__(self, inner: nn.Module, dim: int, gate_init: float, bidirectional: bool = True):
        super().__init__()
        self.ttt = inner
        self.gate_init = gate_init
        self.bidirectional = bidirectional
        self.forward_gate_text = nn.Parameter(torch.full((dim,), gate_init))
        self.forward_gate_video = nn.Parameter(torch.full((dim,), gate_init))
        if bidirectional:
            self.reverse_gate_text = nn.Parameter(torch.full((dim,), gate_init))
            self.reverse_gate_video = nn.Parameter(torch.full((dim,), gate_init))
        # activation checkpointing of each pass (set by the model's checkpointing policy)
        self.checkpoint_forward = False
        self.checkpoint_reverse = False

    def gates(self) -> list[nn.Parameter]:
        both = [self.forward_gate_text, self.forward_gate_video]
        return both + [self.reverse_gate_text, self.reverse_gate_video] if self.bidirectional else both

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.ttt.reset_parameters()
        for gate in self.gates():
            gate.fill_(self.gate_init)

    def _pass(self, x: torch.Tensor, layout: VideoLayout, reverse: bool, remat: bool,
              sp: SequenceParallel | None) -> torch.Tensor:
        if remat and torch.is_grad_enabled():
            return checkpoint(self.ttt, x, layout, reverse, sp, use_reentrant=False)
        return self.ttt(x, layout, reverse, sp)

    @property
    def has_chunked_forward(self) -> bool:
        return callable(getattr(self.ttt, "chunked_pass_", None))

    def chunked_forward_(self, x: torch.Tensor, layout: VideoLayout, plan: ChunkPlan) -> None:
        """`forward` without gradients and without sequence parallelism, in place on x and in bounded memory: each
        pass is the inner layer's `chunked_pass_(x, layout, plan, reverse, (text gate, video gate))`."""
        if not self.has_chunked_forward:
            raise TypeError(f"{type(self.ttt).__name__} has no chunked forward (chunked_pass_)")
        self.ttt.chunked_pass_(x, layout, plan, False, (self.forward_gate_text, self.forward_gate_video))
        if self.bidirectional:
            self.ttt.chunked_pass_(x, layout, plan, True, (self.reverse_gate_text, self.reverse_gate_video))

    def forward(self, x: torch.Tensor, layout: VideoLayout, sp: SequenceParallel | None = None) -> torch.Tensor:
        """x [B, L, C] in residual order (with `sp`: this rank's shard [B, L / sp, C]) -> the same shape."""
        T = layout.total_text_tokens if sp is None else sp.text_tokens(layout)
        z = self._gated_residual(x, self._pass(x, layout, False, self.checkpoint_forward, sp), T,
                                 self.forward_gate_text, self.forward_gate_video)
        if not self.bidirectional:
            return z
        back = self._pass(z, layout, True, self.checkpoint_reverse, sp)
        return self._gated_residual(z, back, T, self.reverse_gate_text, self.reverse_gate_video)

    def _gated_residual(self, x: torch.Tensor, y: torch.Tensor, text_tokens: int, text_gate: torch.Tensor,
                        video_gate: torch.Tensor) -> torch.Tensor:
        """x + tanh(gate) * y (`gated_add`), compiled where the inner layer compiles its glue (`compile_glue`): one
        pass over the stream (eager: the two modalities' addcmul, then their concatenation)."""
        gates = (torch.tanh(g).to(y.dtype)[None] for g in (text_gate, video_gate))
        return compiled_on_cuda(gated_add, x, getattr(self.ttt, "compile_glue", False))(x, y, text_tokens, *gates)
