"""What a memory technique is: one object that says everything the rest of the project asks of it.

A `MemoryTechnique` names the config keys it reads, whether it is on, the settings the planner may try (`Option`s,
each a typed setter of a Config), how it is applied to a model built for training (`prepare`, delegating to the
mechanism in `tttvideo.models`; the other techniques are applied where their keys are read: the model build, the
training step, the sampler), what it changes in the memory the planner counts (`footprint`, a function of the
model's tensors), its cost regime (whether it needs activation curves of its own: `regime`, `regime_tag`), the
setups that calibrate or check those costs (`calibration`), and the out-of-memory advice of a run where it is off
(`advice`). The registry (`tttvideo.memory.techniques.registry`) lists them; the trainer's step assembly, the
profiler's drivers, the planner, the OOM message and benchmarks/plan_calibration.py all read it.

The bytes of optimizer state are counted here once (`optimizer_state_bytes`), for the planner and the OOM advice
alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from tttvideo.config.schema import Config, Optimizer

if TYPE_CHECKING:
    from torch import nn

Phase = Literal["train", "sample"]
# What a technique changes in a prediction: "activation" -- what a step allocates beyond the counted tensors, so it
# has measured curves of its own (its `regime_tag` is part of the cost key); "counted" -- only the counted weights,
# gradients or optimizer state (the curves of the activation regime it runs in apply); "parallel" -- the tokens and
# counted tensors per GPU (a measured efficiency per degree).
Regime = Literal["activation", "counted", "parallel"]

# torchao's AdamW8bit quantizes both moments of a tensor of at least this many values whose count is a multiple of
# the block; each block of values has one fp32 scale. Smaller or ragged tensors keep plain moments.
Q_MIN_SIZE, Q_BLOCK = 4096, 256


def quantised_by_adamw8bit(numel: int) -> bool:
    """Whether torchao's AdamW8bit keeps 8-bit moments for a tensor of `numel` values."""
    return numel >= Q_MIN_SIZE and numel % Q_BLOCK == 0


