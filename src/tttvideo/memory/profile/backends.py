"""Where memory figures come from: the CUDA caching allocator, or the host process on CPU.

A backend has three verbs: `read()` returns a `MemorySample`, `reset_peak()` restarts the high-water mark,
`synchronize()` waits for queued device work so that timestamps mean something. `labels` says, in words, what the
`allocated`/`reserved`/`peak` figures are on this backend, so reports never present host RSS as GPU memory.
"""

from __future__ import annotations

import os
import platform
import time
import tracemalloc
from pathlib import Path
from typing import Protocol

from tttvideo.errors import UserError
from tttvideo.memory.profile.events import MemorySample


class MemoryBackend(Protocol):
    name: str
    labels: dict[str, str]

    def read(self) -> MemorySample: ...

    def reset_peak(self) -> None: ...

    def synchronize(self) -> None: ...

    def describe(self) -> dict[str, object]: ...

    def close(self) -> None: ...


CUDA_LABELS = {
    "allocated": "allocated (CUDA caching allocator, live tensors)",
    "reserved": "reserved (CUDA caching allocator, held from the driver)",
    "peak": "peak allocated since phase entry",
    "driver": "driver used (total - free, whole card)",
    "unit": "GPU memory",
}

CPU_LABELS = {
    "allocated": "host RSS (resident set of this process)",
    "reserved": "host RSS (no allocator cache on CPU)",
    "peak": "host peak RSS (kernel high-water mark since phase entry)",
    "driver": "n/a on CPU",
    "unit": "host memory (RSS); Python heap separately as tracemalloc",
}


class CudaBackend:
    """Reads `torch.cuda.memory_stats` and the driver's free/total figure for one device."""

    name = "cuda"
    labels = CUDA_LABELS

    def __init__(self, device: object = None, sync: bool = True) -> None:
        import torch

        if not torch.cuda.is_available():
            raise UserError("the CUDA memory backend needs a CUDA device; use --device cpu for host-memory figures")
        self._torch = torch
        self.device = torch.device(device if device is not None else "cuda")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        # Syncing at each sample makes the timeline's time axis follow the GPU, not the host running ahead; the
        # allocator's counters themselves are host-side and exact either way.
        self.sync = sync

    def read(self) -> MemorySample:
        cuda = self._torch.cuda
        stats = cuda.memory_stats(self.device)
        free, total = cuda.mem_get_info(self.device)
        return MemorySample(
            t=time.perf_counter(),
            allocated=int(stats.get("allocated_bytes.all.current", 0)),
            reserved=int(stats.get("reserved_bytes.all.current", 0)),
            peak_allocated=int(stats.get("allocated_bytes.all.peak", 0)),
            peak_reserved=int(stats.get("reserved_bytes.all.peak", 0)),
            inactive_split=int(stats.get("inactive_split_bytes.all.current", 0)),
            alloc_retries=int(stats.get("num_alloc_retries", 0)),
            num_ooms=int(stats.get("num_ooms", 0)),
            driver_used=int(total - free),
            driver_total=int(total),
        )

    def reset_peak(self) -> None:
        self._torch.cuda.reset_peak_memory_stats(self.device)

    def synchronize(self) -> None:
        if self.sync:
            self._torch.cuda.synchronize(self.device)

    def close(self) -> None:
        return None

    def describe(self) -> dict[str, object]:
        props = self._torch.cuda.get_device_properties(self.device)
        return {
            "backend": self.name,
            "device": props.name,
            "device_total_bytes": int(props.total_memory),
            "torch": self._torch.__version__,
            "cuda": self._torch.version.cuda,
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        }


