"""Sampling techniques: the chunked (bounded-memory) forward, the guidance's two passes batched, in turn or split
over two groups of GPUs, and blocks streamed from host memory."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tttvideo.config.schema import Config
from tttvideo.memory.techniques.common import SAMPLE, SAMPLE_PLAIN, setting
from tttvideo.memory.techniques.technique import (CalibrationSetup, Footprint, MemoryTechnique, ModelBytes, Option,
                                                  Phase, Saving)

if TYPE_CHECKING:
    from torch import nn


# ------------------------------------------------------------------------------------------- chunked inference
_CHUNKED_KEYS = ("memory.chunked_inference", "memory.ttt_head_groups")


def _set_chunked(groups: int):
    def apply(cfg: Config) -> None:
        cfg.memory.chunked_inference = groups > 0
        if groups:
            cfg.memory.ttt_head_groups = groups
            cfg.sample.cfg_batched = False  # the chunked forward runs one pass at a time

    return apply


CHUNKED_INFERENCE = MemoryTechnique(
    name="chunked inference",
    phases=("sample",),
    keys=_CHUNKED_KEYS,
    mechanism="tttvideo.models.chunked_inference, chosen by the model's forward without gradients",
    is_on=lambda cfg: cfg.memory.chunked_inference,
    # plain (off) leaves the head groups as they are; its guidance is the next technique's
    # (the chunked forward runs in one process or with parallel.sp = 1: the planner proposes it on one GPU)
    options=lambda cfg, phase, gpus: (
        Option("plain", _set_chunked(0), ("memory.chunked_inference",)),
        *((Option("chunked", _set_chunked(1), (*_CHUNKED_KEYS, "sample.cfg_batched")),
           Option("chunked, 2 head groups", _set_chunked(2), (*_CHUNKED_KEYS, "sample.cfg_batched")),
           Option("chunked, 4 head groups", _set_chunked(4), (*_CHUNKED_KEYS, "sample.cfg_batched")))
          if gpus == 1 else ()),
    ) if phase == "sample" else (),
    regime="activation",
    regime_tag=lambda cfg: f"chunked-g{cfg.memory.ttt_head_groups}" if cfg.memory.chunked_inference else "",
    calibration=(
        CalibrationSetup("sample: chunked, bf16 resident", SAMPLE, "sample",
                         ("sample.offload_blocks=false", "model.frozen_weights=dtype"), ("9s", "63s"),
                         ("3s", "18s"), order=6),
        CalibrationSetup("sample: chunked, 2 head groups, fp8 streamed", SAMPLE, "sample",
                         ("memory.ttt_head_groups=2",), ("9s", "63s"), order=8),
        CalibrationSetup("sample: chunked, 4 head groups, fp8 streamed", SAMPLE, "sample",
                         ("memory.ttt_head_groups=4",), ("9s", "63s"), ("3s",), order=9),
    ),
)


# ------------------------------------------------------------------------------------------- the guidance's passes
GUIDANCE_PASSES = MemoryTechnique(
    name="guidance passes",
    phases=("sample",),
    keys=("sample.cfg_batched", "sample.split_guidance"),
    mechanism="tttvideo.sample.guidance (batched, in turn, or split over two rank groups under torchrun)",
    is_on=lambda cfg: not cfg.sample.cfg_batched or cfg.sample.split_guidance,
    # one GPU: batched (the memory of batch 2) or two passes; several GPUs: split over two halves of them, each rank
    # running one pass (costed by the measured batched regime)
    options=lambda cfg, phase, gpus: (
        setting("guidance batched", "sample.cfg_batched", True),
        setting("two passes", "sample.cfg_batched", False),
        *((setting("not split", "sample.split_guidance", False),
           setting("guidance split", "sample.split_guidance", True)) if gpus > 1 else ()),
    ) if phase == "sample" else (),
    regime="activation",
    regime_tag=lambda cfg: "plain-b2" if cfg.sample.cfg_batched else "plain-b1",
    calibration=(
        # sampling is planned up to 63 s, so its curves run to 63 s (the plain forward's per-token cost measured
        # 205-210 KB at 3-18 s and 173 KB at 63 s: a line through 3 and 9 s alone overshoots 63 s by 18%)
        CalibrationSetup("sample: plain, guidance batched, bf16 resident", SAMPLE, "sample", SAMPLE_PLAIN,
                         ("9s", "18s", "63s"), ("3s",), order=5),
    ),
)


# ------------------------------------------------------------------------------------------- sample block offload
def resident_blocks(cfg: Config, b: ModelBytes) -> int:
    """Blocks on the GPU at once with `sample.offload_blocks`: the running one and `prefetch_blocks` copied ahead
    (`tttvideo.sample.offload`), at most the model's blocks."""
    return min(cfg.sample.prefetch_blocks + 1, b.blocks)


def _offload_blocks_footprint(cfg: Config, phase: Phase, b: ModelBytes) -> Footprint:
    if phase != "sample":
        return Footprint()
    return Footprint(weights=(resident_blocks(cfg, b) - b.blocks) * b.block, host=b.blocks * b.block)


def _offload_blocks_advice(cfg: Config, model: nn.Module, phase: Phase, gpus: int) -> list[Saving]:
    if phase != "sample" or cfg.sample.offload_blocks:
        return []
    freed = -_offload_blocks_footprint(cfg, phase, ModelBytes.of(model)).weights
    return [Saving("sample.offload_blocks = true", "of block weights kept in host memory", freed)] if freed > 0 else []


SAMPLE_BLOCK_OFFLOAD = MemoryTechnique(
    name="sample block offload",
    phases=("sample",),
    keys=("sample.offload_blocks",),
    mechanism="tttvideo.sample.offload.offload_blocks, in tttvideo.sample.model.load_model",
    is_on=lambda cfg: cfg.sample.offload_blocks,
    # streaming runs one process
    options=lambda cfg, phase, gpus: tuple(setting(label, "sample.offload_blocks", on)
                                           for label, on in (("resident", False), ("streamed", True))
                                           if gpus == 1 or not on) if phase == "sample" else (),
    footprint=_offload_blocks_footprint,
    advice=_offload_blocks_advice,
    streams_weights=True,
    calibration=(
        CalibrationSetup("sample: chunked, fp8 streamed", SAMPLE, "sample", (), (), ("63s",), order=7),
    ),
)
