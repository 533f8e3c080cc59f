"""The transformer as the sampler holds it: built from the config, a trained checkpoint on top (with the EMA weights
beside its model file over it, when it has them and `sample.use_ema`), optionally with its blocks streamed from
pinned CPU memory (`tttvideo.sample.offload`)."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tttvideo.config.schema import Config
from tttvideo.dtypes import sampling_dtype
from tttvideo.errors import ConfigError
from tttvideo.layout import VideoLayout
from tttvideo.models.backbone import Backbone
from tttvideo.runs import ema_file_beside, is_full_checkpoint, load_trained, resolve_checkpoint
from tttvideo.sample.offload import BlockOffloader
from tttvideo.sample.scenes import Story

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """The model in eval mode without gradients, and the block offloader that streams its weights (None when the
    blocks are resident). `close()` (or leaving a `with` block) removes the offloader's hooks."""

    model: Backbone
    offloader: BlockOffloader | None = None

    def close(self) -> None:
        if self.offloader is not None:
            self.offloader.close()
            self.offloader = None

    def __enter__(self) -> "LoadedModel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_model(cfg: Config, checkpoint: str | Path | None, device: torch.device, offload: bool = False) -> LoadedModel:
    """The transformer of `cfg.model`, with the weights of `checkpoint` (a tttvideo model file, checkpoint folder
    or run folder) on top; with `offload` the blocks stay in CPU memory and stream onto a CUDA device."""
    from tttvideo.memory.guard.cap import apply_memory_cap
    from tttvideo.models import build_model, load_checkpoint
    from tttvideo.models.fp8_storage import store_every_linear_fp8

    if cfg.sample.fp8_linears == "all" and cfg.model.frozen_weights != "fp8":
        raise ConfigError("sample.fp8_linears = 'all' stores every linear layer as model.frozen_weights = 'fp8' "
                          "stores the frozen ones; set model.frozen_weights = 'fp8' too, or sample.fp8_linears = "
                          "'frozen'")
    apply_memory_cap(cfg.memory, device)
    cfg = copy.deepcopy(cfg)
    dtype = sampling_dtype(cfg.model.dtype, cfg.sample.dtype, device.type == "cuda")
    if dtype != cfg.model.dtype:
        log.info("sampling in %s (sample.dtype = %r; the config's model.dtype is %s)", dtype, cfg.sample.dtype,
                 cfg.model.dtype)
        cfg.model.dtype = dtype
    model_file = resolve_checkpoint(checkpoint) if checkpoint else None
    if model_file is not None and is_full_checkpoint(model_file):
        cfg.model.pretrained_path = ""  # every weight comes from the checkpoint: skip loading the base model
    # adapters and activation checkpointing change nothing at inference but the parameter names a checkpoint
    # trained with them has; build exactly what was trained
    streamed = offload and device.type == "cuda"
    model = build_model(cfg, device=torch.device("cpu") if streamed else device, compute_device=device)
    if model_file is not None:
        load_trained(model, model_file, has_base=bool(cfg.model.pretrained_path))
        ema_file = ema_file_beside(model_file) if cfg.sample.use_ema else None
        if ema_file is not None:  # the moving average of the trainable weights (train.ema_decay) over them
            load_checkpoint(model, ema_file)
            log.info("sampling with the EMA weights of %s", ema_file.parent)
    model.eval().requires_grad_(False)
    if cfg.sample.fp8_linears == "all":
        on, layers = store_every_linear_fp8(model, device, cfg.model.fp8_matmul)
        log.info("sample.fp8_linears = 'all': %d linear layers in fp8, %d of them multiplying in fp8", layers, on)
    if not offload:
        return LoadedModel(model)
    if streamed:
        for name, child in model.named_children():
            if name != "blocks":
                child.to(device)
        return LoadedModel(model, BlockOffloader(model.blocks, device, prefetch=cfg.sample.prefetch_blocks))
    BlockOffloader(model.blocks, device)  # logs that offload is a no-op off CUDA
    return LoadedModel(model)


def warn_beyond_training(model_file: Path, stories: list[Story], layouts: list[VideoLayout]) -> None:
    """Say so when a story is longer than any video the checkpoint was trained on: TTT carries state across the
    whole video, and lengths it never saw in training are untested."""
    from tttvideo.models.weights import trained_duration

    trained = trained_duration(model_file)
    if trained is None:
        return
    for story, layout in zip(stories, layouts):
        if layout.duration_s > trained:
            log.warning("story %r is %d s long, but %s was trained on videos of at most %d s; expect the quality of "
                        "the later segments to suffer (train a longer stage, e.g. configs/cogvideox-5b/)",
                        story.name, layout.duration_s, model_file, trained)


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype
