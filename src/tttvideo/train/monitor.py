"""What a training run reports: a rich progress bar (loss, lr, step time, tokens/s, memory), a log line every
`log_every` steps, TensorBoard event files, `metrics.jsonl` (one line per optimizer step, what the tests and
plots read) and, when asked for and installed, Weights & Biases."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from tttvideo.errors import UserError


def memory_gib(device: torch.device) -> float:
    """Peak GPU memory allocated by tensors, or the process's peak resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is KiB on Linux, bytes on macOS
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30


class TrainMonitor:
    def __init__(self, output_dir: Path, train: Any, total_steps: int, start_step: int, console: Any,
                 config_dict: dict[str, Any] | None = None, show: bool = True):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.console = console
        self.log_every = train.log_every
        self.show = show  # False: files only (metrics, TensorBoard, wandb), nothing on the console
        self.metrics_path = output_dir / "metrics.jsonl"
        self._metrics = open(self.metrics_path, "a", encoding="utf-8")
        self.tb = None
        if train.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(output_dir / "tensorboard"), purge_step=start_step + 1)
        self.wandb = None
        if train.wandb:
            try:
                import wandb
            except ImportError:
                raise UserError("train.wandb is true but wandb is not installed; `pip install wandb` or set "
                                "train.wandb = false") from None
            self.wandb = wandb.init(project=train.wandb_project, dir=str(output_dir), config=config_dict,
                                    resume="allow")
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"), TimeRemainingColumn(),
            console=console, disable=not show, transient=False,
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, stats="")

    def __enter__(self) -> "TrainMonitor":
        self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def step(self, step: int, values: dict[str, float]) -> None:
        """Record optimizer step `step` (1-based count of steps done)."""
        stats = (f"loss {values['loss']:.4f}  lr {values['lr']:.2e}  {values['step_time']:.2f} s/step  "
                 f"{values['tokens_per_s']:,.0f} tok/s  mem {values['memory_gib']:.2f} GiB")
        self.progress.update(self.task, completed=step, stats=stats)
        self._metrics.write(json.dumps({"step": step, **values}) + "\n")
        self._metrics.flush()
        if step % self.log_every == 0:
            if self.show:
                self.progress.console.print(f"step {step:>6}  {stats}")
            if self.tb is not None:
                for key, value in values.items():
                    self.tb.add_scalar(f"train/{key}", value, step)
                self.tb.flush()
            if self.wandb is not None:
                self.wandb.log(values, step=step)

    def note(self, text: str) -> None:
        if self.show:
            self.progress.console.print(text)

    def close(self) -> None:
        if self.progress.live.is_started:
            self.progress.stop()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
