"""One transformer block of the long-video DiT: CogVideoX's adaLN-zero block with the TTT layer after attention.

    h  = adaLN1(x)                         (one LayerNorm, separate shift/scale for text and video tokens)
    X' = LocalAttention(h)                 (the attention OUTPUT, after the o projection)
    Z' = BidirectionalTTT(X')              (Z = X' + tanh(a) TTT(X'), Z' = Z + tanh(b) rev(TTT(rev(Z))))
    x  = x + gate_msa * Z'                 (text gate on text tokens, video gate on video tokens)
    x  = x + gate_ff * MLP(adaLN2(x))      (GELU-tanh, 4x)

With the TTT gates at 0 (or `use_ttt=False`) this is diffusers' `CogVideoXBlock` on a single window. The residual
stream is one tensor in the order [all text | all video]; the modulation is applied to its two parts in place of
diffusers' split/concat of two streams. With sequence parallelism the block gets this rank's shard of the stream,
whose text part is the first `SequenceParallel.text_tokens` tokens (possibly none); attention and TTT exchange
what they need themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tttvideo.config.schema import TTTConfig
from tttvideo.device import compiled_on_cuda
from tttvideo.layout import VideoLayout
from tttvideo.models.attention import LocalAttention
from tttvideo.models.checkpointing import long_range_layer, maybe_checkpoint
from tttvideo.models.layers import MLP
from tttvideo.models.cogvideox.presets import ModelSpec
from tttvideo.sequence.bidirectional import gated_add
from tttvideo.sequence.build import sequence_layer
from tttvideo.sequence.chunks import ChunkPlan, modal_chunks

if TYPE_CHECKING:  # the parallel package imports torch.distributed; the block needs it only when given a group
    from tttvideo.parallel.sequence import SequenceParallel


def modulate(h: torch.Tensor, text_tokens: int, text: tuple[torch.Tensor, torch.Tensor],
             video: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """h * (1 + scale) + shift with (shift, scale) [B, C] per modality."""
    t_shift, t_scale = text
    v_shift, v_scale = video
    return torch.cat(
        [
            torch.addcmul(t_shift[:, None], h[:, :text_tokens], 1 + t_scale[:, None]),
            torch.addcmul(v_shift[:, None], h[:, text_tokens:], 1 + v_scale[:, None]),
        ],
        dim=1,
    )


def norm_modulate(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                  text_tokens: int, text: tuple[torch.Tensor, torch.Tensor],
                  video: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """LayerNorm then `modulate`: one function so that torch.compile writes the result once (eager: the norm, two
    modulations and the concatenation each write the whole stream)."""
    return modulate(F.layer_norm(x, (x.shape[-1],), weight, bias, eps), text_tokens, text, video)


class AdaLNZero(nn.Module):
    """diffusers' CogVideoXLayerNormZero: Linear(SiLU(temb)) -> shift, scale, gate (video), then the same for text."""

    def __init__(self, time_embed_dim: int, dim: int, eps: float, elementwise_affine: bool):
        super().__init__()
        self.linear = nn.Linear(time_embed_dim, 6 * dim)
        self.norm = nn.LayerNorm(dim, eps=eps, elementwise_affine=elementwise_affine)
        self.compile_glue = False  # model.compile_block_glue, set by the model builder

    def forward(self, x: torch.Tensor, temb_act: torch.Tensor, text_tokens: int, compile_glue: bool | None = None):
        """temb_act = SiLU(time embedding) [B, time_dim] -> (modulated x, video gate [B, C], text gate [B, C]).
        compile_glue: False for callers whose shapes vary from call to call (each shape would be a compile)."""
        shift, scale, gate, t_shift, t_scale, t_gate = self.linear(temb_act).chunk(6, dim=1)
        compile_glue = self.compile_glue if compile_glue is None else compile_glue
        h = compiled_on_cuda(norm_modulate, x, compile_glue)(
            x, self.norm.weight, self.norm.bias, self.norm.eps, text_tokens, (t_shift, t_scale), (shift, scale))
        return h, gate, t_gate

    def gates(self, temb_act: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(video gate, text gate) [B, C] alone, for a caller that modulates elsewhere."""
        chunks = self.linear(temb_act).chunk(6, dim=1)
        return chunks[2], chunks[5]


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, ttt: TTTConfig | None, kind: str = "ttt"):
        """ttt: the TTT layer's settings; None builds the attention-only block. kind: the long-range layer
        (`tttvideo.sequence.build.SEQUENCE_LAYERS`), TTT unless a baseline is asked for."""
        super().__init__()
        dim = spec.dim
        self.norm1 = AdaLNZero(spec.time_embed_dim, dim, spec.norm_eps, spec.norm_elementwise_affine)
        self.attn = LocalAttention(dim, spec.num_attention_heads, spec.attention_head_dim, bias=spec.attention_bias,
                                   qk_norm_eps=spec.qk_norm_eps, norm_elementwise_affine=spec.norm_elementwise_affine,
                                   rope_theta=spec.rope_theta)
        # the long-range layer, TTT or a baseline, is `ttt` whatever its kind (parameter names, the trainer's groups)
        self.ttt = sequence_layer(kind if ttt is not None else "none", dim, spec.num_attention_heads, ttt,
                                  spec.rope_theta)
        self.norm2 = AdaLNZero(spec.time_embed_dim, dim, spec.norm_eps, spec.norm_elementwise_affine)
        self.mlp = MLP(dim, 4 * dim)
        # activation checkpointing of the two halves (set by tttvideo.models.checkpointing.apply_checkpointing);
        # the TTT passes have their own switches on self.ttt
        self.checkpoint_attention = False
        self.checkpoint_mlp = False
        self.checkpoint_keep: tuple[str, ...] = ()  # checkpointing.keep: outputs the checkpoints above save
        # bounded-memory forward without gradients (memory.chunked_inference, set by build_model); None: plain
        self.inference_chunks: ChunkPlan | None = None
        self.compile_glue = False  # model.compile_block_glue: the gated residual adds (and the adaLN norms)

    def _attention(self, x: torch.Tensor, temb_act: torch.Tensor, layout: VideoLayout, text_tokens: int,
                   sp: SequenceParallel | None):
        h, gate, t_gate = self.norm1(x, temb_act, text_tokens)
        return self.attn(h, layout, sp), gate, t_gate

    def _mlp(self, x: torch.Tensor, temb_act: torch.Tensor, text_tokens: int) -> torch.Tensor:
        h, gate, t_gate = self.norm2(x, temb_act, text_tokens)
        return compiled_on_cuda(gated_add, x, self.compile_glue)(x, self.mlp(h), text_tokens, t_gate, gate)

    def forward(self, x: torch.Tensor, temb_act: torch.Tensor, layout: VideoLayout,
                sp: SequenceParallel | None = None) -> torch.Tensor:
        """x: the residual stream [B, L, dim], or with `sp` this rank's shard of it [B, L / sp, dim]. Without
        gradients and with `inference_chunks` set (one process), x is updated in place and returned."""
        if self.inference_chunks is not None and sp is None and not torch.is_grad_enabled():
            return self.chunked_forward(x, temb_act, layout, self.inference_chunks)
        T = layout.total_text_tokens if sp is None else sp.text_tokens(layout)
        a, gate, t_gate = maybe_checkpoint(self._attention, self.checkpoint_attention, x, temb_act, layout, T, sp,
                                           keep=self.checkpoint_keep)
        if self.ttt is not None:
            with long_range_layer():
                a = self.ttt(a, layout, sp)
        x = compiled_on_cuda(gated_add, x, self.compile_glue)(x, a, T, t_gate, gate)
        return maybe_checkpoint(self._mlp, self.checkpoint_mlp, x, temb_act, T, keep=self.checkpoint_keep)

    @torch.no_grad()
    def chunked_forward(self, x: torch.Tensor, temb_act: torch.Tensor, layout: VideoLayout,
                        plan: ChunkPlan) -> torch.Tensor:
        """`forward` without gradients and without sequence parallelism, in bounded memory
        (`tttvideo.models.chunked_inference`); x [B, L, C] is updated in place and returned. The adaLN layers run
        per window or chunk (their modulation linear is a [B, 6C] vector: recomputing it is free)."""
        T = layout.total_text_tokens
        # eager adaLN: the windows' and chunks' shapes vary
        a = self.attn.chunked_forward(
            x, lambda h: self.norm1(h, temb_act, layout.stream_text_tokens, compile_glue=False)[0], layout, plan)
        if self.ttt is not None:
            self.ttt.chunked_forward_(a, layout, plan)
        gate, t_gate = self.norm1.gates(temb_act)
        x[:, :T].addcmul_(a[:, :T], t_gate[:, None])
        x[:, T:].addcmul_(a[:, T:], gate[:, None])
        del a
        for s, e, is_text in modal_chunks(x.shape[1], T, plan.tokens):
            h, gate, t_gate = self.norm2(x[:, s:e], temb_act, e - s if is_text else 0, compile_glue=False)
            x[:, s:e].addcmul_(self.mlp(h), (t_gate if is_text else gate)[:, None])
        return x