class CpuBackend:
    """Host figures: resident set size (all of this process), its kernel high-water mark, and tracemalloc.

    The peak is reset through /proc/self/clear_refs (Linux >= 4.0); where that is not writable, the peak falls back to
    the highest RSS this backend has read since the reset, which misses spikes between two samples: `describe()`
    says which one is in use.
    """

    name = "cpu"
    labels = CPU_LABELS

    def __init__(self, trace_python: bool = True) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._statm = Path("/proc/self/statm")
        self._status = Path("/proc/self/status")
        self._linux = self._statm.exists() and self._status.exists()
        self._kernel_peak = self._linux and self._try_clear_refs()
        self._mmap_large = self._linux and _mmap_large_buffers()
        self._soft_peak = 0
        self._psutil = None
        if not self._linux:
            try:
                import psutil

                self._psutil = psutil.Process()
            except ImportError:
                self._psutil = None
        # tracemalloc sees only Python-heap objects, never torch tensors; it is here for the Python-side overhead
        # (data loading, metadata) and is labelled as such in every report.
        self.trace_python = trace_python
        self._started_tracing = trace_python and not tracemalloc.is_tracing()
        if self._started_tracing:
            tracemalloc.start()

    @staticmethod
    def _try_clear_refs() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # "5" resets the peak RSS (VmHWM) to the current RSS; see proc(5).
            return True
        except OSError:
            return False

    def _rss(self) -> int:
        if self._linux:
            fields = self._statm.read_text().split()
            return int(fields[1]) * self._page
        if self._psutil is not None:
            return int(self._psutil.memory_info().rss)
        import resource

        # Without /proc or psutil only the lifetime maximum is known; it stands in for the current value.
        scale = 1 if platform.system() == "Darwin" else 1024
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale

    def _hwm(self) -> int:
        for line in self._status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0

    def read(self) -> MemorySample:
        rss = self._rss()
        self._soft_peak = max(self._soft_peak, rss)
        peak = max(self._hwm(), rss) if self._kernel_peak else self._soft_peak
        cur = tpeak = None
        if self.trace_python and tracemalloc.is_tracing():
            cur, tpeak = tracemalloc.get_traced_memory()
        return MemorySample(
            t=time.perf_counter(),
            allocated=rss,
            reserved=rss,
            peak_allocated=peak,
            peak_reserved=peak,
            tracemalloc_current=cur,
            tracemalloc_peak=tpeak,
        )

    def reset_peak(self) -> None:
        if self._kernel_peak:
            self._kernel_peak = self._try_clear_refs()
        self._soft_peak = self._rss()
        if self.trace_python and tracemalloc.is_tracing():
            tracemalloc.reset_peak()

    def synchronize(self) -> None:
        return None

    def close(self) -> None:
        """Stop tracemalloc if this backend started it: it slows every Python allocation (imports, plotting)."""
        if self._started_tracing and tracemalloc.is_tracing():
            tracemalloc.stop()
        self._started_tracing = False
        self.trace_python = False

    def describe(self) -> dict[str, object]:
        import torch

        return {
            "backend": self.name,
            "device": f"host CPU ({platform.processor() or platform.machine()})",
            "torch": torch.__version__,
            "peak_source": "kernel VmHWM (reset via clear_refs)" if self._kernel_peak else "max of samples",
            "tracemalloc": bool(self.trace_python),
            "large_buffers_mmapped": bool(self._mmap_large),
        }


MMAP_THRESHOLD = 128 * 1024


def _mmap_large_buffers() -> bool:
    """Have glibc serve every allocation of 128 KiB or more by mmap and return it at free, for this process, so
    that RSS follows the tensors alive. By default glibc raises its mmap threshold to the largest block freed so far
    (up to 32 MiB): after one big tensor is freed, later ones of that size come from the heap, whose freed memory
    stays resident, and a phase that allocates them shows no growth. The threshold only decides where memory comes
    from when no free heap chunk fits, so the heap's free memory is handed back to the system too (malloc_trim):
    a chunk freed before the profile began (by the work that ran earlier in the process) and reused by it then counts
    when touched, as a new one would. False where this is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fixed = bool(libc.mallopt(-3, MMAP_THRESHOLD))  # M_MMAP_THRESHOLD; a fixed value also stops the adjustment
        libc.malloc_trim(0)
        return fixed
    except (OSError, AttributeError):
        return False


def make_backend(device: str = "auto", trace_python: bool = True) -> MemoryBackend:
    """'auto' picks CUDA when a GPU is visible, else the host; 'cuda', 'cuda:N' or 'cpu' force one."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        return CudaBackend(device)
    if device == "cpu":
        return CpuBackend(trace_python=trace_python)
    raise UserError(f"unknown memory backend device {device!r}; use auto, cpu, cuda or cuda:N")
