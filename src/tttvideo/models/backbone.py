"""The backbone seam: what tttvideo asks of a video diffusion transformer, and the registry of the ones it has.

A backbone is one folder under `models/` (CogVideoX: `models/cogvideox/`) that registers a `BackboneSpec`: its
named sizes (presets, e.g. "tiny" and "cogvideox-5b"), how to build one with random weights and how to load the
outside weights it is published with, the layout it asks for (`LayoutParams`: the window of latent frames per
segment, whether the text is in the stream, patch size, VAE factors), and its diffusion objective and schedule.
Everything else is shared and works on any backbone that has the `Backbone` shape: the long-range layer beside
attention (`tttvideo.sequence`, `tttvideo.ttt`), adapters, activation checkpointing, fp8 storage, activation
offload, FSDP sharding, the trainer and the sampler.

`model.preset` names a preset; preset names are unique over all backbones, so the preset alone picks the backbone
(`backbone_of`). `build_model` (models/build.py) builds any backbone's model from a config.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence

import torch
from torch import nn

from tttvideo.diffusion import ZeroSNRSchedule
from tttvideo.errors import ConfigError, LayoutError, UserError
from tttvideo.layout import LayoutParams, VideoLayout
from tttvideo.models.checkpointing import checkpointed, nested_spans

if TYPE_CHECKING:
    from tttvideo.config.schema import Config, ModelConfig, TTTConfig
    from tttvideo.parallel.sequence import SequenceParallel


class BackboneConfig(Protocol):
    """A preset: a frozen dataclass (saved as JSON in every model file) with at least these fields."""

    name: str
    num_layers: int
    num_attention_heads: int
    attention_head_dim: int
    in_channels: int  # latent channels (the VAE's)
    text_embed_dim: int  # width of the text encoder's features

    def validate(self) -> None: ...


class Backbone(nn.Module):
    """The base of every backbone's model: what the trainer, the sampler, FSDP, checkpointing and the memory tools
    use of it.

    A subclass sets `spec` (the `BackboneConfig` it was built from), `use_ttt`, `sequence_layer` (the long-range
    layer's kind, "none" without one), `blocks` (the transformer layers: sharded, offloaded and checkpointed one by
    one) and `block_units` ((start, stop, checkpointed) runs of blocks, which `models.checkpointing` rewrites), and
    implements `forward`. The long-range layer of a block is its attribute `ttt` (None without one), whatever its
    kind; a block that supports `memory.chunked_inference` has `chunked_forward(x, temb_act, layout, plan)` and an
    `inference_chunks` slot."""

    spec: Any
    use_ttt: bool
    sequence_layer: str
    blocks: nn.ModuleList
    block_units: list[tuple[int, int, bool]]

    def forward(self, latents: torch.Tensor, text: torch.Tensor | Sequence[torch.Tensor],
                timestep: torch.Tensor | int | float, layout: VideoLayout | None = None,
                sp: SequenceParallel | None = None) -> torch.Tensor:
        """The prediction [B, T, C, H, W] for latents [B, T, C, H, W], text embeddings [B, segments, tokens, dim]
        and the timestep; `sp`: this rank's part of a sequence-parallel group (every rank gets the same inputs)."""
        raise NotImplementedError

    nested_span: int = 0  # checkpointing.nested_span, set with block_units

    @staticmethod
    def stacked_inputs(latents: torch.Tensor, text: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """Checks latents [B, T, C, H, W] and returns the text as [B, segments, tokens, dim] (one tensor per
        segment, or [B, tokens, dim] for one segment, are stacked)."""
        if latents.dim() != 5:
            raise LayoutError(f"latents must be [B, T, C, H, W], got shape {tuple(latents.shape)}")
        if not isinstance(text, torch.Tensor):
            text = torch.stack(list(text), dim=1)
        if text.dim() == 3:  # [B, len, dim]: one segment
            text = text[:, None]
        if text.dim() != 4:
            raise LayoutError(f"text embeddings must be [B, segments, tokens, dim], got shape {tuple(text.shape)}")
        return text

    def check_latents(self, latents: torch.Tensor, layout: VideoLayout) -> None:
        """Latents [B, T, C, H, W] with the model's channels and the layout's latent frame grid."""
        _, T, C, H, W = latents.shape
        if C != self.spec.in_channels:
            raise LayoutError(f"latents have {C} channels; the model takes {self.spec.in_channels} (shape [B, T, C, "
                              f"H, W])")
        expect = (layout.latent_frames, layout.latent_height, layout.latent_width)
        if (T, H, W) != expect:
            raise LayoutError(f"latents of {T} frames x {H}x{W} do not match the {layout.duration_s} s layout at "
                              f"{layout.height}x{layout.width}, which has {expect[0]} latent frames of "
                              f"{expect[1]}x{expect[2]}")

    def run_blocks(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
        """The stream `x` through every block, `run_block(block, x, *args)` each, recomputed in backward as
        `block_units` and `nested_span` say (models.checkpointing): each checkpointed unit keeps its input, and a
        span of units nested in one more checkpoint keeps only the span's."""
        for first, last in nested_spans(self.block_units, self.nested_span):
            if last - first > 1 and torch.is_grad_enabled():
                x = checkpointed(self._run_units, x, first, last, *args)
            else:
                x = self._run_units(x, first, last, *args)
        return x

    def run_block(self, block: nn.Module, x: torch.Tensor, *args: Any) -> torch.Tensor:
        """One block on the stream; a backbone overrides it for another way through a block (e.g. chunked)."""
        return block(x, *args)

    def _run_units(self, x: torch.Tensor, first: int, last: int, *args: Any) -> torch.Tensor:
        for start, stop, ckpt in self.block_units[first:last]:
            if ckpt and torch.is_grad_enabled():  # a unit's blocks share one policy
                x = checkpointed(self._run_span, x, start, stop, *args, keep=self.blocks[start].checkpoint_keep)
            else:
                x = self._run_span(x, start, stop, *args)
        return x

    def _run_span(self, x: torch.Tensor, start: int, stop: int, *args: Any) -> torch.Tensor:
        for block in self.blocks[start:stop]:
            x = self.run_block(block, x, *args)
        return x

    def ttt_modules(self) -> list[nn.Module]:
        return [b.ttt for b in self.blocks if b.ttt is not None]

    @torch.no_grad()
    def set_ttt_gates(self, value: float) -> None:
        """Fill every gate of the long-range layers (forward/reverse, text/video); 0 makes the model the pretrained
        backbone."""
        for m in self.ttt_modules():
            for g in m.gates():
                g.fill_(value)


# what a backbone's model predicts -> the samplers (`sample.solver`) that step it
PREDICTIONS: dict[str, tuple[str, ...]] = {
    "v": ("ddim", "dpm++2m"),  # v-prediction on a DDPM schedule (ZeroSNR for CogVideoX)
    "flow": ("unipc", "euler"),  # the flow-matching velocity noise - x0 (Wan; `models.wan.diffusion`)
}


@dataclass(frozen=True)
class Objective:
    """The diffusion objective a backbone was trained with. `prediction`: what the model outputs, "v" (with a
    `ZeroSNRSchedule`-like `schedule`) or "flow" (with a flow-matching schedule such as
    `models.wan.diffusion.WanFlowMatching`: noising, shifted noise levels, sampling grids); `schedule`: builds the
    training schedule, which the samplers step on too (`train.loss`, `sample.solvers`)."""

    prediction: str = "v"
    schedule: Callable[[], Any] = ZeroSNRSchedule

    def __post_init__(self) -> None:
        if self.prediction not in PREDICTIONS:
            raise ValueError(f"prediction {self.prediction!r}: the trainer and the samplers implement "
                             f"{', '.join(map(repr, PREDICTIONS))}")

    @property
    def solvers(self) -> tuple[str, ...]:
        """The values of `sample.solver` that step this objective's model."""
        return PREDICTIONS[self.prediction]


# the model's constructor: (preset, ttt settings, use_ttt, long-range layer kind) -> the module with its parameters
# on the current default device (`models.weights.init_model` calls it under torch.device("meta") and materialises)
BuildFn = Callable[[Any, "TTTConfig | None", bool, str], nn.Module]
# outside weights: (path, spec=preset or None for the folder's own, ttt=, use_ttt=, dtype=, device=,
# sequence_layer=) -> the model
PretrainedFn = Callable[..., nn.Module]


@dataclass(frozen=True)
class BackboneSpec:
    """One backbone: what `build_model`, the layout, the trainer and the sampler ask of it.

    - presets: name -> config (each a `BackboneConfig`; every name is unique over the registry)
    - config_type: the presets' dataclass (`backbone_of` finds the backbone of a config derived from a preset)
    - build: the model of a preset with random weights (`models.weights.init_model` materialises it)
    - from_pretrained: the model with outside weights (diffusers' layout for CogVideoX); None: none published
    - save_pretrained: (model, folder) -> folder: the backbone's weights written in the layout from_pretrained
      reads (benchmarks make full-size random-weight folders with it); None: none
    - layout: the layout parameters it asks for
    - objective: prediction and noise schedule
    - configure: settings of `[model]` that are the backbone's own (e.g. CogVideoX's compiled glue), applied to a
      built model
    - compiles_glue: whether a model built with these `[model]` settings torch.compiles code of its own on CUDA (a
      process that compiles forks Inductor's pool of compile workers, whose host memory the planner counts)
    - has_window_form: its blocks have a window-wise training form (checkpointing.attention_by_window with the TTT
      passes over token chunks, ttt_chunk_tokens), the memory technique `WINDOW_FORM` that the planner tries
    - vae / text_encoder: the kinds of VAE its latents come from and of text encoder its text features come from,
      keys of `sample.decode.VAE_DECODERS` and `text.encoders.TEXT_ENCODERS` (the loaders live in the layers that
      load them); None: none can be loaded (a backbone trained on the demo set alone)
    - check: raises a ConfigError (one sentence naming the key) for a setting of the config this backbone does not
      support; `check_backbone_settings` runs it after the checks every backbone shares
    """

    name: str
    presets: Mapping[str, Any]
    config_type: type
    build: BuildFn
    from_pretrained: PretrainedFn | None = None
    save_pretrained: Callable[[nn.Module, Any], Any] | None = None
    layout: LayoutParams = field(default_factory=LayoutParams)
    objective: Objective = field(default_factory=Objective)
    configure: Callable[[nn.Module, "ModelConfig"], None] = lambda model, cfg: None
    compiles_glue: Callable[["ModelConfig"], bool] = lambda cfg: False
    has_window_form: bool = False
    vae: str | None = None
    text_encoder: str | None = None
    check: Callable[["Config"], None] = lambda cfg: None

    def __post_init__(self) -> None:
        if isinstance(self.build, type) and not issubclass(self.build, Backbone):
            raise ValueError(f"backbone {self.name!r}: {self.build.__name__} is not a models.backbone.Backbone")
        for name, preset in self.presets.items():
            if preset.name != name:
                raise ValueError(f"backbone {self.name!r}: preset {name!r} is named {preset.name!r}")
            if not isinstance(preset, self.config_type):
                raise ValueError(f"backbone {self.name!r}: preset {name!r} is not a {self.config_type.__name__}")


_REGISTRY: dict[str, BackboneSpec] = {}
# the backbones tttvideo ships; each module registers itself on import
_BUILTIN = ("tttvideo.models.cogvideox", "tttvideo.models.wan")


def register_backbone(spec: BackboneSpec) -> BackboneSpec:
    """Add a backbone; its preset names become valid values of `model.preset` for `build_model` (a TOML config's
    `model.preset` is also checked against the schema's choices, which name the shipped presets)."""
    taken = {p: b.name for b in _REGISTRY.values() if b.name != spec.name for p in b.presets}
    clash = [p for p in spec.presets if p in taken]
    if clash:
        raise ValueError(f"backbone {spec.name!r}: preset(s) {', '.join(clash)} belong to {taken[clash[0]]!r}")
    _REGISTRY[spec.name] = spec
    return spec


def unregister_backbone(name: str) -> None:
    _REGISTRY.pop(name, None)


def backbones() -> dict[str, BackboneSpec]:
    for module in _BUILTIN:
        importlib.import_module(module)
    return dict(_REGISTRY)


def backbone_of(preset: str | Any) -> BackboneSpec:
    """The backbone of a preset name, or of a preset config (by its dataclass: tests derive configs of other sizes
    with dataclasses.replace)."""
    found = backbones().values()
    if isinstance(preset, str):
        for spec in found:
            if preset in spec.presets:
                return spec
        names = [p for spec in found for p in spec.presets]
        raise UserError(f"unknown model preset {preset!r}; use one of {', '.join(names)}")
    for spec in found:
        if isinstance(preset, spec.config_type):
            return spec
    raise UserError(f"no registered backbone takes a {type(preset).__name__} config")


def get_preset(name: str) -> Any:
    """The config of preset `name`, whichever backbone has it."""
    return backbone_of(name).presets[name]


def check_backbone_settings(cfg: "Config") -> BackboneSpec:
    """The backbone of a config, after checking that the config's settings are ones it supports: a ConfigError (one
    sentence naming the key and what to set) for a sampler of another objective (`sample.solver`) or for what the
    backbone's own `check` refuses."""
    spec = backbone_of(cfg.model.preset)
    solvers = spec.objective.solvers
    if cfg.sample.solver not in solvers:
        raise ConfigError(f"sample.solver = {cfg.sample.solver!r} steps another objective than the "
                          f"{spec.objective.prediction!r}-prediction of model.preset {cfg.model.preset!r} "
                          f"({spec.name}); set sample.solver to one of {', '.join(map(repr, solvers))}")
    spec.check(cfg)
    return spec


def layout_of(cfg: "Config", duration: str | int | None = None, phase: str = "train") -> VideoLayout:
    """The layout of a config (`[layout]`, `[ttt]`) for its backbone's layout parameters: `VideoLayout.from_config`
    with `BackboneSpec.layout`; `duration` (e.g. a story's) replaces layout.duration; `phase` ("train" or "sample")
    picks the TTT mini-batch. The trainer, the sampler and precompute all start here, so the config's settings are
    checked against the backbone here too (`check_backbone_settings`)."""
    return VideoLayout.from_config(cfg.layout, cfg.ttt, duration, phase=phase,
                                   backbone=check_backbone_settings(cfg).layout)
