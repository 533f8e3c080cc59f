"""The long-video DiT: CogVideoX's transformer with segment-local attention and bidirectional TTT layers.

Inputs are diffusers' layout: latents [B, T, C, H, W] (T = 13 + 12 (n - 1) latent frames), one text embedding per
3-s segment ([B, n, text_len, text_dim] or a list of n [B, text_len, text_dim]) and the timestep. The residual
stream is [all text | all video] (`tttvideo.layout`). The output is the prediction for the latents, [B, T, C, H, W].

Numerically this is diffusers' `CogVideoXTransformer3DModel` (1.0, rotary) when there is one segment and the TTT
gates are 0; `tests/test_model_equivalence.py` checks it.

Given a `SequenceParallel` group (`tttvideo.parallel`), every rank of the group is called with the same inputs;
each embeds them, keeps its shard of the residual stream through the blocks and the output head, and the shards
are gathered into the whole prediction, which every rank returns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tttvideo.config.schema import TTTConfig
from tttvideo.errors import LayoutError
from tttvideo.layout import VideoLayout
from tttvideo.models.backbone import Backbone
from tttvideo.models.cogvideox.block import Block
from tttvideo.models.cogvideox.embeddings import PatchEmbed
from tttvideo.models.cogvideox.presets import ModelSpec
from tttvideo.models.layers import TimestepEmbedding

if TYPE_CHECKING:  # the parallel package imports torch.distributed; the model needs it only when given a group
    from tttvideo.parallel.sequence import SequenceParallel


class OutputNorm(nn.Module):
    """diffusers' AdaLayerNorm with chunk_dim=1 as CogVideoX uses it: Linear(SiLU(temb)) -> (shift, scale)."""

    def __init__(self, time_embed_dim: int, dim: int, eps: float, elementwise_affine: bool):
        super().__init__()
        self.linear = nn.Linear(time_embed_dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, eps=eps, elementwise_affine=elementwise_affine)

    def forward(self, x: torch.Tensor, temb_act: torch.Tensor) -> torch.Tensor:
        shift, scale = self.linear(temb_act).chunk(2, dim=1)
        return torch.addcmul(shift[:, None], self.norm(x), 1 + scale[:, None])


class CogVideoXTTT(Backbone):
    def __init__(self, spec: ModelSpec, ttt: TTTConfig | None = None, use_ttt: bool = True,
                 sequence_layer: str = "ttt"):
        """spec: backbone size; ttt: a TTTConfig (defaults when None); use_ttt=False: local attention only;
        sequence_layer: the long-range layer when use_ttt (`tttvideo.sequence.build.SEQUENCE_LAYERS`)."""
        super().__init__()
        if ttt is None:
            ttt = TTTConfig()
        spec.validate()
        self.spec, self.ttt_config, self.use_ttt = spec, ttt, use_ttt
        self.sequence_layer = sequence_layer if use_ttt else "none"
        dim = spec.dim
        self.embed = PatchEmbed(spec.in_channels, dim, spec.text_embed_dim, spec.patch_size, bias=spec.patch_bias)
        self.time_embed = TimestepEmbedding(dim, spec.time_embed_dim, spec.flip_sin_to_cos, spec.freq_shift)
        self.blocks = nn.ModuleList([Block(spec, ttt if use_ttt else None, sequence_layer)
                                     for _ in range(spec.num_layers)])
        self.norm_final = nn.LayerNorm(dim, eps=spec.norm_eps, elementwise_affine=spec.norm_elementwise_affine)
        self.norm_out = OutputNorm(spec.time_embed_dim, dim, spec.norm_eps, spec.norm_elementwise_affine)
        self.proj_out = nn.Linear(dim, spec.patch_size * spec.patch_size * spec.out_channels)
        # (start, stop, checkpointed) runs of blocks; set by models.checkpointing.apply_checkpointing
        self.block_units: list[tuple[int, int, bool]] = [(i, i + 1, False) for i in range(spec.num_layers)]

    def _check_inputs(self, latents: torch.Tensor, text: torch.Tensor, layout: VideoLayout) -> None:
        spec = self.spec
        self.check_latents(latents, layout)
        B = latents.shape[0]
        layout.check_text_embeddings(text.shape[1])
        if text.shape[0] != B:
            raise LayoutError(f"text embeddings have batch {text.shape[0]} but the latents have batch {B}")
        if text.shape[2] != layout.text_tokens:
            raise LayoutError(
                f"text embeddings have {text.shape[2]} tokens per segment but the layout has {layout.text_tokens}"
            )
        if text.shape[3] != spec.text_embed_dim:
            raise LayoutError(
                f"text embeddings are {text.shape[3]}-d; the model takes {spec.text_embed_dim}-d (T5-XXL is 4096)"
            )

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        latents: torch.Tensor,
        text: torch.Tensor | Sequence[torch.Tensor],
        timestep: torch.Tensor | int | float,
        layout: VideoLayout | None = None,
        sp: SequenceParallel | None = None,
    ) -> torch.Tensor:
        """The prediction [B, T, C, H, W] for `latents`; `sp`: split the sequence over its ranks (each given the
        same inputs)."""
        text = self.stacked_inputs(latents, text)
        B, T, C, H, W = latents.shape
        if layout is None:
            layout = VideoLayout.from_latents(T, H, W, text.shape[2], self.spec.patch_size,
                                              self.ttt_config.train_mini_batch())
        self._check_inputs(latents, text, layout)

        timestep = torch.as_tensor(timestep, device=latents.device)
        if timestep.dim() == 0:
            timestep = timestep.expand(B)
        temb_act = F.silu(self.time_embed(timestep))  # every adaLN applies SiLU first; do it once

        dtype = self.embed.patch.weight.dtype
        x = torch.cat([self.embed.text(text.reshape(B, -1, text.shape[-1]).to(dtype)),
                       self.embed.video(latents.to(dtype))], dim=1)
        layout.check_sequence_length(x.shape[1])
        if sp is not None:
            x = sp.shard(x, layout)

        x = self.run_blocks(x, temb_act, layout, sp)

        if sp is None:
            x = x[:, layout.total_text_tokens:]
        # with sp the head runs on the whole shard, text included, so that every shard has the same length to gather
        x = self.norm_out(self.norm_final(x), temb_act)
        x = self.proj_out(x)
        if sp is not None:
            x = sp.unshard(x, layout)[:, layout.total_text_tokens:]
        return self.unpatchify(x, T, H, W)

    def unpatchify(self, x: torch.Tensor, T: int, H: int, W: int) -> torch.Tensor:
        """[B, T h w, C p p] -> [B, T, C, H, W], channel-major inside a patch as in diffusers."""
        p = self.spec.patch_size
        B = x.shape[0]
        x = x.reshape(B, T, H // p, W // p, -1, p, p)
        return x.permute(0, 1, 4, 2, 5, 3, 6).reshape(B, T, -1, H, W)
