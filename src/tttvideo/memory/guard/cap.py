"""`memory.max_gpu_gib` applied: the CUDA allocator of this process capped, so that a large card runs out of memory
where a smaller one would. `tttv train`, `tttv sample` and `tttv profile` call `apply_memory_cap` once their device
is known."""

from __future__ import annotations

import logging

import torch

from tttvideo.config.schema import MemoryConfig
from tttvideo.device import cap_process_memory

log = logging.getLogger(__name__)
_said_off_cuda = False  # the sampler inside training or the profiler's sample phase would repeat it


def apply_memory_cap(memory: MemoryConfig, device: torch.device | str) -> float | None:
    """Cap the allocator on `device` at `memory.max_gpu_gib` GiB (0: no cap); returns the fraction of the card, or
    None when nothing was capped. Off CUDA a set key is logged once as not applying."""
    global _said_off_cuda

    if memory.max_gpu_gib <= 0:
        return None
    device = torch.device(device)
    if device.type != "cuda":
        if not _said_off_cuda:
            log.warning("memory.max_gpu_gib = %g does not apply on %s: only the CUDA allocator can be capped",
                        memory.max_gpu_gib, device)
            _said_off_cuda = True
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return cap_process_memory(memory.max_gpu_gib, device)
