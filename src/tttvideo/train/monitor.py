"""What a training run reports: on a terminal a rich progress bar (step/total and ETA first, then loss, step time and
memory, shortened to fit the width), a log line every `log_every` steps (step/total, loss, lr, step time, tokens/s,
memory, ETA; in a pipe or a log file these lines are the progress, with no bar), TensorBoard event files,
`metrics.jsonl` (one line per optimizer step, what the tests and plots read; `truncate_metrics` cuts it back to a
resumed checkpoint's step) and, when asked for and installed, Weights & Biases."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tttvideo.config.schema import TrainConfig
from tttvideo.errors import UserError


def memory_gib(device: torch.device) -> float:
    """Peak GPU memory allocated by tensors, or the process's peak resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is KiB on Linux, bytes on macOS
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30


def reserved_gib(device: torch.device) -> float:
    """Peak GPU memory the caching allocator reserved (what the card must hold); 0 off CUDA."""
    return torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else 0.0


def host_gib() -> float:
    """The process's peak resident host memory."""
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30


BAR_MIN = 10
NO_ETA = "-:--:--"


def format_duration(seconds: float) -> str:
    """H:MM:SS (hours unbounded: a 5000-step stage can take weeks)."""
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class TrainMonitor:
    def __init__(self, output_dir: Path, train: TrainConfig, total_steps: int, start_step: int, console: Any,
                 config_dict: dict[str, Any] | None = None, show: bool = True):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
        from rich.table import Column

        self.console = console
        self.total = total_steps
        self.start_step = start_step
        self.started = time.monotonic()
        # a pipe or a log file gets plain lines: a bar there is one line rewritten in place, cut at its width
        self.plain = not console.is_terminal
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
        # step/total and ETA come before the stats, and the stats are cut to what is left (`_fit`), so a narrow
        # terminal (80 columns) still shows how far the run is and how long it will take
        self.progress = Progress(
            TextColumn("[bold]train"), MofNCompleteColumn(),
            BarColumn(bar_width=None, table_column=Column(ratio=1, min_width=BAR_MIN)),
            TextColumn("ETA {task.fields[eta]}"),
            TextColumn("{task.fields[stats]}", table_column=Column(no_wrap=True, overflow="ellipsis")),
            console=console, disable=not show or self.plain, transient=False, expand=True,
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, stats="", eta=NO_ETA)

    def __enter__(self) -> "TrainMonitor":
        self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def step(self, step: int, values: dict[str, float]) -> None:
        """Record optimizer step `step` (1-based count of steps done)."""
        eta = self.eta(step)
        short = f"loss {values['loss']:.4f}  {values['step_time']:.2f} s/step  mem {values['memory_gib']:.2f} GiB"
        self.progress.update(self.task, completed=step, stats=self._fit(short), eta=eta)
        try:
            self._metrics.write(json.dumps({"step": step, **values}) + "\n")
            self._metrics.flush()
        except OSError as err:
            raise UserError(f"cannot write {self.metrics_path} ({err.strerror or err}); make room there (or move "
                            f"train.output_dir) and continue the run with --resume") from None
        if step % self.log_every == 0:
            if self.show:
                width = len(str(self.total))
                line = (f"step {step:>{width}}/{self.total}  loss {values['loss']:.4f}  lr {values['lr']:.2e}  "
                        f"{values['step_time']:.2f} s/step  {values['tokens_per_s']:,.0f} tok/s  "
                        f"mem {values['memory_gib']:.2f} GiB  ETA {eta}")
                # soft_wrap: one line per step in a log file, whatever the console's width
                self.progress.console.print(line, soft_wrap=True, highlight=False, markup=False)
            if self.tb is not None:
                for key, value in values.items():
                    self.tb.add_scalar(f"train/{key}", value, step)
                self.tb.flush()
            if self.wandb is not None:
                self.wandb.log(values, step=step)

    def eta(self, step: int) -> str:
        """Time to the last step at the mean pace of this process so far (checkpoints and videos included)."""
        done = step - self.start_step
        if done <= 0:
            return NO_ETA
        seconds = (time.monotonic() - self.started) / done * max(0, self.total - step)
        return format_duration(seconds)

    def _fit(self, stats: str) -> str:
        """The bar's stats cut to the width left after "train", step/total, the narrowest bar and the ETA."""
        digits = len(str(self.total))
        room = self.console.width - (len("train ") + 2 * digits + 2 + BAR_MIN + 1 + len(f"ETA {NO_ETA} ") + 1)
        if len(stats) <= room:
            return stats
        return stats[: max(0, room - 1)] + "…" if room > 1 else ""

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


class SilentMonitor:
    """The monitor of a rank other than 0 in a multi-process run: rank 0 alone prints and writes the logs."""

    def __enter__(self) -> "SilentMonitor":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def step(self, step: int, values: dict[str, float]) -> None:
        pass

    def note(self, text: str) -> None:
        pass


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the metric lines of steps 1..`step` (each once), dropping those past it (written after the checkpoint by
    the interrupted process) and any line a kill cut off mid-write. Step 0 starts a fresh log."""
    if not path.is_file():
        return
    keep: dict[int, str] = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
            at = int(record["step"])
        except (ValueError, KeyError, TypeError):
            continue
        if 0 < at <= step:
            keep[at] = line + "\n"  # a step logged twice (by an older version): the later line
    path.write_text("".join(keep[k] for k in sorted(keep)), encoding="utf-8")
