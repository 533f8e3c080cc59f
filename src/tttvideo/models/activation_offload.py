"""Saved activations moved to host memory between forward and backward: `offload_activations(...)`.

Under the context manager every tensor autograd saves for backward that is at least `min_bytes` large is copied to
a host buffer when saved and copied back to its device when backward needs it. The device then holds only the
small saved tensors and whatever the forward still uses.

Host memory costs what it holds. The buffers come from a `HostPool` of exact-size buffers, pinned once (malloc +
cudaHostRegister) and reused micro-batch after micro-batch: torch's pinned allocator rounds every block up to a
power of two, so 42 saved block inputs of 2.1 GiB (the 5B at 63 s) took 4 GiB each, 168 GiB for 88 GiB of data, and
the host ran out. A pool with a capacity (`HostPool(capacity_bytes=...)`) offloads while it has room and leaves the
rest on the device: a partial offload instead of a killed process.

On CUDA the copies run on a side stream, so they overlap compute: a tensor's copy to the host starts when forward
saves it, and when backward asks for one tensor the one saved just before it (the next that backward will need: a
checkpointed block's input in reverse block order) is prefetched, so its copy overlaps the block in between.

torch.autograd.graph.save_on_cpu copies but does not do what is needed here; this is its pack/unpack pair with a
size threshold (small tensors are not worth a copy each), parameters (and views of them) and the tensors of `keep`
(a module: anything sharing storage with its parameters and buffers, e.g. fp8 weight codes) left in place, the pool,
the side stream and prefetch, and a count of what was offloaded. A tensor already on the CPU is copied too: one code
path, testable on a CPU, saving nothing there.
"""

from __future__ import annotations

import weakref
from collections import defaultdict

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor

from tttvideo.errors import ConfigError
from tttvideo.parallel.launch import local_world_size


