"""One optimizer step: the only place where gradients are accumulated, scaled, checked, clipped and applied.

`TrainStep` runs `grad_accum` micro-batches (forward, then backward of loss / grad_accum through the gradient
scaler), checks the loss for NaN / Inf, unscales, clips the global gradient norm (or only measures it when
clipping is off), steps the optimizer through the scaler and advances the LR schedule. `build_train_step` assembles
it from a config, the one place that does: the trainer, the memory profiler's train driver and
benchmarks/model_step.py all call it, so what they time or measure is what trains.

A profiler passed as `profiler` sees the step's phases (`FORWARD`, `BACKWARD`, `OPTIMIZER`) as context managers
opened around the real work; without one no phase is opened at all.

With `offload=True` (`checkpointing.offload_activations`) each micro-batch's forward runs under
`tttvideo.models.activation_offload.offload_activations`: what autograd saves for backward (tensors of at least
`OFFLOAD_MIN_BYTES`, not the weights) waits in host memory until backward copies it back; the gradients are the same.
The host buffers come from one pool for the whole run, bounded by `checkpointing.offload_host_gib`: what does not
fit stays on the device.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from tttvideo.data.loader import to_device
from tttvideo.diffusion import FlowMatchingSchedule, ZeroSNRSchedule, is_flow_matching
from tttvideo.layout import VideoLayout
from tttvideo.models.activation_offload import host_pool_for, offload_activations
from tttvideo.train.loss import NoiseSource, diffusion_loss

if TYPE_CHECKING:
    from tttvideo.config.schema import Config
    from tttvideo.parallel import SequenceParallel
    from tttvideo.train.distributed import TrainRanks

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer step"
# saved tensors smaller than this stay on the device under offload: a copy each way costs more than they free
OFFLOAD_MIN_BYTES = 1 << 20

Batch = dict[str, Any]
# (model, micro-batch on the device, index of the micro-batch in the step) -> scalar loss
Objective = Callable[[nn.Module, Batch, int], torch.Tensor]


class StepProfiler(Protocol):
    """What the step asks of a profiler: a context manager per phase (`tttvideo.memory.profile.profiler.MemoryProfiler`
    is one)."""

    def phase(self, name: str, step: int | None = None) -> AbstractContextManager[Any]: ...


class StepReduce(Protocol):
    """What the step asks of several processes (`tttvideo.train.distributed.TrainRanks` is one): that they agree
    whether a micro-batch's loss is finite on all of them, and the mean of a value over them."""

    def all_true(self, flag: bool) -> bool: ...

    def mean(self, value: float) -> float: ...


_NO_PHASE = contextlib.nullcontext()


def _no_phase(name: str, step: int | None = None) -> AbstractContextManager[Any]:
    return _NO_PHASE


@dataclass
class StepResult:
    loss: float  # mean over the micro-batches; on a non-finite step, the first non-finite micro-batch loss
    grad_norm: float  # global norm before clipping; NaN when the step was skipped
    finite: bool
    # where the step's wall time went, beside the model's forward and backward: waiting for the loader's batches
    # (and queueing their copies to the device), and the optimizer step (unscale, clip, step, schedule; timed from
    # the end of backward on the device to the end of the step's work queued on it)
    data_s: float = 0.0
    optimizer_s: float = 0.0


