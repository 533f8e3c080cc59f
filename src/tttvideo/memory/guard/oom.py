"""What a CUDA out-of-memory error tells the user: where it happened and which switches would make room.

`OomWatch(model)` follows a run: a forward pre-hook on every transformer block records the block running (in
forward, and in backward where a checkpointed block is recomputed), and `phase(name, step)` (a
`tttvideo.train.step.StepProfiler`) records the optimizer step's phase; `DenoiseWatch` follows a sampler's
denoising steps. `train_oom_error` / `sample_oom_error` turn what it saw into one `UserError` sentence: the phase,
the block when known, the newest checkpoint (training), and the switches not yet on, each with what it would save
counted from the model (frozen linear weights, optimizer state, block inputs, block weights), the largest first,
and the command that shows where memory goes (`tttv profile`). What each switch saves is its memory technique's
`advice` (`tttvideo.memory.techniques`), counted with the same byte rules as the planner's.

The counts are of the whole model: under FSDP each GPU holds its shard of the weights and optimizer state, so
divide those by the shard degree. Activations are not counted beyond the block inputs (the rest depends on the
kernels); `tttv profile` measures them.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tttvideo.config.schema import Config
from tttvideo.errors import UserError
from tttvideo.memory.techniques import Saving, techniques

GIB = 2**30
# the words each out-of-memory sentence begins with: benchmarks find a run that ran out of memory by them in its log
OUT_OF_GPU_MEMORY = "out of GPU memory"


class OutOfMemory(UserError):
    """The GPU ran out of memory; the message says where and what to switch on. `where`: the phase and block;
    `needed`: bytes per GPU it needed at least (reserved at the peak plus the allocation that failed; None off
    CUDA), what `tttv train --auto-fit` re-plans with."""

    def __init__(self, message: str, where: str = "", needed: int | None = None):
        super().__init__(message)
        self.where, self.needed = where, needed


_REQUEST = re.compile(r"Tried to allocate ([0-9.]+) (GiB|MiB|KiB|B)")


def needed_bytes(err: BaseException) -> int | None:
    """What a CUDA out-of-memory error shows was needed: the peak reserved memory plus the allocation that failed."""
    if not torch.cuda.is_available():
        return None
    m = _REQUEST.search(str(err))
    request = int(float(m.group(1)) * {"GiB": GIB, "MiB": 2**20, "KiB": 2**10, "B": 1}[m.group(2)]) if m else 0
    return torch.cuda.max_memory_reserved() + request


class OomWatch:
    """Block and phase of a running model, for the message of an out-of-memory error. `close()` removes the hooks."""

    def __init__(self, model: nn.Module):
        self.block: int | None = None
        self.running: str | None = None
        self.step: int | None = None
        blocks: Sequence[nn.Module] = getattr(model, "blocks", ())
        self.num_blocks = len(blocks)
        self._handles = [b.register_forward_pre_hook(functools.partial(self._enter, i)) for i, b in enumerate(blocks)]

    def _enter(self, index: int, module: nn.Module, args: Any) -> None:
        self.block = index

    @contextlib.contextmanager
    def phase(self, name: str, step: int | None = None) -> Iterator[None]:
        """Records `name` while it runs; an exception leaving it leaves it recorded, with the block it reached."""
        self.running, self.step, self.block = name, step, None
        yield
        self.running = None

    def where(self) -> str:
        text = self.running or "the training step"
        if self.step is not None:
            text += f" of step {self.step + 1}"
        if self.block is not None:
            text += f", in block {self.block} of {self.num_blocks}"
        return text

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


# ------------------------------------------------------------------------------------------------- what would help
def train_savings(cfg: Config, model: nn.Module, gpus: int) -> list[Saving]:
    """The switches of a training run that are off, with what each would save (each registered technique's
    advice); largest first."""
    return _largest_first([s for t in techniques("train") for s in t.advice(cfg, model, "train", gpus)])


def sample_savings(cfg: Config, model: nn.Module) -> list[Saving]:
    """The switches of sampling that are off, with what each would save; largest first (a batched guidance pass
    that runs out already falls back to two passes by itself, `tttvideo.sample.guidance`)."""
    return _largest_first([s for t in techniques("sample") for s in t.advice(cfg, model, "sample", 1)])


def _largest_first(found: list[Saving]) -> list[Saving]:
    return sorted(found, key=lambda s: -1 if s.nbytes is None else s.nbytes, reverse=True)


def _describe(saving: Saving) -> str:
    size = "" if saving.nbytes is None else f"{saving.nbytes / GIB:.2f} GiB "
    return f"{saving.switch} ({size}{saving.what})"


def _advice(cfg: Config, savings: list[Saving], phase: str) -> str:
    parts = []
    if savings:
        parts.append("switches not on yet, largest saving first: " + ", ".join(_describe(s) for s in savings))
    else:
        parts.append("every memory switch is already on: shorten layout.duration or use a larger card")
    cap = cfg.memory.max_gpu_gib
    if cap > 0:
        parts.append(f"memory.max_gpu_gib = {cap:g} holds this process to {cap:g} GiB (0 lifts the cap)")
    parts.append(f"tttv profile CONFIG --phase {phase} shows where the memory goes, and `tttv plan CONFIG "
                 f"--gpu-mem {_card_gib(cfg)} --phase {phase}` (or --auto-fit) picks the fastest setup that fits")
    return "; ".join(parts)


def _card_gib(cfg: Config) -> str:
    """The memory the plan should fit: the cap when one is set, else this GPU's."""
    if cfg.memory.max_gpu_gib > 0:
        return f"{cfg.memory.max_gpu_gib:g}GiB"
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_properties(0).total_memory / GIB:.0f}GiB"
    return "SIZE"


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0].rstrip(".") if text else type(err).__name__


