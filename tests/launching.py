"""Running a torchrun launch of `tttv` from a test with a time limit that, when it runs out, says where each rank was.

A launch that hangs would otherwise end as `subprocess.TimeoutExpired` with nothing from the ranks (their output goes
to --log-dir or a benchmark's log files, and the launcher prints nothing while they run). Here every process of the
launch that catches SIGUSR1 gets it first (`tttv` and tests/parallel_worker.py answer with every thread's Python
stack on their stderr; a process that does not catch it, torchrun's launcher say, would die of it and is left alone),
and the test fails with the launch's output and those logs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

# how long the ranks get to write their stacks after SIGUSR1
STACK_DUMP_WAIT_S = 2.0


def processes() -> list[tuple[int, int, str, str]]:
    """(pid, parent pid, name, state) of every process, from /proc/PID/stat (a thread's /proc `children` file misses
    children while others are being created or reaped)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            name, rest = (entry / "stat").read_text().split(" (", 1)[1].rsplit(") ", 1)
            state, ppid = rest.split()[:2]
        except (OSError, ValueError):
            continue
        found.append((int(entry.name), int(ppid), name, state))
    return found


def descendants(pid: int) -> list[int]:
    """The live processes under `pid`, children first."""
    table = [(p, parent) for p, parent, _, state in processes() if state not in "ZX"]
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = [p for p, pp in table if pp == parent]
        found.extend(kids)
        todo.extend(kids)
    return found


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (its SigCgt mask in /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(mask, 16) >> (signum - 1) & 1)


def launch_logs(cmd: list[str], logs: Iterable[Path] = (), tail: int = 6000) -> str:
    """The end of every rank's stderr log under the launch's --log-dir (all attempts) and of each file in `logs`."""
    files: list[tuple[str, Path]] = []
    if "--log-dir" in cmd:
        log_dir = Path(cmd[cmd.index("--log-dir") + 1])
        files += [(str(log.relative_to(log_dir)), log) for log in sorted(log_dir.glob("*/attempt_*/*/stderr.log"))]
    files += [(str(log), log) for log in logs]
    parts = []
    for name, log in files:
        with contextlib.suppress(OSError):
            parts.append(f"\n--- {name}:\n{log.read_text()[-tail:]}")
    return "".join(parts)


def run_launch(cmd: list[str], env: dict[str, str] | None, timeout_s: float, cwd: Path | None = None,
               logs: Callable[[], Iterable[Path]] = tuple) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)` under `timeout_s`; past it, the stacks of the launch's
    processes are asked for, the launch is killed and the test fails with its output, every rank's --log-dir log and
    the files `logs()` names then (a benchmark that starts torchrun itself writes the ranks' output there)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        launched = [proc.pid, *descendants(proc.pid)]
        for pid in launched:
            if catches(pid, signal.SIGUSR1):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGUSR1)
        time.sleep(STACK_DUMP_WAIT_S)
        for pid in launched:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"the launch did not end in {timeout_s:g} s: {' '.join(cmd)}\n"
                             f"its output (with the stacks of processes that print them at SIGUSR1):\n"
                             f"{(out + err)[-6000:]}\nlogs:{launch_logs(cmd, logs())}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

