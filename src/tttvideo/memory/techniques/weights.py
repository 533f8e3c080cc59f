"""Techniques on weights and optimizer state: fp8 storage of the frozen weights (of every linear when sampling with
sample.fp8_linears = 'all'), streaming those from host memory, and 8-bit AdamW."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tttvideo.config.schema import Config
from tttvideo.errors import ConfigError
from tttvideo.memory.techniques.common import BLOCK, FP32_AUTOCAST, LORA, QKVO, setting
from tttvideo.memory.techniques.sampling import resident_blocks
from tttvideo.memory.techniques.technique import (CalibrationSetup, Footprint, MemoryTechnique, ModelBytes, Phase,
                                                  Saving)

if TYPE_CHECKING:
    from torch import nn


# ------------------------------------------------------------------------------------------- fp8 frozen weights
def _fp8_advice(cfg: Config, model: nn.Module, phase: Phase, gpus: int) -> list[Saving]:
    if cfg.model.frozen_weights == "fp8":
        return []
    saved = ModelBytes.of(model).frozen_linear_saving
    return [Saving("model.frozen_weights = 'fp8'", "of frozen linear weights", saved)] if saved > 0 else []


def _fp8_storages(cfg: Config, phase: Phase) -> tuple[str, ...]:
    if cfg.model.adapter == "sft":  # it trains every weight: none is frozen
        return ("dtype",)
    if phase == "sample" and cfg.sample.fp8_linears == "all":  # every linear in fp8 needs the fp8 storage
        return ("fp8",)
    return ("dtype", "fp8")


FP8_WEIGHTS = MemoryTechnique(
    name="fp8 frozen weights",
    phases=("train", "sample"),
    keys=("model.frozen_weights",),
    # the planner builds the model with the setting, so its counted weights are the fp8 codes and scales
    mechanism="tttvideo.models.fp8_storage.store_fp8, in build_model",
    is_on=lambda cfg: cfg.model.frozen_weights == "fp8",
    options=lambda cfg, phase, gpus: tuple(setting(s, "model.frozen_weights", s) for s in _fp8_storages(cfg, phase)),
    advice=_fp8_advice,
    lossy=True,
    calibration=(
        CalibrationSetup("lora, block ckpt, fp8, 8-bit AdamW", LORA, "train",
                         BLOCK + ("checkpointing.offload_activations=false",), (), ("3s", "9s"), order=10),
    ),
)


# ------------------------------------------------------------------------------------------- fp8 every linear
def _fp8_every_linear_footprint(cfg: Config, phase: Phase, b: ModelBytes) -> Footprint:
    if phase != "sample" or cfg.model.frozen_weights != "fp8":
        return Footprint()
    saving = b.trainable_linear_saving
    if cfg.sample.offload_blocks:  # only the blocks on the GPU count there (SAMPLE_BLOCK_OFFLOAD's footprint)
        saving -= (b.blocks - resident_blocks(cfg, b)) * b.block_trainable_linear_saving
    return Footprint(weights=-saving)


FP8_EVERY_LINEAR = MemoryTechnique(
    name="fp8 every linear (sampling)",
    phases=("sample",),
    keys=("sample.fp8_linears",),
    # the planner's model is built for training (the adapter's trainable layers in the model dtype): the footprint
    # takes those to fp8 as the sampler does once the weights are loaded
    mechanism="tttvideo.models.fp8_storage.store_every_linear_fp8, in tttvideo.sample.model.load_model",
    is_on=lambda cfg: cfg.sample.fp8_linears == "all",
    # no options: it trades output error for speed more than for memory (docs/model.md), the user's call
    footprint=_fp8_every_linear_footprint,
    lossy=True,
)


# ------------------------------------------------------------------------------------------- fp8 weight streaming
def _stream_footprint(cfg: Config, phase: Phase, b: ModelBytes) -> Footprint:
    if phase != "train" or cfg.model.frozen_weights != "fp8":
        return Footprint()
    # the block computing and the one whose backward comes next stay on the GPU
    kept = 2 * b.block_fp8
    return Footprint(weights=kept - b.fp8, buffers=kept - b.fp8, host=b.fp8)


def _stream_advice(cfg: Config, model: nn.Module, phase: Phase, gpus: int) -> list[Saving]:
    if phase != "train" or cfg.model.frozen_weights != "fp8" or cfg.memory.stream_frozen_weights or gpus != 1:
        return []
    return [Saving("memory.stream_frozen_weights = true", "of fp8 frozen weights kept in host memory",
                   -_stream_footprint(cfg, phase, ModelBytes.of(model)).weights)]


def _check_stream(cfg: Config, processes: int) -> None:
    from tttvideo.models.fp8_storage import check_weight_streaming

    check_weight_streaming(cfg, processes)


def _stream(cfg: Config, model: nn.Module) -> int:
    from tttvideo.models.fp8_storage import stream_fp8_weights

    return stream_fp8_weights(model)


FP8_STREAMING = MemoryTechnique(
    name="fp8 weight streaming",
    phases=("train",),
    keys=("memory.stream_frozen_weights",),
    mechanism="tttvideo.models.fp8_storage.stream_fp8_weights, applied by tttvideo.train.step.build_train_step",
    is_on=lambda cfg: cfg.memory.stream_frozen_weights,
    # streaming runs in one process
    options=lambda cfg, phase, gpus: (setting("", "memory.stream_frozen_weights", False),) + (
        (setting("streamed", "memory.stream_frozen_weights", True),) if gpus == 1 else ())
    if phase == "train" else (),
    footprint=_stream_footprint,
    advice=_stream_advice,
    check=_check_stream,
    prepare=_stream,
    prepared="frozen fp8 weights streamed to pinned host memory",
    streams_weights=True,
    calibration=(
        CalibrationSetup("lora, sub-block ckpt + offload, fp8 streamed, 8-bit AdamW", LORA, "train",
                         ("memory.stream_frozen_weights=true",), (), ("9s",), order=2),
    ),
)


# ------------------------------------------------------------------------------------------- 8-bit AdamW
def _optimizer_footprint(cfg: Config, phase: Phase, b: ModelBytes) -> Footprint:
    return Footprint(optimizer=b.optimizer["adamw8bit"] - b.optimizer["adamw"]) if phase == "train" else Footprint()


STOCHASTIC_ROUND_NEEDS_8BIT = ("train.bf16_stochastic_round needs train.optimizer = 'adamw8bit' (torchao's update "
                               "does the rounding); set it, or set train.bf16_stochastic_round = false")


def check_stochastic_round(cfg: Config, processes: int = 1) -> None:
    if cfg.train.bf16_stochastic_round and cfg.train.optimizer != "adamw8bit":
        raise ConfigError(STOCHASTIC_ROUND_NEEDS_8BIT)


ADAMW_8BIT = MemoryTechnique(
    name="8-bit AdamW",
    phases=("train",),
    keys=("train.optimizer",),
    mechanism="tttvideo.train.optim.build_optimizer (torchao's AdamW8bit)",
    is_on=lambda cfg: cfg.train.optimizer == "adamw8bit",
    # stochastic rounding is torchao's: with it on, only the 8-bit update is a candidate
    options=lambda cfg, phase, gpus: tuple(setting(n, "train.optimizer", n)
                                           for n in ("adamw", "adamw8bit")
                                           if n == "adamw8bit" or not cfg.train.bf16_stochastic_round)
    if phase == "train" else (),
    footprint=_optimizer_footprint,
    check=check_stochastic_round,
    advice=lambda cfg, model, phase, gpus: [] if phase != "train" or cfg.train.optimizer == "adamw8bit" else [
        Saving("train.optimizer = 'adamw8bit'", "of optimizer state",
               -_optimizer_footprint(cfg, phase, ModelBytes.of(model)).optimizer)],
    lossy=True,
    calibration=(
        CalibrationSetup("qkvo, sub-block ckpt, fp32 weights, 8-bit AdamW", QKVO, "train",
                         FP32_AUTOCAST + ("train.optimizer=adamw8bit",), (), ("9s",), order=13),
    ),
)