def train_oom_error(err: BaseException, cfg: Config, model: nn.Module, watch: OomWatch,
                    newest_checkpoint: Path | None, gpus: int | None = None) -> OutOfMemory:
    """The one-sentence error of a training step that ran out of GPU memory."""
    gpus = torch.cuda.device_count() if gpus is None else gpus
    kept = (f"the newest checkpoint is {newest_checkpoint} (resume from it with --resume)"
            if newest_checkpoint is not None else "no checkpoint was written yet")
    return OutOfMemory(f"{OUT_OF_GPU_MEMORY} in the {watch.where()} ({_first_line(err)}); {kept}; "
                       f"{_advice(cfg, train_savings(cfg, model, gpus), 'train')}", watch.where(), needed_bytes(err))


class DenoiseWatch(OomWatch):
    """`with DenoiseWatch(cfg, model, story) as watch: denoise(..., on_step=watch.on_step(bar_update))`: a CUDA
    out-of-memory error inside becomes `sample_oom_error` naming the denoising step that was running."""

    def __init__(self, cfg: Config, model: nn.Module, story: str):
        super().__init__(model)
        self.cfg, self.model, self.story = cfg, model, story
        self.completed = 0

    def on_step(self, then: Callable[[int, int], Any]) -> Callable[[int, int], Any]:
        def note(i: int, n: int) -> Any:
            self.completed = i + 1
            return then(i, n)

        return note

    def __enter__(self) -> "DenoiseWatch":
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: Any) -> None:
        self.close()
        if isinstance(err, torch.cuda.OutOfMemoryError):
            raise sample_oom_error(err, self.cfg, self.model, self, self.story, self.completed + 1) from None


def sample_oom_error(err: BaseException, cfg: Config, model: nn.Module, watch: OomWatch, story: str,
                     step: int) -> OutOfMemory:
    """The one-sentence error of a denoising step (`step`, 1-based) that ran out of GPU memory."""
    where = f"denoise step {step} of {cfg.sample.steps} of story {story!r}"
    if watch.block is not None:
        where += f", in block {watch.block} of {watch.num_blocks}"
    return OutOfMemory(f"{OUT_OF_GPU_MEMORY} in {where} ({_first_line(err)}); "
                       f"{_advice(cfg, sample_savings(cfg, model), 'sample')}")
