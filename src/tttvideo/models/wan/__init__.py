"""Wan2.1-T2V with TTT layers: presets, the long-video layout (video tokens only), the transformer, diffusers
weights and the flow-matching objective. A self-contained second backbone; see docs/wan.md."""

from tttvideo.models.wan.layout import layout_table, wan_layout, wan_layout_from_latents
from tttvideo.models.wan.spec import WAN_PRESETS, WanSpec, get_wan_preset
from tttvideo.models.wan.transformer import WanTTT

__all__ = ["WAN_PRESETS", "WanSpec", "WanTTT", "get_wan_preset", "layout_table", "wan_layout",
           "wan_layout_from_latents"]