def optimizer_state_bytes(optimizer: Optimizer, numel: int, element_size: int) -> int:
    """Bytes of both moments of one parameter tensor of `numel` values (`element_size` bytes each) under
    `optimizer`: AdamW's in the parameter's dtype; 8-bit AdamW's (torchao) 1 byte per value plus one fp32 scale per
    256 values where torchao quantizes, else AdamW's. The optimizers' scalar step counters are left out."""
    if optimizer == "adamw8bit" and quantised_by_adamw8bit(numel):
        return 2 * (numel + 4 * (numel // Q_BLOCK))
    return 2 * element_size * numel


@dataclass(frozen=True)
class ModelBytes:
    """What the counts need from one model (all bytes unless said otherwise), whole (not sharded)."""

    weights: int  # parameters and buffers
    buffers: int
    block: int  # one block's parameters and buffers
    blocks: int  # the number of blocks
    fp8: int  # fp8 codes and scales of the frozen linears stored in fp8
    block_fp8: int  # of one block
    frozen_linear_saving: int  # what fp8 storage would free of the frozen plain nn.Linear weights
    trainable: int  # a count of values
    trainable_tensors: int  # a count of tensors (an 8-bit AdamW step costs per tensor: memory.plan.optimizer_time)
    gradients: int
    optimizer: dict[str, int]  # both moments of every trainable tensor, per optimizer
    dim: int  # width of the residual stream (0 when the model does not say)
    # what fp8 storage would free of the trainable plain nn.Linear weights, in all and in one block (sampling with
    # sample.fp8_linears = 'all', where nothing trains)
    trainable_linear_saving: int = 0
    block_trainable_linear_saving: int = 0

    @classmethod
    def of(cls, model: nn.Module) -> ModelBytes:
        from torch import nn

        from tttvideo.models.fp8_storage import fp8_code_bytes

        def nbytes(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        blocks = list(getattr(model, "blocks", ()))
        block = blocks[0] if blocks else nn.Module()
        trainable = [p for p in model.parameters() if p.requires_grad]

        def fp8_saving(module: nn.Module, trainable: bool) -> int:
            # fp8 storage: 1 byte a value and one fp32 scale per output row instead of the weight's dtype
            return sum(m.weight.numel() * (m.weight.element_size() - 1) - 4 * m.weight.shape[0]
                       for m in module.modules() if type(m) is nn.Linear and m.weight.requires_grad == trainable)

        spec = getattr(model, "spec", None)
        return cls(weights=nbytes(model.parameters()) + nbytes(model.buffers()), buffers=nbytes(model.buffers()),
                   block=nbytes(block.parameters()) + nbytes(block.buffers()), blocks=len(blocks),
                   fp8=fp8_code_bytes(model), block_fp8=fp8_code_bytes(block),
                   frozen_linear_saving=fp8_saving(model, False),
                   trainable=sum(p.numel() for p in trainable), trainable_tensors=len(trainable),
                   gradients=nbytes(trainable),
                   optimizer={name: sum(optimizer_state_bytes(name, p.numel(), p.element_size()) for p in trainable)
                              for name in get_args(Optimizer)},
                   dim=getattr(spec, "dim", 0), trainable_linear_saving=fp8_saving(model, True),
                   block_trainable_linear_saving=fp8_saving(block, True))


@dataclass(frozen=True)
class Footprint:
    """What a technique changes in the counted memory of one GPU (bytes; negative: less), and what it puts in host
    memory instead."""

    weights: int = 0  # parameters and buffers on the GPU
    buffers: int = 0  # of which buffers (FSDP2 keeps buffers whole on every GPU)
    optimizer: int = 0
    host: int = 0


@dataclass(frozen=True)
class Option:
    """One setting of a technique the planner may try: its label in a candidate's name and how it sets a Config."""

    label: str
    apply: Callable[[Config], None]
    keys: tuple[str, ...]  # the config keys `apply` sets ("section.name"), which a plan file writes


@dataclass
class Saving:
    """One line of out-of-memory advice: a switch that is off and what turning it on would free."""

    switch: str  # the setting that saves it, as the user writes it
    what: str  # what it moves or shrinks
    nbytes: int | None = None  # counted from the model; None where only a run measures it


@dataclass(frozen=True)
class CalibrationSetup:
    """A setup benchmarks/plan_calibration.py profiles: a config file, a phase, `--set` overrides, the durations
    whose measurements build the cost curves and those held out to check them."""

    name: str
    config: str  # relative to the repository root
    phase: Phase
    overrides: tuple[str, ...]
    calibrate: tuple[str, ...]
    held_out: tuple[str, ...] = ()
    order: int = 0  # run order: the setups last in it are the first to go when device time runs short


def _never(cfg: Config) -> bool:
    return False


def _no_options(cfg: Config, phase: Phase, gpus: int) -> tuple[Option, ...]:
    return ()


def _no_advice(cfg: Config, model: nn.Module, phase: Phase, gpus: int) -> list[Saving]:
    return []


@dataclass(frozen=True)
class MemoryTechnique:
    """A way to trade time (or precision) for GPU memory; see the module's docstring for what each part is for."""

    name: str
    phases: tuple[Phase, ...]
    keys: tuple[str, ...]  # the config keys it owns ("section.name"): those a planner option sets
    mechanism: str  # where it is implemented (a module or function), for the docs and readers
    is_on: Callable[[Config], bool] = _never
    options: Callable[[Config, Phase, int], Sequence[Option]] = _no_options  # (cfg, phase, gpus) -> settings to try
    regime: Regime = "counted"
    regime_tag: Callable[[Config], str] | None = None  # its part of the activation cost key ("activation" regime)
    footprint: Callable[[Config, Phase, ModelBytes], Footprint] | None = None  # with it on, against it off
    advice: Callable[[Config, nn.Module, Phase, int], list[Saving]] = _no_advice  # (cfg, model, phase, gpus)
    check: Callable[[Config, int], None] | None = None  # (cfg, processes): a ConfigError where it cannot apply
    prepare: Callable[[Config, nn.Module], int] | None = None  # on a model built for training: bytes moved off GPU
    prepared: str = ""  # what `prepare` did, as the profiler names the component
    calibration: tuple[CalibrationSetup, ...] = ()
    lossy: bool = False  # it rounds numbers (fp8 weights, 8-bit optimizer state)
    streams_weights: bool = False  # it copies weights in from host memory layer by layer every step
    uses_host: bool = False  # it keeps training state in host memory (pinned, out of other processes' reach)
