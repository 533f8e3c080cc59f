"""CogVideoX-5B (1.0, rotary) as a tttvideo backbone: its blocks, embeddings and transformer, its presets, and its
weights in diffusers' layout. Registers the backbone "cogvideox" with presets "tiny" and "cogvideox-5b"."""

from __future__ import annotations

from torch import nn

from tttvideo.config.schema import ModelConfig
from tttvideo.diffusion import ZeroSNRSchedule
from tttvideo.layout import WINDOW_FRAMES, LayoutParams
from tttvideo.models.backbone import BackboneSpec, Objective, register_backbone
from tttvideo.models.cogvideox.presets import PRESETS, ModelSpec
from tttvideo.models.cogvideox.transformer import CogVideoXTTT
from tttvideo.models.cogvideox.weights import from_pretrained, save_diffusers_folder


def configure(model: nn.Module, m: ModelConfig) -> None:
    """model.compile_attention_glue and model.compile_block_glue on every block."""
    for block in model.blocks:
        block.attn.compile_glue = m.compile_attention_glue
        block.compile_glue = block.norm1.compile_glue = block.norm2.compile_glue = m.compile_block_glue


BACKBONE = register_backbone(BackboneSpec(
    name="cogvideox",
    presets=PRESETS,
    config_type=ModelSpec,
    build=CogVideoXTTT,
    from_pretrained=from_pretrained,
    save_pretrained=save_diffusers_folder,
    # 49 frames (3 s at 16 fps) -> 13 latent frames per window, text in the stream, 2x2 patches, VAE 8x / 4x
    layout=LayoutParams(window_frames=WINDOW_FRAMES, text_in_stream=True, patch_size=2, vae_spatial=8,
                        vae_temporal=4),
    # v-prediction on the ZeroSNR DDPM schedule, sampled with DDIM / DPM-Solver++(2M) (sample/solvers.py)
    objective=Objective(prediction="v", schedule=ZeroSNRSchedule),
    configure=configure,
    compiles_glue=lambda m: m.compile_attention_glue or m.compile_block_glue,
    # diffusers' AutoencoderKLCogVideoX and T5-XXL (4096-d features)
    vae="cogvideox",
    text_encoder="t5",
))

__all__ = ["BACKBONE", "PRESETS", "CogVideoXTTT", "ModelSpec", "from_pretrained"]
