"""One block of the long-video Wan model: Wan2.1's block with the TTT layer after self-attention.

    (shift, scale, gate, c_shift, c_scale, c_gate) = table + time projection     (fp32, one 6-way table per block)
    X' = WindowSelfAttention(LN(x) (1 + scale) + shift)     (the attention OUTPUT, segment-local 3-s windows)
    Z' = BidirectionalTTT(X')                               (the whole video's tokens in frame order, both ways)
    x  = x + gate * Z'
    x  = x + SegmentCrossAttention(LN_affine(x), text)      (each window's tokens to its segment's text, no gate)
    x  = x + c_gate * FFN(LN(x) (1 + c_scale) + c_shift)    (GELU-tanh)

The LayerNorms (no affine, eps 1e-6) and the modulation run in fp32 and the stream is cast back, as diffusers'
`WanTransformerBlock` does; with the TTT gates at 0 (or no TTT) and one segment the block is exactly that block.
The TTT layer sees video tokens only: Wan's text is not in the residual stream but cross-attended, so the scan has
no text chunks and the TTT layer's text gates touch no token.

In training with the memory switches on (`checkpointing.attention_by_window`, `ttt_chunk_tokens`) the same block
holds few stream-sized tensors at once (docs/wan.md, "Memory techniques and configs"): each window's attention is
projected inside its checkpoint and merged into one stream; the TTT passes run as `TTTLayer.gated_pass` with their
gates, residuals and the gated add folded into their chunks; the attention and the forward pass share a
checkpoint.

`chunked_forward` is the same block without gradients in bounded memory (`memory.chunked_inference`, as for
CogVideoX: `tttvideo.models.chunked_inference`): both attentions one window at a time into one accumulator, the
TTT passes' chunked form, the output projections, gated adds and the FFN (whose hidden layer is 5.8x the width)
over token chunks, in place on the residual stream.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tttvideo import initializers as init
from tttvideo.config.schema import TTTConfig
from tttvideo.layout import VideoLayout
from tttvideo.models.attention import add_window
from tttvideo.models.checkpointing import long_range_layer, maybe_checkpoint
from tttvideo.models.layers import MLP, token_chunked
from tttvideo.models.wan.attention import (SegmentCrossAttention, WindowSelfAttention, window_gather, window_indices,
                                           window_rope)
from tttvideo.models.wan.spec import WanSpec
from tttvideo.sequence.build import sequence_layer
from tttvideo.sequence.chunks import ChunkPlan, token_chunks
from tttvideo.ttt.layer import TTTLayer


class ModulationTable(nn.Module):
    """The learned per-block offsets added to the time projection: `rows` vectors of width dim (diffusers'
    `scale_shift_table`, initialised as there: N(0, 1) / sqrt(dim))."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.table = nn.Parameter(torch.empty(1, rows, dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        init.normal_(self.table).div_(self.table.shape[-1] ** 0.5)

    def forward(self, projection: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """projection [B, rows, dim] -> rows tensors [B, 1, dim] in fp32."""
        return (self.table.float() + projection.float()).chunk(self.table.shape[1], dim=1)


def norm_modulate(x: torch.Tensor, eps: float, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """LayerNorm without affine in fp32, then x (1 + scale) + shift, back in x's dtype."""
    h = F.layer_norm(x.float(), (x.shape[-1],), eps=eps)
    return torch.addcmul(shift, h, 1 + scale).to(x.dtype)


# tokens per piece of `gated_add`: its fp32 temporaries exist for this many tokens at a time
GATED_ADD_TOKENS = 32768


def gated_add(x: torch.Tensor, a: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """(x + a * gate) in fp32, back in x's dtype, over pieces of GATED_ADD_TOKENS tokens when gradients are on: the
    same values (elementwise), but the fp32 copies of x, of a * gate and of their sum (three fp32 streams, 6.8 GiB at
    63 s) exist for one piece at a time. Nothing is recomputed: each piece saves only views of a and the gate."""
    if not torch.is_grad_enabled() or x.shape[1] <= GATED_ADD_TOKENS:
        return (x.float() + a * gate).to(x.dtype)
    return torch.cat([(xs.float() + as_ * gate).to(x.dtype) for xs, as_ in
                      zip(x.split(GATED_ADD_TOKENS, dim=1), a.split(GATED_ADD_TOKENS, dim=1))], dim=1)


def window_pieces(layout: VideoLayout) -> tuple[list[int], list[tuple[int, int]]]:
    """The stream cut at every window's edges: the pieces' token counts, and each window's [first, last) pieces.
    Wan's windows are contiguous runs of frames (no text in the stream), consecutive ones sharing a frame."""
    spans = [layout.frames_slice(layout.segment_frames(i)) for i in range(layout.num_segments)]
    cuts = sorted({0, layout.total_tokens} | {s.start for s in spans} | {s.stop for s in spans})
    return [b - a for a, b in zip(cuts, cuts[1:])], [(cuts.index(s.start), cuts.index(s.stop)) for s in spans]


def _joined_window(window_fn, i: int, count: int, *pieces_and_args: torch.Tensor) -> torch.Tensor:
    """window_fn(h, i, *args) on window i's tokens h, joined from its `count` pieces."""
    pieces, args = pieces_and_args[:count], pieces_and_args[count:]
    h = torch.cat(pieces, dim=1) if count > 1 else pieces[0]
    return window_fn(h, i, *args)


class WanBlock(nn.Module):
    def __init__(self, spec: WanSpec, ttt: TTTConfig | None, kind: str = "ttt"):
        """ttt: the TTT layer's settings, None for the attention-only block; kind: the long-range layer
        (`tttvideo.sequence.build.SEQUENCE_LAYERS`)."""
        super().__init__()
        dim = spec.dim
        self.eps = spec.eps
        self.modulation = ModulationTable(6, dim)
        # `attn` is self-attention, so that the adapters' attention group and LoRA targets find it by that name
        self.attn = WindowSelfAttention(dim, spec.num_attention_heads, spec.eps, spec.rope_theta)
        self.ttt = sequence_layer(kind if ttt is not None else "none", dim, spec.ttt_heads, ttt, spec.rope_theta)
        self.cross_norm = nn.LayerNorm(dim, eps=spec.eps) if spec.cross_attn_norm else None
        self.cross_attn = SegmentCrossAttention(dim, spec.num_attention_heads, spec.eps)
        self.ffn = MLP(dim, spec.ffn_dim)
        # the switches `tttvideo.models.checkpointing.apply_checkpointing` sets: the self-attention half, and the
        # cross-attention + FFN half; the TTT passes have their own on self.ttt
        self.checkpoint_attention = False
        self.checkpoint_mlp = False
        self.checkpoint_keep: tuple[str, ...] = ()
        # checkpointing.attention_by_window: both attentions one window at a time in training, each window
        # checkpointed on its own (`_by_window`)
        self.attention_by_window = False
        # bounded-memory forward without gradients (memory.chunked_inference, set by build_model); None: plain
        self.inference_chunks: ChunkPlan | None = None

    def _windowed(self) -> bool:
        return self.attention_by_window and torch.is_grad_enabled()

    @staticmethod
    def _by_window(window_fn, x: torch.Tensor, layout: VideoLayout, *args) -> torch.Tensor:
        """The windows' outputs `window_fn(h, i, *args)` [B, W, C] of each window's tokens h, summed into their
        stream positions and averaged over the windows sharing a frame, as `merge_windows` does for the windows
        attended at once. Each window runs under its own checkpoint that saves only its pieces of x (views of x,
        alive anyway): what a window makes (its adaLN input, q/k/v, their fp32 norms and RoPE, the attention
        output) exists for one window at a time, in forward and in the backward recompute. x is split at the
        windows' edges and each window joins its pieces, rather than gathering its tokens from x: backward then
        joins the pieces' gradients once, where a gather's backward scatters every window's gradient into a
        stream-sized zero tensor."""
        n = layout.num_segments
        sizes, spans = window_pieces(layout)
        pieces = x.split(sizes, dim=1)
        acc = None
        batch = torch.arange(x.shape[0], device=x.device)[:, None]
        for i, (index, (first, last)) in enumerate(zip(window_indices(layout, x.device), spans)):
            out = checkpoint(_joined_window, window_fn, i, last - first, *pieces[first:last], *args,
                             use_reentrant=False)
            if acc is None:
                acc = out.new_zeros(x.shape[0], x.shape[1], out.shape[-1])
            # index_put_, not index_add_: its backward keeps the index only, index_add_'s the window's output too
            acc = acc.index_put_((batch, index[None, :]), out, accumulate=True)
        if n > 1:
            # in place: neither the accumulation's backward nor the product's needs acc's values
            acc = acc.mul_(window_gather(layout, x.device)[1].to(acc.dtype))
        return acc

    def _self_attention_window(self, h: torch.Tensor, i: int, shift: torch.Tensor, scale: torch.Tensor,
                               cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """One window's self-attention output, projected: the merge of the windows' projected outputs is the
        projection of their merge (the shared frames' weights sum to 1), so the merged stream is the attention
        output itself and no unprojected stream-sized copy is kept for the projection's backward."""
        return self.attn.to_out(self.attn.window_forward(norm_modulate(h, self.eps, shift, scale), cos, sin))

    def _cross_attention_window(self, h: torch.Tensor, i: int, text: torch.Tensor) -> torch.Tensor:
        return self.cross_attn.to_out(self.cross_attn.window_forward(self._cross_norm(h), text[:, i]))

    def _cross_norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.cross_norm is None:
            return x
        return F.layer_norm(x.float(), (x.shape[-1],), self.cross_norm.weight.float(), self.cross_norm.bias.float(),
                            self.eps).to(x.dtype)

    def _self_attention(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                        layout: VideoLayout) -> torch.Tensor:
        if self._windowed():
            cos, sin = window_rope(layout, self.attn.head_dim, self.attn.rope_theta, x.device)
            return self._by_window(self._self_attention_window, x, layout, shift, scale, cos, sin)
        return self.attn(norm_modulate(x, self.eps, shift, scale), layout)

    def _cross_and_ffn(self, x: torch.Tensor, text: torch.Tensor, layout: VideoLayout, shift: torch.Tensor,
                       scale: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self._windowed():
            if text.shape[1] != layout.num_segments:
                layout.check_text_embeddings(text.shape[1])
            x = x + self._by_window(self._cross_attention_window, x, layout, text)
        else:
            x = x + self.cross_attn(self._cross_norm(x), text, layout)
        # checkpointing.ffn_chunk_tokens: the whole token-wise tail over chunks, so that neither the hidden layer nor
        # the tail's fp32 copies of the stream exist for the whole video at once
        return token_chunked(self._ffn_residual, x, self.ffn.chunk_tokens, shift, scale, gate)

    def _ffn_residual(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                      gate: torch.Tensor) -> torch.Tensor:
        """x + gate * FFN(LN(x) (1 + scale) + shift): token by token."""
        y = self.ffn.dense(norm_modulate(x, self.eps, shift, scale))
        return (x.float() + y.float() * gate).to(x.dtype)

    def _gated_pass_layer(self, x: torch.Tensor, layout: VideoLayout) -> TTTLayer | None:
        """The TTT layer when training runs its passes as `TTTLayer.gated_pass` (its chunked form on, no text in
        the stream), else None."""
        inner = getattr(self.ttt, "ttt", None)
        return inner if isinstance(inner, TTTLayer) and inner.uses_gated_pass(layout, x.shape[1]) else None

    def _attention_and_forward_pass(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                                    layout: VideoLayout) -> torch.Tensor:
        """Z = X' + tanh(alpha) TTT(X') with X' the self-attention output (the forward pass alone without the
        reverse one: Z = X' + gated TTT, then the caller's gated add)."""
        ttt = self.ttt
        a = self._self_attention(x, shift, scale, layout)
        with long_range_layer():
            return ttt.ttt.gated_pass(a, layout, False, (ttt.forward_gate_text, ttt.forward_gate_video))

    def _self_attention_and_ttt(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, gate: torch.Tensor,
                                layout: VideoLayout) -> torch.Tensor:
        """x + gate * BidirectionalTTT(SelfAttention(x)), each part under its checkpointing switch.

        In training with the TTT layer's chunked form (`ttt_chunk_tokens`) each pass is `TTTLayer.gated_pass`,
        its gate and residual folded in, and the block's gated add folded into the last pass: neither pass's
        output, its gated copy nor Z' is made whole or saved for the gates' gradients. With the attention and the
        forward pass both checkpointed they share one checkpoint (each was recomputed once in backward, and still
        is), so that what the block keeps between its parts is the reverse pass's input and the cross-attention's
        input, not the attention output as well."""
        inner = self._gated_pass_layer(x, layout)
        ttt = self.ttt
        if inner is not None and ttt.bidirectional and self.checkpoint_attention and ttt.checkpoint_forward:
            z = maybe_checkpoint(self._attention_and_forward_pass, True, x, shift, scale, layout,
                                 keep=self.checkpoint_keep)
        else:
            a = maybe_checkpoint(self._self_attention, self.checkpoint_attention, x, shift, scale, layout,
                                 keep=self.checkpoint_keep)
            if inner is None:
                if ttt is not None:
                    with long_range_layer():
                        a = ttt(a, layout)
                return gated_add(x, a, gate)
            last = () if ttt.bidirectional else (x, gate)  # the last pass takes the block's gated add
            with long_range_layer():
                z = maybe_checkpoint(inner.gated_pass, ttt.checkpoint_forward, a, layout, False,
                                     (ttt.forward_gate_text, ttt.forward_gate_video), *last)
            if not ttt.bidirectional:
                return z
        with long_range_layer():
            return maybe_checkpoint(inner.gated_pass, ttt.checkpoint_reverse, z, layout, True,
                                    (ttt.reverse_gate_text, ttt.reverse_gate_video), x, gate)

    def forward(self, x: torch.Tensor, text: torch.Tensor, projection: torch.Tensor,
                layout: VideoLayout) -> torch.Tensor:
        """x [B, L, dim] video tokens; text [B, n, text_len, dim] embedded; projection [B, 6, dim] the time
        projection -> [B, L, dim]."""
        shift, scale, gate, c_shift, c_scale, c_gate = self.modulation(projection)
        x = self._self_attention_and_ttt(x, shift, scale, gate, layout)
        return maybe_checkpoint(self._cross_and_ffn, self.checkpoint_mlp, x, text, layout, c_shift, c_scale, c_gate,
                                keep=self.checkpoint_keep)

    @torch.no_grad()
    def chunked_forward(self, x: torch.Tensor, text: torch.Tensor, projection: torch.Tensor, layout: VideoLayout,
                        plan: ChunkPlan) -> torch.Tensor:
        """`forward` without gradients in bounded memory; x [B, L, dim] is updated in place and returned. Equal to
        `forward` up to the summation order inside the matmuls."""
        shift, scale, gate, c_shift, c_scale, c_gate = self.modulation(projection)
        L = x.shape[1]
        n = layout.num_segments
        _, inv_count = window_gather(layout, x.device)
        cos, sin = window_rope(layout, self.attn.head_dim, self.attn.rope_theta, x.device)
        windows = [layout.window_index(i).to(x.device) for i in range(n)]

        def merged(window_out) -> torch.Tensor:
            """The windows' outputs summed per position, the shared frames averaged, projected by `to_out` later."""
            acc = x.new_zeros(x.shape)
            for i, idx in enumerate(windows):
                add_window(acc, layout, i, window_out(i, idx))
            if n > 1:
                acc.mul_(inv_count.to(acc.dtype))
            return acc

        a = merged(lambda i, idx: self.attn.window_forward(norm_modulate(x[:, idx], self.eps, shift, scale), cos,
                                                           sin))
        for s, e in token_chunks(0, L, plan.tokens):
            a[:, s:e] = self.attn.to_out(a[:, s:e])
        if self.ttt is not None:
            self.ttt.chunked_forward_(a, layout, plan)
        for s, e in token_chunks(0, L, plan.tokens):
            x[:, s:e] = (x[:, s:e].float() + a[:, s:e] * gate).to(x.dtype)
        del a

        def cross_norm(h: torch.Tensor) -> torch.Tensor:
            if self.cross_norm is None:
                return h
            return F.layer_norm(h.float(), (h.shape[-1],), self.cross_norm.weight.float(),
                                self.cross_norm.bias.float(), self.eps).to(h.dtype)

        c = merged(lambda i, idx: self.cross_attn.window_forward(cross_norm(x[:, idx]), text[:, i]))
        for s, e in token_chunks(0, L, plan.tokens):
            h = x[:, s:e] + self.cross_attn.to_out(c[:, s:e])
            y = self.ffn(norm_modulate(h, self.eps, c_shift, c_scale))
            x[:, s:e] = (h.float() + y.float() * c_gate).to(x.dtype)
        return x
