"""The long-video Wan model: Wan2.1's text-to-video transformer with segment-local attention, per-segment
cross-attention and bidirectional TTT layers.

Inputs follow the project's convention (as `CogVideoXTTT`): latents [B, T, C, H, W] with T = 13 + 12 (n - 1)
latent frames (diffusers' Wan takes [B, C, T, H, W]), one umT5 embedding per 3-s segment ([B, n, text_len,
text_dim] or a list of n [B, text_len, text_dim]; Wan pads prompts to 512 tokens with zeros and attends to the
padding unmasked, so no mask is taken) and the timestep (Wan's scale, 0 .. 1000). The residual stream holds the
video tokens only (`tttvideo.models.wan.layout`). The output is the flow-matching velocity for the latents,
[B, T, C, H, W].

Numerically this is diffusers' `WanTransformer3DModel` (text-to-video) when there is one segment and the TTT gates
are 0; `tests/test_wan_model.py` checks it. Sequence parallelism is not wired for this model yet (the config check
of the Wan backbone refuses `parallel.sp` > 1).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tttvideo.config.schema import TTTConfig
from tttvideo.errors import LayoutError
from tttvideo.layout import VideoLayout
from tttvideo.models.backbone import Backbone
from tttvideo.models.layers import TimestepEmbedding
from tttvideo.models.wan.block import ModulationTable, WanBlock
from tttvideo.models.wan.layout import wan_layout_from_latents
from tttvideo.models.wan.spec import WanSpec


class TextProjection(nn.Module):
    """umT5 features -> model width: linear, GELU-tanh, linear (diffusers' PixArtAlphaTextProjection)."""

    def __init__(self, text_dim: int, dim: int):
        super().__init__()
        self.linear1 = nn.Linear(text_dim, dim)
        self.linear2 = nn.Linear(dim, dim)

    def forward(self, text: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.gelu(self.linear1(text), approximate="tanh"))


class WanTTT(Backbone):
    def __init__(self, spec: WanSpec, ttt: TTTConfig | None = None, use_ttt: bool = True,
                 sequence_layer: str = "ttt"):
        """spec: backbone size; ttt: a TTTConfig (defaults when None); use_ttt=False: local attention only;
        sequence_layer: the long-range layer when use_ttt (`tttvideo.sequence.build.SEQUENCE_LAYERS`)."""
        super().__init__()
        spec.validate()
        ttt = ttt if ttt is not None else TTTConfig()
        self.spec, self.ttt_config, self.use_ttt = spec, ttt, use_ttt
        self.sequence_layer = sequence_layer if use_ttt else "none"
        dim, p = spec.dim, spec.patch_size
        self.patch = nn.Conv3d(spec.in_channels, dim, kernel_size=p, stride=p)
        # sinusoid of freq_dim (cos first) -> linear -> SiLU -> linear: the time embedding `temb`
        self.time_embed = TimestepEmbedding(spec.freq_dim, dim, flip_sin_to_cos=True, freq_shift=0)
        self.time_proj = nn.Linear(dim, 6 * dim)  # SiLU(temb) -> every block's six modulation vectors
        self.text_embed = TextProjection(spec.text_dim, dim)
        self.blocks = nn.ModuleList([WanBlock(spec, ttt if use_ttt else None, sequence_layer)
                                     for _ in range(spec.num_layers)])
        self.head_modulation = ModulationTable(2, dim)  # (shift, scale) offsets of the output norm
        self.proj_out = nn.Linear(dim, spec.out_channels * p[0] * p[1] * p[2])
        # (start, stop, checkpointed) runs of blocks (set by tttvideo.models.checkpointing.apply_checkpointing)
        self.block_units: list[tuple[int, int, bool]] = [(i, i + 1, False) for i in range(spec.num_layers)]

    # ------------------------------------------------------------------ inputs
    def layout_for(self, latents: torch.Tensor) -> VideoLayout:
        """The layout of latents [B, T, C, H, W] with the training TTT mini-batch."""
        _, T, _, H, W = latents.shape
        return wan_layout_from_latents(T, H, W, self.spec.patch_size[1], self.ttt_config.train_mini_batch())

    def _check_inputs(self, latents: torch.Tensor, text: torch.Tensor, layout: VideoLayout) -> None:
        spec = self.spec
        self.check_latents(latents, layout)
        B = latents.shape[0]
        if layout.total_text_tokens:
            raise LayoutError("Wan's layout has no text in the stream; build it with tttvideo.models.wan.layout")
        layout.check_text_embeddings(text.shape[1])
        if text.shape[0] != B:
            raise LayoutError(f"text embeddings have batch {text.shape[0]} but the latents have batch {B}")
        if text.shape[3] != spec.text_dim:
            raise LayoutError(f"text embeddings are {text.shape[3]}-d; the model takes {spec.text_dim}-d "
                              f"(umT5-XXL is 4096)")

    # ------------------------------------------------------------------ forward
    def forward(self, latents: torch.Tensor, text: torch.Tensor | Sequence[torch.Tensor],
                timestep: torch.Tensor | int | float, layout: VideoLayout | None = None,
                sp: object | None = None) -> torch.Tensor:
        """The velocity prediction [B, T, C, H, W] for `latents` [B, T, C, H, W]; `sp` must be None (one process)."""
        if sp is not None:
            raise NotImplementedError("sequence parallelism is not wired for the Wan model")
        text = self.stacked_inputs(latents, text)
        B, T, C, H, W = latents.shape
        layout = self.layout_for(latents) if layout is None else layout
        self._check_inputs(latents, text, layout)

        dtype = self.patch.weight.dtype
        timestep = torch.as_tensor(timestep, device=latents.device)
        if timestep.dim() == 0:
            timestep = timestep.expand(B)
        temb = self.time_embed(timestep)  # [B, dim]
        projection = self.time_proj(F.silu(temb)).unflatten(1, (6, -1))  # [B, 6, dim]
        context = self.text_embed(text.to(dtype))  # [B, n, text_len, dim]

        x = self.patch(latents.to(dtype).transpose(1, 2))  # [B, dim, T, H/p, W/p]
        x = x.flatten(2).transpose(1, 2).contiguous()  # tokens in (frame, row, column) order
        layout.check_sequence_length(x.shape[1])

        x = self.run_blocks(x, context, projection, layout)

        shift, scale = self.head_modulation(temb[:, None])
        h = F.layer_norm(x.float(), (x.shape[-1],), eps=self.spec.eps)
        x = self.proj_out(torch.addcmul(shift, h, 1 + scale).to(x.dtype))
        return self.unpatchify(x, T, H, W)

    def run_block(self, block: nn.Module, x: torch.Tensor, *args: Any) -> torch.Tensor:
        if block.inference_chunks is not None and not torch.is_grad_enabled():
            return block.chunked_forward(x, *args, block.inference_chunks)
        return block(x, *args)

    def unpatchify(self, x: torch.Tensor, T: int, H: int, W: int) -> torch.Tensor:
        """[B, T h w, p p C] -> [B, T, C, H, W]; inside a patch the channel is the fastest index, as in diffusers'
        Wan (CogVideoX's is the slowest)."""
        p = self.spec.patch_size[1]
        B = x.shape[0]
        x = x.reshape(B, T, H // p, W // p, p, p, -1)
        return x.permute(0, 1, 6, 2, 4, 3, 5).reshape(B, T, -1, H, W)
