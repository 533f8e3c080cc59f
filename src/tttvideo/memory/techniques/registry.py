"""The memory techniques the project offers, each one `MemoryTechnique` (`tttvideo.memory.techniques.technique`).

Training: activation checkpointing (whole blocks, keeping some outputs, or blocks and their four parts), nested
checkpointing (one saved input per span of units), activation offload to host memory (an exact-size pool), fp8
storage of the frozen weights, streaming those from host memory, 8-bit AdamW, the MLP over token chunks, Wan's
window-wise block form, and on several GPUs sequence parallelism. Sampling: fp8 storage (of every linear with
sample.fp8_linears = 'all'), the chunked (bounded-memory) forward, the guidance's two passes batched, in turn, or
split over two groups of GPUs, blocks streamed from host memory, sequence parallelism.
`REGISTRY` holds them in the order the OOM advice lists savings of equal size and the calibration runs its setups.
"""

from __future__ import annotations

from tttvideo.config.schema import Config
from tttvideo.memory.techniques.activations import (ACTIVATION_OFFLOAD, CHECKPOINTING, FFN_CHUNKS, NESTED_CHECKPOINTING,
                                                    WINDOW_FORM)
from tttvideo.memory.techniques.parallel import SEQUENCE_PARALLEL
from tttvideo.memory.techniques.sampling import CHUNKED_INFERENCE, GUIDANCE_PASSES, SAMPLE_BLOCK_OFFLOAD
from tttvideo.memory.techniques.technique import CalibrationSetup, MemoryTechnique, Phase
from tttvideo.memory.techniques.weights import ADAMW_8BIT, FP8_EVERY_LINEAR, FP8_STREAMING, FP8_WEIGHTS


REGISTRY: tuple[MemoryTechnique, ...] = (FP8_WEIGHTS, ADAMW_8BIT, FP8_STREAMING, CHECKPOINTING, ACTIVATION_OFFLOAD,
                                         NESTED_CHECKPOINTING, FFN_CHUNKS, WINDOW_FORM, SEQUENCE_PARALLEL,
                                         CHUNKED_INFERENCE, GUIDANCE_PASSES, SAMPLE_BLOCK_OFFLOAD, FP8_EVERY_LINEAR)


def check_techniques(cfg: Config, processes: int) -> None:
    """A ConfigError naming the key when a technique that is on cannot apply to a launch of `processes`."""
    for technique in REGISTRY:
        if technique.check is not None:
            technique.check(cfg, processes)


def techniques(phase: Phase) -> tuple[MemoryTechnique, ...]:
    """The registered techniques that apply to `phase`, in registry order."""
    return tuple(t for t in REGISTRY if phase in t.phases)


def calibration_setups() -> list[CalibrationSetup]:
    """Every technique's calibration setups, in run order."""
    return sorted((s for t in REGISTRY for s in t.calibration), key=lambda s: s.order)
