"""Running a torchrun launch of `tttv` from a test with a time limit that, when it runs out, says where each rank was.

A launch that hangs would otherwise end as `subprocess.TimeoutExpired` with nothing from the ranks (their output goes
to --log-dir, and the launcher prints nothing while they run). Here every rank gets SIGUSR1 first, which `tttv`
answers with every thread's Python stack on its stderr (tttvideo.cli), and the test fails with those logs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
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


def rank_logs(cmd: list[str], tail: int = 6000) -> str:
    """The end of every rank's stderr log under the launch's --log-dir (all attempts), or '' without one."""
    if "--log-dir" not in cmd:
        return ""
    logs = Path(cmd[cmd.index("--log-dir") + 1])
    parts = []
    for log in sorted(logs.glob("*/attempt_*/*/stderr.log")):
        with contextlib.suppress(OSError):
            parts.append(f"\n--- {log.relative_to(logs)}:\n{log.read_text()[-tail:]}")
    return "".join(parts)


def run_launch(cmd: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)` under `timeout_s`; past it, the ranks' stacks are asked
    for, the launch is killed and the test fails with the launcher's output and every rank's log."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        workers = descendants(proc.pid)
        for pid in workers:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGUSR1)
        time.sleep(STACK_DUMP_WAIT_S)
        for pid in [proc.pid, *workers]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"the launch did not end in {timeout_s:g} s: {' '.join(cmd)}\n"
                             f"launcher:\n{(out + err)[-4000:]}\nranks (their stacks at SIGUSR1 at the end):"
                             f"{rank_logs(cmd)}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

