"""CogVideoX with TTT layers: presets, the transformer, weights, adapters, activation checkpointing."""

from tttvideo.models.adapters import apply_adapter, parameter_group, print_trainable_summary, trainable_summary
from tttvideo.models.build import build_model
from tttvideo.models.checkpointing import apply_checkpointing
from tttvideo.models.presets import PRESETS, ModelSpec, get_preset
from tttvideo.models.transformer import CogVideoXTTT
from tttvideo.models.weights import from_pretrained, init_model, load_checkpoint, save_checkpoint

__all__ = [
    "PRESETS",
    "CogVideoXTTT",
    "ModelSpec",
    "apply_adapter",
    "apply_checkpointing",
    "build_model",
    "from_pretrained",
    "get_preset",
    "init_model",
    "load_checkpoint",
    "parameter_group",
    "print_trainable_summary",
    "save_checkpoint",
    "trainable_summary",
]
