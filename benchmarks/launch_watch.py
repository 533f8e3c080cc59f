"""A benchmark's launches of `tttv` (one process, or torchrun's agent and its workers): the command line, what it
reads of a launch while it runs, from /proc and nvidia-smi (the processes under it, their peak resident host
memory, the pid of a rank's worker, the GPUs' memory in use), and what a failed launch said. Nothing here starts
CUDA in the benchmark's own process."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _first_gpu(field: str) -> str | None:
    """nvidia-smi's `field` of the first GPU (None without one), read without starting CUDA in this process."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out else None


def gpu_name() -> str | None:
    """The first GPU's name (None without one)."""
    return _first_gpu("name")


def gpu_total_gib() -> float | None:
    """The first GPU's memory as nvidia-smi states it (None without one): the launcher must not start CUDA, whose
    context would hold GPU memory beside the launches it measures."""
    total = _first_gpu("memory.total")
    return float(total) / 1024 if total else None


def descendants(pid: int) -> list[int]:
    """The process and every process under it (torchrun's agent and its workers)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                todo += [int(c) for c in task.read_text().split()]
    return out


def proc_status(pid: int, key: str) -> float:
    """A /proc/<pid>/status memory line (e.g. VmHWM) in GiB; 0 when the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def worker_of_rank(pid: int, rank: int) -> int | None:
    """The pid of the torchrun worker with RANK = `rank` among the launch's processes."""
    for p in descendants(pid):
        try:
            env = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return p
    return None


def gpu_used_gib() -> list[float]:
    """Memory in use on each GPU as nvidia-smi reads it (every process's, CUDA contexts included); [] without it.
    Only the GPUs of CUDA_VISIBLE_DEVICES when it is set: two chains side by side on one host each read their own."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                              *(["-i", visible] if visible else [])],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [float(v) / 1024 for v in out.split()] if out.strip() else []


def higher_of(peak: list[float], used: list[float]) -> list[float]:
    """Each GPU's peak so far and a new reading merged. A reading that failed ([]: nvidia-smi timed out under a
    loaded host) keeps the peak: replacing it would leave only what the GPUs held after the launch ended."""
    if not used:
        return peak
    return [max(a, b) for a, b in zip(used, peak)] if peak else used


def process_role(pid: int, launch: int) -> str:
    """What a process of a launch is: "launch" (the command started: torchrun's agent, or the one `tttv`
    process), "rank N" (a torchrun worker), "compile workers" (Inductor's pool, which inherits a rank's
    environment), or "other"."""
    if pid == launch:
        return "launch"
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return "other"
    if b"compile_worker" in cmdline:
        return "compile workers"
    rank = next((v[5:].decode() for v in env if v.startswith(b"RANK=")), None)
    return f"rank {rank}" if rank is not None else "other"


class Watched:
    """A `tttv` launch (one process, or torchrun's agent and its workers) whose peak resident host memory (the sum
    of its processes' VmHWM) and the GPUs' peak use (nvidia-smi, every few seconds) are read while it runs; and,
    by role (`process_role`), each one's peak and when its resident memory was highest (seconds from the start)."""

    def __init__(self, cmd: list[str], log: Path, cwd: Path):
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=cwd,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        self.started = time.monotonic()
        self.host_peak = 0.0
        self.host_by_role: dict[str, dict[str, float]] = {}
        self.gpu_peak: list[float] = []
        self._smi_at = 0.0
        self._roles: dict[int, str] = {}

    def _read_host(self) -> None:
        peaks: dict[str, float] = {}
        resident: dict[str, float] = {}
        for pid in descendants(self.proc.pid):
            role = self._roles.get(pid) or process_role(pid, self.proc.pid)
            if role in ("launch", "compile workers"):  # final; a child between fork and exec still looks like
                self._roles[pid] = role               # its parent (a rank, "other"): asked again next time
            rss = proc_status(pid, "VmRSS")  # before the peak: a peak read later is never below it
            hwm = proc_status(pid, "VmHWM")
            if hwm == 0.0:  # gone since it was listed
                continue
            peaks[role] = peaks.get(role, 0.0) + hwm
            resident[role] = resident.get(role, 0.0) + rss
        self.host_peak = max(self.host_peak, sum(peaks.values()))
        for role, peak in peaks.items():
            seen = self.host_by_role.setdefault(role, {"peak_gib": 0.0, "resident_max_gib": 0.0, "at_s": 0.0})
            seen["peak_gib"] = max(seen["peak_gib"], peak)
            if resident[role] > seen["resident_max_gib"]:
                seen.update(resident_max_gib=resident[role], at_s=round(time.monotonic() - self.started, 1))

    def poll(self) -> int | None:
        self._read_host()
        if time.monotonic() - self._smi_at > 2.0:
            self._smi_at = time.monotonic()
            self.gpu_peak = higher_of(self.gpu_peak, gpu_used_gib())
        return self.proc.poll()

    def wait(self, until: Any = None) -> int | None:
        """Wait for the process to end, or for `until()` to be true (then None)."""
        while (code := self.poll()) is None:
            if until is not None and until():
                return None
            time.sleep(0.5)
        self.log.close()
        return code


def tttv(*args: str, gpus: int = 1) -> list[str]:
    """The `tttv` command line, under torchrun on one host with `gpus` > 1 (NCCL's environment is inherited)."""
    if gpus > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus),
                "-m", "tttvideo", *args]
    return [sys.executable, "-m", "tttvideo", *args]


def failure(log: Path) -> list[str]:
    """What a failed launch said: tttv's own error sentences (every rank's under torchrun), else the last exception
    a rank raised, else the log's last line that is not one of torchrun's rules."""
    if not log.is_file():
        return ["no log"]
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    said = [line for line in lines if line.startswith("tttv ") and "error" in line]
    raised = [line for line in lines if re.match(r"(\[rank\d+\]: )?[\w.]+(Error|Exception): ", line)
              and "ChildFailedError" not in line]
    return said[-4:] or raised[-1:] or [line for line in lines if line.strip("=-")][-1:] or ["empty log"]