def _storage_ptr(tensor: torch.Tensor) -> int:
    """Where a parameter's or buffer's data lives; an FSDP2-sharded parameter (a DTensor, whose own storage cannot be
    read) by its local shard's."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.untyped_storage().data_ptr()


class HostPool:
    """Exact-size host buffers (uint8), reused by size. `pin`: page-locked through cudaHostRegister, so copies to
    and from a CUDA device are asynchronous. `capacity_bytes` (None: no limit) bounds what the pool ever allocates;
    `take` answers None past it."""

    def __init__(self, capacity_bytes: int | None = None, pin: bool = False):
        self.capacity_bytes = capacity_bytes
        self.pin = pin and torch.cuda.is_available()
        self.allocated_bytes = 0
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        # every pinned buffer, held until the pool goes (after every handle lent one: they hold the pool), so that
        # none is freed while still registered
        self._pinned: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor | None:
        if self._free[nbytes]:
            return self._free[nbytes].pop()
        if self.capacity_bytes is not None and self.allocated_bytes + nbytes > self.capacity_bytes:
            return None
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if self.pin:
            err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
            if int(err) != 0:  # not fatal: the copies are then synchronous
                self.pin = False
            else:
                self._pinned.append(buf)
        self.allocated_bytes += nbytes
        return buf

    def give(self, buf: torch.Tensor) -> None:
        self._free[buf.numel()].append(buf)

    def __del__(self) -> None:
        for buf in self._pinned:
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
        self._pinned.clear()


class _Offloaded:
    """One saved tensor in host memory (and, once prefetched, back on its device)."""

    __slots__ = ("device", "dtype", "shape", "host", "pool", "on_device", "ready", "__weakref__")

    def __init__(self, tensor: torch.Tensor, host: torch.Tensor, pool: HostPool):
        self.device, self.dtype, self.shape = tensor.device, tensor.dtype, tensor.shape
        self.host, self.pool = host, pool
        self.on_device: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None

    def host_view(self) -> torch.Tensor:
        return self.host.view(self.dtype).view(self.shape)

    def __del__(self) -> None:  # an unpacked (or never needed) tensor gives its buffer back
        if self.host is not None:
            self.pool.give(self.host)
            self.host = None


class offload_activations(saved_tensors_hooks):  # noqa: N801 - a context manager, named like torch's own
    """`with offload_activations(min_bytes=1 << 20, keep=model, pool=pool) as off: loss = model(...)`, then
    `loss.backward()` anywhere; `off.offloaded_bytes` / `off.offloaded_tensors` count what went to host memory and
    `off.kept_bytes` what stayed on the device because the pool was full. Without `pool`, a pool of its own (pinned
    on CUDA, no capacity limit) serves this one forward."""

    def __init__(self, min_bytes: int = 1 << 20, pin: bool = True, keep: nn.Module | None = None,
                 pool: HostPool | None = None):
        self.min_bytes = min_bytes
        self.pool = pool if pool is not None else HostPool(pin=pin)
        self.offloaded_bytes = 0
        self.offloaded_tensors = 0
        self.kept_bytes = 0
        self._kept: set[int] = set()
        if keep is not None:
            self._kept = {_storage_ptr(t) for t in (*keep.parameters(), *keep.buffers())}
        self._stream: torch.cuda.Stream | None = None
        # in the order forward saved them (backward mostly wants them reversed); weak, so that a tensor autograd
        # drops unused gives its buffer back at once
        self._saved: list[weakref.ref[_Offloaded]] = []
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> "offload_activations":
        super().__enter__()
        return self

    def _stays(self, tensor: torch.Tensor) -> bool:
        # autograd hands a linear layer's weight over as a view (its transpose): look at the base too
        if (isinstance(tensor, (nn.Parameter, DTensor)) or isinstance(tensor._base, nn.Parameter)
                or tensor.is_sparse):
            return True
        nbytes = tensor.numel() * tensor.element_size()
        return nbytes < self.min_bytes or tensor.untyped_storage().data_ptr() in self._kept

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _Offloaded:
        if self._stays(tensor) or tensor.layout != torch.strided:
            return tensor
        nbytes = tensor.numel() * tensor.element_size()
        host = self.pool.take(nbytes)
        if host is None:  # the pool is full: this one stays on the device
            self.kept_bytes += nbytes
            return tensor
        packed = _Offloaded(tensor, host, self.pool)
        if tensor.device.type == "cuda":
            side = self._side_stream(tensor.device)
            side.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(side):
                packed.host_view().copy_(tensor, non_blocking=self.pool.pin)
            tensor.record_stream(side)  # its memory is not reused before the copy has read it
        else:
            packed.host_view().copy_(tensor)
        self._saved.append(weakref.ref(packed))
        self.offloaded_bytes += nbytes
        self.offloaded_tensors += 1
        return packed

    def _fetch(self, packed: _Offloaded) -> None:
        """Start the copy of `packed` back to its device (on the side stream on CUDA)."""
        if packed.on_device is not None:
            return
        if packed.device.type != "cuda":
            packed.on_device = packed.host_view().to(packed.device, copy=True)
            return
        current = torch.cuda.current_stream(packed.device)
        out = torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)
        side = self._side_stream(packed.device)
        side.wait_stream(current)  # `out`'s memory may still be read by work queued before it was allocated
        with torch.cuda.stream(side):  # after the copy to the host on the same stream
            out.copy_(packed.host_view(), non_blocking=self.pool.pin)
            packed.ready = torch.cuda.Event()
            packed.ready.record(side)
        packed.on_device = out

    def _unpack(self, packed: torch.Tensor | _Offloaded) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        self._fetch(packed)
        # prefetch the one forward saved just before: the next backward will need
        i = next((j for j in range(len(self._saved) - 1, -1, -1) if self._saved[j]() is packed), None)
        if i is not None:
            self._saved.pop(i)
            before = self._saved[i - 1]() if i > 0 else None
            if before is not None:
                self._fetch(before)
        out = packed.on_device
        if packed.ready is not None:
            torch.cuda.current_stream(packed.device).wait_event(packed.ready)
        packed.on_device, packed.ready = None, None
        if packed.host is not None:  # the side stream's later copies into this buffer come after this one
            self.pool.give(packed.host)
            packed.host = None
        return out


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def pool_share(available: int, held_back: int, processes: int) -> int:
    """Bytes of host memory each of `processes` processes of one machine takes for its pool when `available` bytes
    are free and each will take `held_back` more after making it: 90 % of the rest, split between them."""
    return int(max(0, available - held_back * processes) * 0.9 / processes)


def host_pool_for(max_host_gib: float, pin: bool = True, held_back: int = 0) -> HostPool:
    """The pool of `checkpointing.offload_host_gib`: that many GiB (0: 90 % of the host memory available now, shared
    by the processes torchrun starts on this machine). `held_back`: host bytes each process will take after its pool
    is made (Inductor's compile workers, forked at the first compile), left out of what is available. Asking for
    more than is available is a ConfigError before any step runs."""
    free = available_host_bytes()
    # every rank of this machine has its own pool: each counts what is available when all of them are full
    local = local_world_size()
    available = None if free is None else max(0, free - held_back * local)
    later = (f" once the compile workers take their {held_back * local / 2**30:.1f} GiB (TORCHINDUCTOR_COMPILE_THREADS "
             "sets how many)" if held_back else "")
    if max_host_gib > 0:
        want = int(max_host_gib * 2**30)
        if available is not None and want * local > available:
            each = f" for each of the {local} processes of this machine" if local > 1 else ""
            raise ConfigError(
                f"checkpointing.offload_host_gib = {max_host_gib:g}{each} but this machine has "
                f"{available / 2**30:.1f} GiB of host memory available{later}; set it to at most "
                f"{pool_share(free, held_back, local) / 2**30:.0f} (or 0: 90 % of what is available, shared), and what "
                "does not fit stays on the GPU")
        return HostPool(want, pin=pin)
    return HostPool(None if free is None else pool_share(free, held_back, local), pin=pin)
