"""Backbone sizes: the `cogvideox-5b` preset (CogVideoX-5B's transformer), a `tiny` one for CPU and
`small` (4 blocks, heads of 64) for the long-range benchmark.

A `ModelSpec` holds exactly the fields of diffusers' `CogVideoXTransformer3DModel` config.json that change what the
transformer computes, so that a spec can be read from a downloaded `transformer/` folder and compared with a preset
field by field (`mismatches`), and written back as a diffusers config (`to_diffusers_config`) for tests.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tttvideo.errors import UserError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    num_attention_heads: int
    attention_head_dim: int
    in_channels: int = 16
    out_channels: int = 16
    text_embed_dim: int = 4096
    time_embed_dim: int = 512
    patch_size: int = 2
    flip_sin_to_cos: bool = True
    freq_shift: int = 0
    norm_eps: float = 1e-5
    norm_elementwise_affine: bool = True
    attention_bias: bool = True
    patch_bias: bool = True
    activation_fn: str = "gelu-approximate"
    timestep_activation_fn: str = "silu"
    dropout: float = 0.0
    # Fields below do not change the computation with rotary embeddings; they are kept so that a spec round-trips
    # through a diffusers config.json (the sample size also fixes the RoPE grid diffusers' pipeline uses).
    sample_width: int = 90
    sample_height: int = 60
    sample_frames: int = 49
    temporal_compression_ratio: int = 4
    max_text_seq_length: int = 226
    spatial_interpolation_scale: float = 1.875
    temporal_interpolation_scale: float = 1.0
    use_rotary_positional_embeddings: bool = True
    use_learned_positional_embeddings: bool = False
    # Not in diffusers' config: the q/k LayerNorm eps (hard-coded 1e-6 in CogVideoXBlock) and the RoPE base.
    qk_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    @property
    def dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    # Fields that decide whether a weights folder fits this spec, in the order they are reported.
    SHAPE_FIELDS = (
        "num_layers",
        "num_attention_heads",
        "attention_head_dim",
        "text_embed_dim",
        "time_embed_dim",
        "in_channels",
        "out_channels",
        "patch_size",
    )
    # Fields that change the function computed without changing any tensor shape.
    FUNCTION_FIELDS = (
        "flip_sin_to_cos",
        "freq_shift",
        "norm_eps",
        "norm_elementwise_affine",
        "attention_bias",
        "patch_bias",
        "activation_fn",
        "timestep_activation_fn",
        "use_rotary_positional_embeddings",
        "use_learned_positional_embeddings",
    )

    def validate(self) -> None:
        """What our implementation covers: the CogVideoX 1.0 family with rotary embeddings (the 5B line)."""
        if self.attention_head_dim % 16:
            raise UserError(
                f"model {self.name!r}: attention_head_dim {self.attention_head_dim} is not divisible by 16, "
                f"which the 3D RoPE split t/h/w = 1/4, 3/8, 3/8 needs"
            )
        if not self.use_rotary_positional_embeddings or self.use_learned_positional_embeddings:
            raise UserError(
                f"model {self.name!r} uses sinusoidal/learned positional embeddings (CogVideoX-2B / I2V style); "
                f"tttvideo supports the rotary-embedding CogVideoX-5B line only"
            )
        if self.activation_fn != "gelu-approximate" or self.timestep_activation_fn != "silu":
            raise UserError(
                f"model {self.name!r}: activation {self.activation_fn!r} / timestep activation "
                f"{self.timestep_activation_fn!r} differ from CogVideoX's 'gelu-approximate' / 'silu'"
            )
        if self.dropout != 0.0:
            raise UserError(f"model {self.name!r}: dropout {self.dropout} is not supported (CogVideoX trains with 0)")

    def mismatches(self, other: "ModelSpec") -> list[str]:
        """'field: ours vs theirs' for every shape or function field that differs."""
        out = []
        for f in self.SHAPE_FIELDS + self.FUNCTION_FIELDS:
            a, b = getattr(self, f), getattr(other, f)
            if a != b:
                out.append(f"{f} {b!r} (preset has {a!r})")
        return out

    def to_diffusers_config(self) -> dict[str, Any]:
        """Keyword arguments of diffusers' CogVideoXTransformer3DModel for this spec (CogVideoX 1.0: no temporal
        patching, no ofs embedding)."""
        skip = {"name", "qk_norm_eps", "rope_theta"}
        cfg = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
        cfg.update(patch_size_t=None, ofs_embed_dim=None)
        return cfg

    @classmethod
    def from_diffusers_config(cls, config: dict[str, Any], name: str = "custom") -> "ModelSpec":
        """Spec of a diffusers config.json. CogVideoX 1.5 (temporal patching) and I2V (ofs embedding) are refused."""
        if config.get("patch_size_t") not in (None, 1):
            raise UserError(
                f"this transformer uses temporal patching (patch_size_t={config['patch_size_t']}, CogVideoX 1.5); "
                f"tttvideo supports the CogVideoX 1.0 5B layout (patch_size_t null)"
            )
        if config.get("ofs_embed_dim"):
            raise UserError("this transformer has an ofs embedding (CogVideoX 1.5 I2V); tttvideo supports T2V 5B")
        defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name in ("name", "qk_norm_eps", "rope_theta"):
                continue
            # diffusers' own defaults for keys a config.json may leave out
            value = config.get(f.name, _DIFFUSERS_DEFAULTS.get(f.name, defaults.get(f.name)))
            if f.name == "out_channels" and value is None:
                value = config.get("in_channels", 16)
            kwargs[f.name] = value
        return cls(name=name, **kwargs)


# Defaults of diffusers' CogVideoXTransformer3DModel.__init__ where they differ from CogVideoX-5B's config.json.
_DIFFUSERS_DEFAULTS: dict[str, Any] = {
    "num_attention_heads": 30,
    "num_layers": 30,
    "use_rotary_positional_embeddings": False,
}


PRESETS: dict[str, ModelSpec] = {
    # THUDM/CogVideoX-5b transformer/config.json
    "cogvideox-5b": ModelSpec(
        name="cogvideox-5b",
        num_layers=42,
        num_attention_heads=48,
        attention_head_dim=64,
        in_channels=16,
        out_channels=16,
        text_embed_dim=4096,
        time_embed_dim=512,
        patch_size=2,
        sample_width=90,
        sample_height=60,
        sample_frames=49,
    ),
    # For CPU: 64x96 px -> 8x12 latent -> 4x6 = 24 tokens per frame; 3 s = 13 x 24 + 8 text = 320 tokens.
    "tiny": ModelSpec(
        name="tiny",
        num_layers=2,
        num_attention_heads=2,
        attention_head_dim=32,
        in_channels=16,
        out_channels=16,
        text_embed_dim=64,
        time_embed_dim=64,
        patch_size=2,
        sample_width=12,
        sample_height=8,
        sample_frames=49,
        max_text_seq_length=8,
    ),
    # The long-range benchmark at the paper's head size (configs/long-range-d64.toml): 4 blocks of 4 heads of 64,
    # so TTT-MLP's inner MLP is 64 -> 256 -> 64 as in the original; the demo's 64-d text features and 8x8 latents.
    "small": ModelSpec(
        name="small",
        num_layers=4,
        num_attention_heads=4,
        attention_head_dim=64,
        in_channels=16,
        out_channels=16,
        text_embed_dim=64,
        time_embed_dim=256,
        patch_size=2,
        sample_width=8,
        sample_height=8,
        sample_frames=49,
        max_text_seq_length=24,
    ),
}

# The CPU demo's model (configs/demo.toml): tiny with 4 latent channels, the demo set's RGB and one mix of it. Each
# 2x2 patch of 16 channels is 64 values, as wide as tiny's stream, which must carry their noise through to remove it:
# in the demo's two minutes tiny drew its first scene as coloured noise, this one draws the pillar.
PRESETS["tiny-4ch"] = dataclasses.replace(PRESETS["tiny"], name="tiny-4ch", in_channels=4, out_channels=4)

# Other CogVideoX transformers people have on disk, named in the error when a folder holds one of them.
KNOWN_OTHER_MODELS: dict[str, dict[str, Any]] = {
    "CogVideoX-2B": {"num_layers": 30, "num_attention_heads": 30, "attention_head_dim": 64,
                     "use_rotary_positional_embeddings": False},
    "CogVideoX1.5-5B": {"num_layers": 42, "num_attention_heads": 48, "attention_head_dim": 64, "patch_size_t": 2},
}


def describe_config(config: dict[str, Any]) -> str:
    """Which known model a diffusers config.json looks like, for error messages."""
    for label, fields in KNOWN_OTHER_MODELS.items():
        if all(config.get(k, _DIFFUSERS_DEFAULTS.get(k)) == v for k, v in fields.items()):
            return label
    for name, spec in PRESETS.items():
        if all(config.get(k) == getattr(spec, k) for k in ModelSpec.SHAPE_FIELDS if k in config):
            return f"the {name!r} preset"
    layers = config.get("num_layers", _DIFFUSERS_DEFAULTS["num_layers"])
    heads = config.get("num_attention_heads", _DIFFUSERS_DEFAULTS["num_attention_heads"])
    return f"an unknown CogVideoX-like model ({layers} layers, {heads} heads x {config.get('attention_head_dim', 64)})"