@dataclass
class DiffusionObjective:
    """The training loss of one micro-batch: `diffusion_loss` with its timesteps stratified over the optimizer
    step's effective batch, micro-batch `micro` of data-parallel rank `rank` (of `world_size`) taking strata from
    (micro x world_size + rank) x batch_size on.

    With several data-parallel ranks every rank draws the noise, timesteps and text dropout of all `world_size`
    micro-batches of a row (micro x world_size .. + world_size - 1) in that order and keeps its own, so that its
    generators advance exactly as one process's do over the same global batch: the losses equal the one-process
    run's, every rank ends a step (and writes a checkpoint) with the same generator state, and the ranks of a
    sequence-parallel group (same `rank`) draw the same values. `sp` is passed to the model's forward."""

    schedule: ZeroSNRSchedule | FlowMatchingSchedule  # the backbone's (`BackboneSpec.objective`)
    noise: NoiseSource
    layout: VideoLayout
    text_dropout: float
    precision: str
    batch_size: int
    global_batch: int
    rank: int = 0
    world_size: int = 1
    sp: SequenceParallel | None = None

    def __call__(self, model: nn.Module, batch: Batch, micro: int) -> torch.Tensor:
        row = micro * self.world_size
        for other in range(self.rank):  # the row's micro-batches before this rank's
            self._skip(batch["latents"], row + other)
        forward = model if self.sp is None else functools.partial(model, sp=self.sp)
        loss, _ = diffusion_loss(forward, batch, self.schedule, self.noise, self.layout, self.text_dropout,
                                 (row + self.rank) * self.batch_size, self.global_batch, self.precision)
        for other in range(self.rank + 1, self.world_size):  # and those after it
            self._skip(batch["latents"], row + other)
        return loss

    def _skip(self, latents: torch.Tensor, index: int) -> None:
        """Draw what the micro-batch `index` of the row (another rank's, of the shape of `latents`) draws, and drop
        it."""
        self.noise.draw(latents, self.schedule.num_train_timesteps, index * self.batch_size, self.global_batch,
                        self.text_dropout, continuous=is_flow_matching(self.schedule))


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA), so that a host clock read next times it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """The gradient scaler of a precision: active for fp16 only, a pass-through otherwise."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


class TrainStep:
    """Accumulate, check, clip and apply: one optimizer step of `model` on `grad_accum` micro-batches."""

    def __init__(self, model: nn.Module, objective: Objective, optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler, device: torch.device, *, grad_accum: int = 1, grad_clip: float = 0.0,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                 profiler: StepProfiler | None = None, reduce: StepReduce | None = None, offload: bool = False,
                 offload_host_gib: float = 0.0, host_held_back: int = 0):
        self.model = model
        self.objective = objective
        self.optimizer = optimizer
        self.scaler = scaler
        self.device = device
        self.grad_accum = grad_accum
        self.grad_clip = grad_clip
        self.scheduler = scheduler
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._phase = profiler.phase if profiler is not None else _no_phase
        # several processes: a non-finite loss on any rank skips the step on all (the gradient collectives need
        # every rank), the loss is reported as the mean over ranks, the gradients are FSDP's sharded DTensors
        self.reduce = reduce
        self.offload = offload
        # one pool of exact-size host buffers for the whole run (checkpointing.offload_host_gib bounds it; asking
        # for more than the host has, the compile workers' `host_held_back` left aside, is an error here, before any
        # step)
        self.host_pool = host_pool_for(offload_host_gib, held_back=host_held_back) if offload else None
        self.offloaded_bytes = 0  # what the last micro-batch's forward moved to host memory (with offload)
        self.kept_bytes = 0  # what stayed on the device because the host pool was full
        self.prepared: dict[str, int] = {}  # memory technique -> bytes it moved off the GPU (`build_train_step`)
        self.data_s = 0.0  # the current step's wait for batches (`StepResult.data_s`)

    def __call__(self, batches: Iterator[Batch], step: int) -> StepResult:
        """Optimizer step `step` (0-based, for the profiler) on the next grad_accum batches of `batches`. A
        non-finite loss leaves the weights as they were, still advances the schedule, and has drawn all
        grad_accum batches, so the data position and every RNG stream stay where a finite step leaves them."""
        self.data_s = 0.0
        loss, finite = self.gradients(batches, step)
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            with warnings.catch_warnings():  # a skipped step still advances the schedule; torch warns about that
                warnings.simplefilter("ignore", UserWarning)
                self._advance_schedule()
            return StepResult(loss, math.nan, False, self.data_s)
        synchronize(self.device)  # the backward's work done, so what follows is the optimizer's
        start = time.perf_counter()
        norm = self.apply(step)
        synchronize(self.device)
        return StepResult(loss, norm, True, self.data_s, time.perf_counter() - start)

    def gradients(self, batches: Iterator[Batch], step: int) -> tuple[float, bool]:
        """Fresh gradients of the mean loss over grad_accum micro-batches; (mean loss, finite). Stops at the first
        non-finite micro-batch (returning its loss) after drawing the batches it leaves."""
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in range(self.grad_accum):
            start = time.perf_counter()
            batch = to_device(next(batches), self.device)
            self.data_s += time.perf_counter() - start
            with self._phase(FORWARD, step), self._saved_tensors() as off:
                loss = self.objective(self.model, batch, micro)
            if off is not None:
                self.offloaded_bytes, self.kept_bytes = off.offloaded_bytes, off.kept_bytes
            value = loss.item()
            finite = math.isfinite(value) if self.reduce is None else self.reduce.all_true(math.isfinite(value))
            if not finite:
                for _ in range(micro + 1, self.grad_accum):
                    next(batches)
                return value, False
            total += value / self.grad_accum
            with self._phase(BACKWARD, step):
                self.scaler.scale(loss / self.grad_accum).backward()
        return (total if self.reduce is None else self.reduce.mean(total)), True

    def apply(self, step: int) -> float:
        """Unscale, clip (or only measure) the global gradient norm, step the optimizer and the schedule; returns
        the norm before clipping."""
        with self._phase(OPTIMIZER, step):
            self.scaler.unscale_(self.optimizer)
            if self.reduce is not None:
                norm = sharded_grad_norm(self.params, self.grad_clip)
            elif self.grad_clip > 0:
                norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
            else:
                norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.params
                                                             if p.grad is not None]))
            grad_norm = float(norm)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self._advance_schedule()
        return grad_norm

    def _saved_tensors(self) -> AbstractContextManager[offload_activations | None]:
        """Where the forward's saved tensors wait for backward: host memory with offload, else where they are.
        The model's own tensors (parameters, fp8 codes) always stay."""
        if not self.offload:
            return contextlib.nullcontext()
        return offload_activations(OFFLOAD_MIN_BYTES, keep=self.model, pool=self.host_pool)

    def _advance_schedule(self) -> None:
        if self.scheduler is not None:
            self.scheduler.step()


