"""One optimizer step: the only place where gradients are accumulated, scaled, checked, clipped and applied.

`TrainStep` runs `grad_accum` micro-batches (forward, then backward of loss / grad_accum through the gradient
scaler), checks the loss for NaN / Inf, unscales, clips the global gradient norm (or only measures it when
clipping is off), steps the optimizer through the scaler and advances the LR schedule. The trainer, the memory
profiler's train driver and benchmarks/model_step.py all run it, so what they time or measure is what trains.

A profiler passed as `profiler` sees the step's phases (`FORWARD`, `BACKWARD`, `OPTIMIZER`) as context managers
opened around the real work; without one no phase is opened at all.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from tttvideo.data.loader import to_device
from tttvideo.diffusion import ZeroSNRSchedule
from tttvideo.layout import VideoLayout
from tttvideo.train.loss import NoiseSource, diffusion_loss

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer step"

Batch = dict[str, Any]
# (model, micro-batch on the device, index of the micro-batch in the step) -> scalar loss
Objective = Callable[[nn.Module, Batch, int], torch.Tensor]


class StepProfiler(Protocol):
    """What the step asks of a profiler: a context manager per phase (`tttvideo.memory.profiler.MemoryProfiler`
    is one)."""

    def phase(self, name: str, step: int | None = None) -> AbstractContextManager[Any]: ...


_NO_PHASE = contextlib.nullcontext()


def _no_phase(name: str, step: int | None = None) -> AbstractContextManager[Any]:
    return _NO_PHASE


@dataclass
class StepResult:
    loss: float  # mean over the micro-batches; on a non-finite step, the first non-finite micro-batch loss
    grad_norm: float  # global norm before clipping; NaN when the step was skipped
    finite: bool


@dataclass
class DiffusionObjective:
    """The training loss of one micro-batch: `diffusion_loss` with its timesteps stratified over the optimizer
    step's effective batch, micro-batch `micro` of this rank taking strata from (micro x world_size + rank) x
    batch_size on."""

    schedule: ZeroSNRSchedule
    noise: NoiseSource
    layout: VideoLayout
    text_dropout: float
    precision: str
    batch_size: int
    global_batch: int
    rank: int = 0
    world_size: int = 1

    def __call__(self, model: nn.Module, batch: Batch, micro: int) -> torch.Tensor:
        first = (micro * self.world_size + self.rank) * self.batch_size
        loss, _ = diffusion_loss(model, batch, self.schedule, self.noise, self.layout, self.text_dropout, first,
                                 self.global_batch, self.precision)
        return loss


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """The gradient scaler of a precision: active for fp16 only, a pass-through otherwise."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


class TrainStep:
    """Accumulate, check, clip and apply: one optimizer step of `model` on `grad_accum` micro-batches."""

    def __init__(self, model: nn.Module, objective: Objective, optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler, device: torch.device, *, grad_accum: int = 1, grad_clip: float = 0.0,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                 profiler: StepProfiler | None = None):
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

    def __call__(self, batches: Iterator[Batch], step: int) -> StepResult:
        """Optimizer step `step` (0-based, for the profiler) on the next grad_accum batches of `batches`. A
        non-finite loss leaves the weights as they were, still advances the schedule, and has drawn all
        grad_accum batches, so the data position and every RNG stream stay where a finite step leaves them."""
        loss, finite = self.gradients(batches, step)
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            with warnings.catch_warnings():  # a skipped step still advances the schedule; torch warns about that
                warnings.simplefilter("ignore", UserWarning)
                self._advance_schedule()
            return StepResult(loss, math.nan, False)
        return StepResult(loss, self.apply(step), True)

    def gradients(self, batches: Iterator[Batch], step: int) -> tuple[float, bool]:
        """Fresh gradients of the mean loss over grad_accum micro-batches; (mean loss, finite). Stops at the first
        non-finite micro-batch (returning its loss) after drawing the batches it leaves."""
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in range(self.grad_accum):
            batch = to_device(next(batches), self.device)
            with self._phase(FORWARD, step):
                loss = self.objective(self.model, batch, micro)
            value = loss.item()
            if not math.isfinite(value):
                for _ in range(micro + 1, self.grad_accum):
                    next(batches)
                return value, False
            total += value / self.grad_accum
            with self._phase(BACKWARD, step):
                self.scaler.scale(loss / self.grad_accum).backward()
        return total, True

    def apply(self, step: int) -> float:
        """Unscale, clip (or only measure) the global gradient norm, step the optimizer and the schedule; returns
        the norm before clipping."""
        with self._phase(OPTIMIZER, step):
            self.scaler.unscale_(self.optimizer)
            if self.grad_clip > 0:
                norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
            else:
                norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.params
                                                             if p.grad is not None]))
            grad_norm = float(norm)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self._advance_schedule()
        return grad_norm

    def _advance_schedule(self) -> None:
        if self.scheduler is not None:
            self.scheduler.step()
