"""Backbone sizes of Wan2.1 text-to-video: the `wan2.1-t2v-1.3b` preset and a `wan-tiny` one for CPU tests.

A `WanSpec` holds the fields of diffusers' `WanTransformer3DModel` config.json that change what the text-to-video
transformer computes, so that a downloaded `transformer/` folder can be read into a spec and compared with a preset
(`mismatches`), and a spec written back as diffusers keyword arguments (`to_diffusers_config`, used by the tests).
Image conditioning (Wan2.1 I2V: `image_dim`, `added_kv_proj_dim`) and Wan2.2's per-token timesteps are not covered.

`ttt_head_dim` is ours: the TTT layer splits the width into heads of this size, independent of attention's 128, so
that the TTT kernels (head dims 16, 32, 64) serve it; 1536 / 64 = 24 TTT heads for the 1.3B model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tttvideo.errors import UserError

DIFFUSERS_CLASS = "WanTransformer3DModel"


@dataclass(frozen=True)
class WanSpec:
    name: str
    num_layers: int
    num_attention_heads: int
    attention_head_dim: int
    ffn_dim: int
    in_channels: int = 16
    out_channels: int = 16
    text_dim: int = 4096  # umT5-XXL features
    freq_dim: int = 256  # width of the timestep sinusoid
    patch_size: tuple[int, int, int] = (1, 2, 2)  # (frames, rows, columns)
    eps: float = 1e-6  # every LayerNorm and the q/k RMSNorms
    cross_attn_norm: bool = True  # an affine LayerNorm before cross-attention
    qk_norm: str = "rms_norm_across_heads"
    rope_max_seq_len: int = 1024  # positions per axis diffusers tabulates; ours computes them, but bounds them too
    rope_theta: float = 10000.0  # not in diffusers' config (fixed there)
    ttt_head_dim: int = 64  # ours: the TTT layer's head size

    @property
    def dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def text_embed_dim(self) -> int:
        """The width of the text features the model takes (`models.backbone.BackboneConfig`)."""
        return self.text_dim

    @property
    def ttt_heads(self) -> int:
        return self.dim // self.ttt_head_dim

    # fields that decide whether a weights folder fits this spec (tensor shapes), then those that change the function
    SHAPE_FIELDS = ("num_layers", "num_attention_heads", "attention_head_dim", "ffn_dim", "in_channels",
                    "out_channels", "text_dim", "freq_dim", "patch_size", "cross_attn_norm")
    FUNCTION_FIELDS = ("eps", "qk_norm")

    def validate(self) -> None:
        if self.patch_size[0] != 1:
            raise UserError(f"model {self.name!r}: temporal patch {self.patch_size[0]} is not supported; the segment "
                            f"windows count latent frames, so the patch must be (1, p, p)")
        if self.patch_size[1] != self.patch_size[2]:
            raise UserError(f"model {self.name!r}: patch {tuple(self.patch_size)} is not square over rows and columns")
        if self.qk_norm != "rms_norm_across_heads":
            raise UserError(f"model {self.name!r}: qk_norm {self.qk_norm!r} is not supported "
                            f"(Wan2.1 uses 'rms_norm_across_heads')")
        if self.attention_head_dim % 2 or (self.attention_head_dim // 6) < 1:
            raise UserError(f"model {self.name!r}: attention_head_dim {self.attention_head_dim} cannot be split "
                            f"over the three RoPE axes")
        if self.ttt_head_dim % 16:
            raise UserError(f"model {self.name!r}: ttt_head_dim {self.ttt_head_dim} is not divisible by 16, which "
                            f"the TTT layer's 3D RoPE needs")
        if self.dim % self.ttt_head_dim:
            raise UserError(f"model {self.name!r}: width {self.dim} is not a multiple of ttt_head_dim "
                            f"{self.ttt_head_dim}")

    def mismatches(self, other: "WanSpec") -> list[str]:
        """'field theirs (preset has ours)' for every shape or function field that differs."""
        return [f"{f} {getattr(other, f)!r} (preset has {getattr(self, f)!r})"
                for f in self.SHAPE_FIELDS + self.FUNCTION_FIELDS if getattr(self, f) != getattr(other, f)]

    def to_diffusers_config(self) -> dict[str, Any]:
        """Keyword arguments of diffusers' WanTransformer3DModel for this spec (text-to-video: no image branch)."""
        skip = {"name", "rope_theta", "ttt_head_dim"}
        cfg = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
        cfg.update(image_dim=None, added_kv_proj_dim=None, pos_embed_seq_len=None)
        return cfg

    @classmethod
    def from_diffusers_config(cls, config: dict[str, Any], name: str = "custom") -> "WanSpec":
        """Spec of a diffusers config.json; image-conditioned (I2V) transformers are refused."""
        if config.get("image_dim") or config.get("added_kv_proj_dim"):
            raise UserError("this transformer has an image branch (Wan2.1 I2V); tttvideo supports text-to-video")
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in ("name", "rope_theta", "ttt_head_dim"):
                continue
            default = _DIFFUSERS_DEFAULTS.get(f.name, f.default)
            if default is dataclasses.MISSING:
                default = None
            kwargs[f.name] = config.get(f.name, default)
        kwargs["patch_size"] = tuple(kwargs["patch_size"])
        if kwargs["out_channels"] is None:
            kwargs["out_channels"] = kwargs["in_channels"]
        if kwargs["qk_norm"] is None:
            kwargs["qk_norm"] = "none"
        return cls(name=name, **kwargs)


# diffusers' WanTransformer3DModel.__init__ defaults (the 14B's) for keys a config.json may leave out
_DIFFUSERS_DEFAULTS: dict[str, Any] = {"num_attention_heads": 40, "num_layers": 40, "ffn_dim": 13824,
                                       "attention_head_dim": 128}


WAN_PRESETS: dict[str, WanSpec] = {
    # Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json
    "wan2.1-t2v-1.3b": WanSpec(name="wan2.1-t2v-1.3b", num_layers=30, num_attention_heads=12, attention_head_dim=128,
                               ffn_dim=8960),
    # For CPU: 2 layers of width 64 (2 heads of 32, TTT heads of 16), umT5 features cut to 32-d
    "wan-tiny": WanSpec(name="wan-tiny", num_layers=2, num_attention_heads=2, attention_head_dim=32, ffn_dim=128,
                        in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ttt_head_dim=16),
}


def get_wan_preset(name: str) -> WanSpec:
    if name not in WAN_PRESETS:
        raise UserError(f"unknown Wan preset {name!r}; use one of {', '.join(WAN_PRESETS)}")
    return WAN_PRESETS[name]
