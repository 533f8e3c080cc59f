"""How each SM's 256 KB of on-chip memory is split between L1 and shared memory for the TTT backward kernels.

Triton loads a kernel that uses more than 48 KB of shared memory with `cuFuncSetCacheConfig(PREFER_SHARED)`, and
the driver then configures the SM with its largest shared-memory carveout: 228 KB on an H100, leaving about 28 KB of
L1. The TTT-MLP reverse kernel uses 61 KB of shared memory at one program an SM, and its registers spill 1,240 bytes
a thread (310 KB a program): under that carveout its spill reloads and operand loads miss L1 and wait on L2 (ncu on
an H100: shared-memory configuration 233 KB, long-scoreboard stalls 49 % of the warp samples;
benchmarks/ttt_kernel_stalls.py). `fit_carveout` asks instead for the smallest carveout that holds the programs
that fit on an SM at once (by registers and threads), so the rest of the 256 KB is L1: 64 KB of shared memory for
the reverse (ncu: 65.5 KB), 192 KB of L1.

The launches that call it are those it measured faster for (`benchmarks/ttt_carveout_ab.py`, H100, same run,
`benchmarks/results/ttt_carveout_ab_h100.json`): the TTT-MLP reverse (forward + backward at 18,048 tokens
16.25 -> 15.81 ms) and the TTT-Linear backward (13.92 -> 13.66 ms). The forward kernels keep the driver's own
choice: the training forward already ran at 64 KB, and the sampling forward (two programs an SM, 132 KB chosen by
the driver) measured 6.47 -> 6.59 ms at 100 KB (`ttt_carveout_ab_tried_h100.json`).

It is a hint (`CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT`): the driver still gives a launch the shared
memory it needs, and the kernels compute the same values either way. `TTT_L1_CARVEOUT=triton` leaves Triton's
setting (for A/B measurements); the setting is read at every launch and applied once per kernel and mode, so a
kernel's first launch runs under Triton's setting.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
from typing import Any

log = logging.getLogger(__name__)

_CARVEOUT_ATTRIBUTE = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
_CARVEOUT_DEFAULT = -1  # CU_SHAREDMEM_CARVEOUT_DEFAULT: no preference
_PREFER_NONE, _PREFER_SHARED = 0, 1  # CUfunc_cache
_RESERVED_PER_BLOCK = 1024  # shared memory the driver reserves for each resident block (sm_80 on)
_TRITON_OPT_IN = 49152  # above this Triton sets PREFER_SHARED at load

MODES = ("fit", "triton")
_applied: dict[int, str] = {}  # CUfunction handle -> the mode last applied


def carveout_mode() -> str:
    mode = os.environ.get("TTT_L1_CARVEOUT", "fit")
    if mode not in MODES:
        raise ValueError(f"TTT_L1_CARVEOUT={mode!r}: use one of {MODES}")
    return mode


@functools.lru_cache(maxsize=None)
def _libcuda() -> Any:
    return ctypes.CDLL("libcuda.so.1")


@functools.lru_cache(maxsize=None)
def _sm_limits(device_index: int) -> tuple[int, int, int]:
    """(shared memory, registers, threads) of one SM of the current device."""
    lib = _libcuda()
    dev = ctypes.c_int()
    lib.cuDeviceGet(ctypes.byref(dev), device_index)
    values = []
    for attribute in (81, 82, 39):  # MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, MAX_REGISTERS_PER_MULTIPROCESSOR, THREADS
        v = ctypes.c_int()
        lib.cuDeviceGetAttribute(ctypes.byref(v), attribute, dev)
        values.append(v.value)
    return values[0], values[1], values[2]


def carveout_percent(shared: int, regs: int, threads: int, sm_shared: int, sm_regs: int, sm_threads: int) -> int:
    """The carveout, in percent of an SM's shared memory, that holds every program of the kernel that fits on an SM
    at once: registers are allocated per warp in multiples of 8 a thread, and each block takes `shared` bytes plus
    the driver's reserve."""
    by_regs = sm_regs // (max(8, math.ceil(regs / 8) * 8) * threads)
    blocks = max(1, min(by_regs, sm_threads // threads))
    return min(100, math.ceil(100 * blocks * (shared + _RESERVED_PER_BLOCK) / sm_shared))


def fit_carveout(kernel: Any) -> None:
    """Apply the carveout mode to a launched kernel (what `kernel[grid](...)` returned); nothing for the
    interpreter's stand-in, which has no CUDA function."""
    fn = getattr(kernel, "function", None)
    if not isinstance(fn, int) or not fn:
        return
    mode = carveout_mode()
    if _applied.get(fn) == mode:
        return
    import torch

    lib = _libcuda()
    shared = int(kernel.metadata.shared)
    if mode == "fit":
        sm = _sm_limits(torch.cuda.current_device())
        pct = carveout_percent(shared, int(kernel.n_regs), int(kernel.metadata.num_warps) * 32, *sm)
        lib.cuFuncSetCacheConfig(ctypes.c_void_p(fn), _PREFER_NONE)
    else:
        pct = _CARVEOUT_DEFAULT
        lib.cuFuncSetCacheConfig(ctypes.c_void_p(fn), _PREFER_SHARED if shared > _TRITON_OPT_IN else _PREFER_NONE)
    status = lib.cuFuncSetAttribute(ctypes.c_void_p(fn), _CARVEOUT_ATTRIBUTE, pct)
    if status:  # a refused hint costs speed, not correctness: say so once per kernel and go on
        log.warning("the CUDA driver refused the shared-memory carveout %s %% for a TTT kernel (CUresult %s); it "
                    "runs with the driver's own split", pct, status)
    _applied[fn] = mode
