"""Wan2.1-T2V with TTT layers as a tttvideo backbone: presets, the long-video layout (video tokens only), the
transformer, diffusers weights and the flow-matching objective. Registers the backbone "wan" with presets
"wan-tiny" and "wan2.1-t2v-1.3b"; see docs/wan.md."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tttvideo.errors import ConfigError
from tttvideo.layout import WINDOW_FRAMES, LayoutParams
from tttvideo.models.backbone import BackboneSpec, Objective, register_backbone
from tttvideo.models.wan.diffusion import WanFlowMatching
from tttvideo.models.wan.layout import (WAN_VAE_SPATIAL, WAN_VAE_TEMPORAL, layout_table, wan_layout,
                                        wan_layout_from_latents)
from tttvideo.models.wan.spec import WAN_PRESETS, WanSpec, get_wan_preset
from tttvideo.models.wan.transformer import WanTTT
from tttvideo.models.wan.weights import from_pretrained_wan, save_wan_folder

if TYPE_CHECKING:
    from tttvideo.config.schema import Config

# Wan's pipeline pads (or cuts) every prompt to 512 umT5 tokens
WAN_TEXT_TOKENS = 512


def check_config(cfg: Config) -> None:
    """What the CogVideoX paths offer but the Wan model does not (yet): one ConfigError sentence each."""
    if cfg.layout.text_tokens == 0:
        raise ConfigError(f"layout.text_tokens = 0 picks CogVideoX's in-stream text length; Wan cross-attends to "
                          f"each segment's text, so set layout.text_tokens (umT5 prompts: {WAN_TEXT_TOKENS})")
    if cfg.parallel.sp > 1:
        raise ConfigError(f"parallel.sp = {cfg.parallel.sp}: sequence parallelism is not wired for the Wan model "
                          f"yet; set parallel.sp = 1")


BACKBONE = register_backbone(BackboneSpec(
    name="wan",
    presets=WAN_PRESETS,
    config_type=WanSpec,
    build=WanTTT,
    from_pretrained=from_pretrained_wan,
    save_pretrained=save_wan_folder,
    # 49 frames (3 s at 16 fps) -> 13 latent frames per window, text cross-attended (not in the stream), 1x2x2
    # patches, VAE 8x / 4x (AutoencoderKLWan)
    layout=LayoutParams(window_frames=WINDOW_FRAMES, text_in_stream=False, patch_size=2, vae_spatial=WAN_VAE_SPATIAL,
                        vae_temporal=WAN_VAE_TEMPORAL),
    # flow matching with shift 3, sampled with UniPC or Euler on Wan's shifted grids (sample/solvers.py)
    objective=Objective(prediction="flow", schedule=WanFlowMatching),
    # diffusers' AutoencoderKLWan and transformers' UMT5EncoderModel (4096-d features)
    vae="wan",
    text_encoder="umt5",
    check=check_config,
    # both attentions one window at a time and the TTT passes over token chunks in training (WanBlock, TTTLayer)
    has_window_form=True,
))

__all__ = ["BACKBONE", "WAN_PRESETS", "WAN_TEXT_TOKENS", "WanSpec", "WanTTT", "from_pretrained_wan",
           "get_wan_preset", "layout_table", "wan_layout", "wan_layout_from_latents"]