def build_train_step(cfg: Config, model: nn.Module, device: torch.device, layout: VideoLayout, noise: NoiseSource,
                     *, global_batch: int, grad_accum: int = 1, ranks: TrainRanks | None = None,
                     scheduled: bool = False, profiler: StepProfiler | None = None,
                     around_prepare: Callable[[str], AbstractContextManager[Any]] | None = None) -> TrainStep:
    """The training step of `cfg` on `model` (built, and under torchrun sharded): the memory techniques that change
    a built model applied (`MemoryTechnique.prepare`, e.g. the fp8 frozen weights streamed from host memory; each
    inside `around_prepare(what it does)` when given; what each moved in the step's `prepared`), the optimizer of
    train.optimizer over the trainer's parameter groups, the LR schedule when `scheduled`, the gradient scaler of
    train.precision, the diffusion objective of micro-batches of train.batch_size in an optimizer step of
    `global_batch` samples (this process data-parallel rank `ranks.dp_rank` of `ranks.dp_size`, with its sequence
    shards), clipping at train.grad_clip, and activation offload when it is on."""
    from tttvideo.memory.guard.compile_pool import compile_pool_bytes
    from tttvideo.memory.techniques import ACTIVATION_OFFLOAD, check_techniques, techniques
    from tttvideo.models.backbone import backbone_of
    from tttvideo.train.optim import build_optimizer, build_scheduler

    check_techniques(cfg, ranks.world_size if ranks is not None else 1)
    prepared = {}
    for technique in techniques("train"):
        if technique.prepare is not None and technique.is_on(cfg):
            with around_prepare(technique.prepared) if around_prepare else contextlib.nullcontext():
                prepared[technique.name] = technique.prepare(cfg, model)
    train = cfg.train
    optimizer = build_optimizer(model, train)
    rank, world, sp = (ranks.dp_rank, ranks.dp_size, ranks.sequence) if ranks is not None else (0, 1, None)
    schedule = backbone_of(cfg.model.preset).objective.schedule()
    objective = DiffusionObjective(schedule, noise, layout, train.text_dropout, train.precision,
                                   train.batch_size, global_batch, rank, world, sp)
    step = TrainStep(model, objective, optimizer, grad_scaler(device, train.precision), device,
                     grad_accum=grad_accum, grad_clip=train.grad_clip,
                     scheduler=build_scheduler(optimizer, train) if scheduled else None, profiler=profiler,
                     reduce=ranks if ranks is not None and ranks.distributed else None,
                     offload=ACTIVATION_OFFLOAD.is_on(cfg), offload_host_gib=cfg.checkpointing.offload_host_gib,
                     host_held_back=compile_pool_bytes(cfg, "train") if device.type == "cuda" else 0)
    step.prepared = prepared
    return step


def sharded_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """The global norm of FSDP's sharded gradients (each a DTensor: the norm of the whole tensor needs the other
    ranks' shards), clipping them to `max_norm` when it is positive."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
