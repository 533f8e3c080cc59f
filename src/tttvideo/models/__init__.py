"""The models: backbones (`models/cogvideox/`, registered in `models.backbone`) and what every backbone shares:
the model build, weights and checkpoints, adapters, activation checkpointing, fp8 storage, activation offload,
segment-local attention and chunked inference."""

from tttvideo.models.adapters import apply_adapter, parameter_group, print_trainable_summary, trainable_summary
from tttvideo.models.backbone import Backbone, BackboneSpec, backbone_of, get_preset, layout_of, register_backbone
from tttvideo.models.build import build_model
from tttvideo.models.checkpointing import apply_checkpointing
from tttvideo.models.cogvideox import PRESETS, CogVideoXTTT, ModelSpec, from_pretrained
from tttvideo.models.weights import init_model, load_checkpoint, save_checkpoint

__all__ = [
    "PRESETS",
    "Backbone",
    "BackboneSpec",
    "CogVideoXTTT",
    "ModelSpec",
    "apply_adapter",
    "apply_checkpointing",
    "backbone_of",
    "build_model",
    "from_pretrained",
    "get_preset",
    "init_model",
    "layout_of",
    "load_checkpoint",
    "parameter_group",
    "print_trainable_summary",
    "register_backbone",
    "save_checkpoint",
    "trainable_summary",
]
