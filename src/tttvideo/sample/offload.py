"""Transformer blocks kept in pinned CPU memory and streamed onto the GPU one step ahead of use.

CogVideoX-5B + TTT-MLP is about 7.2 B parameters (14.4 GB in bf16). On a 24 GB card that leaves too little for the
activations of a long video, so `BlockOffloader` keeps every block's weights in pinned host memory. Before block i
runs (a forward pre-hook) its weights must be on the GPU; the copy was started earlier on a side CUDA stream, and
the copies of blocks i+1 .. i+prefetch are started now, so the PCIe transfer of the next block overlaps the
compute of this one. After block i (a forward hook) its GPU copy is dropped. The GPU holds at most prefetch + 1
blocks of weights.

Only parameter *storage* moves (`param.data` is swapped); modules, hooks and the autograd-free sampling loop do not
notice. Inference only: the swap would break a backward pass.

Correctness of the stream handoff: the compute stream waits on an event recorded after the copies, and every GPU
copy is marked as used by the compute stream (`record_stream`) so the caching allocator does not hand its memory
to the next prefetch before the block's kernels have finished reading it.

On a CPU device there is nothing to offload to: the offloader logs one line and does nothing. `synchronous=True`
runs the same bookkeeping without streams (and works between any two devices); the CPU tests use it.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
from torch import nn

log = logging.getLogger(__name__)


class BlockOffloader:
    def __init__(self, blocks: Sequence[nn.Module], device: torch.device | str, prefetch: int = 1,
                 synchronous: bool = False, storage: torch.device | str = "cpu"):
        self.blocks = list(blocks)
        self.device = torch.device(device)
        self.prefetch = max(1, prefetch)
        self.enabled = self.device.type == "cuda" or synchronous
        self.synchronous = synchronous or self.device.type != "cuda"
        self.loads = 0  # host -> device block copies started (tests and logs)
        self._handles: list = []
        self._resident: dict[int, tuple[list[torch.Tensor], torch.cuda.Event | None]] = {}
        if not self.enabled:
            log.info("block offload needs a CUDA device; the model runs on %s without it", self.device)
            return
        storage = torch.device(storage)
        pin = storage.type == "cpu" and torch.cuda.is_available()
        self._host: list[list[torch.Tensor]] = []
        self._tensors: list[list[torch.Tensor]] = []  # the parameter / buffer objects whose .data we swap
        for block in self.blocks:
            tensors = list(block.parameters()) + [b for b in block.buffers()]
            host = []
            for t in tensors:
                h = t.data.to(storage)
                if pin:
                    h = h.pin_memory()
                host.append(h)
                t.data = h
            self._tensors.append(tensors)
            self._host.append(host)
        self.stream = None if self.synchronous else torch.cuda.Stream(self.device)
        for i, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(self._make_pre_hook(i)))
            self._handles.append(block.register_forward_hook(self._make_post_hook(i)))
        total = sum(h.numel() * h.element_size() for host in self._host for h in host)
        log.info("block offload: %d blocks (%.2f GB) in %s memory, %d prefetched onto %s",
                 len(self.blocks), total / 1e9, "pinned host" if pin else storage.type, self.prefetch, self.device)

    # ------------------------------------------------------------------ copies
    def _start_load(self, i: int) -> None:
        if i in self._resident:
            return
        self.loads += 1
        if self.synchronous:
            self._resident[i] = ([h.to(self.device) for h in self._host[i]], None)
            return
        with torch.cuda.stream(self.stream):
            gpu = [h.to(self.device, non_blocking=True) for h in self._host[i]]
            event = torch.cuda.Event()
            event.record(self.stream)
        self._resident[i] = (gpu, event)

    def _make_pre_hook(self, i: int):
        def hook(module: nn.Module, args):
            self._start_load(i)
            gpu, event = self._resident[i]
            if event is not None:
                compute = torch.cuda.current_stream(self.device)
                compute.wait_event(event)
                for g in gpu:
                    g.record_stream(compute)
            for t, g in zip(self._tensors[i], gpu):
                t.data = g
            # the next blocks' copies run while this block computes (wrapping around: the next step starts at 0)
            for k in range(1, self.prefetch + 1):
                self._start_load((i + k) % len(self.blocks))
            return None

        return hook

    def _make_post_hook(self, i: int):
        def hook(module: nn.Module, args, output):
            for t, h in zip(self._tensors[i], self._host[i]):
                t.data = h
            self._resident.pop(i, None)
            return None

        return hook

    def close(self) -> None:
        """Remove the hooks; the weights stay in host memory (move the model yourself if it should run on GPU)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._resident.clear()


def offload_blocks(model: nn.Module, device: torch.device | str, prefetch: int = 1) -> BlockOffloader:
    """Offload `model.blocks` (the transformer layers); everything else must already be on `device`."""
    return BlockOffloader(model.blocks, device, prefetch=prefetch)
