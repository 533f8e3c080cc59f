"""Stopping a training run on SIGINT (Ctrl-C) or SIGTERM (what a cluster sends before preemption): the step in
flight finishes, a checkpoint is saved, and the command says how to resume. A second Ctrl-C aborts at once, except
during a checkpoint save, which always completes; a repeated SIGTERM (a scheduler that signals every process of a
job, then torchrun forwarding its own) only repeats the request."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

from tttvideo.parallel.launch import launch_rank

F = TypeVar("F", bound=Callable[..., Any])

# open checkpoint saves of this process: a signal meanwhile never aborts
_saving = 0


def uninterrupted(fn: F) -> F:
    """Decorate a checkpoint save: a second signal during it is noted, not acted on (the stop follows the save)."""
    @wraps(fn)
    def save(*args: Any, **kwargs: Any) -> Any:
        global _saving
        _saving += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _saving -= 1

    return save  # type: ignore[return-value]


class TrainingStopped(Exception):
    """SIGINT or SIGTERM stopped the run after a step; the checkpoint of that step is saved. The CLI prints the
    command that resumes it and exits with 128 + the signal number (130, 143)."""

    def __init__(self, signum: int, step: int, total: int, checkpoint: Path, output_dir: Path):
        self.signum, self.step, self.total = signum, step, total
        self.checkpoint, self.output_dir = checkpoint, output_dir
        super().__init__(self.describe("--resume"))

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def describe(self, resume: str) -> str:
        return (f"stopped by {self.signal_name} after step {self.step} of {self.total}; checkpoint saved in "
                f"{self.checkpoint}; resume with: {resume}")


class StopSignals:
    """While the training loop runs: the first SIGINT or SIGTERM (Ctrl-C; what a cluster sends before preemption)
    asks it to stop after the current step (`signum` is set, the loop saves and raises TrainingStopped); a second
    signal that is a SIGINT raises KeyboardInterrupt at once unless a checkpoint is being saved (`uninterrupted`);
    a repeated SIGTERM is ignored. Under torchrun rank 0 alone says so. The previous handlers are restored on exit.
    Outside the main thread (signals cannot be caught there) it does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, command: str = "tttv train"):
        self.command = command
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            if signum == signal.SIGINT and not _saving:
                raise KeyboardInterrupt
            return
        self.signum = signum
        if launch_rank() != 0:  # every rank of a launch gets the signal; one line says so
            return
        again = ("; press Ctrl-C again to abort at once, losing this step" if signum == signal.SIGINT else "")
        # os.write, not print: a handler may run in the middle of a print to the same stream
        text = (f"\n{self.command}: {signal.Signals(signum).name}: finishing the current step, then saving a "
                f"checkpoint{again}\n")
        with contextlib.suppress(OSError):
            os.write(2, text.encode())
