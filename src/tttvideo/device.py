"""Device selection shared by every command, and the compile-on-CUDA switch of the model's glue functions."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from tttvideo.config.loader import DEVICE_ADVICE, DEVICE_NAME
from tttvideo.errors import UserError


def resolve_device(name: str, field: str = "device") -> torch.device:
    """'auto' -> cuda when visible, else cpu; asking for cuda without one is a one-sentence error naming `field`
    (the config key or flag the value came from)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not DEVICE_NAME.fullmatch(name):  # the names a config's device field takes, so flag and file agree
        raise UserError(f"{field} is {name!r}, which is not a device; {DEVICE_ADVICE}")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"{field} is {name!r} but no CUDA device is visible; use 'cpu' or 'auto'")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"{field} is {name!r} but no Apple GPU (MPS) is available; use 'cpu' or 'auto'")
    return device


def cap_process_memory(gib: float, device: torch.device | str) -> float | None:
    """Limit this process's CUDA caching allocator on `device` to `gib` GiB
    (torch.cuda.set_per_process_memory_fraction with gib / the card's total memory), so that a run on a large card
    runs out of memory where a smaller card would (the CUDA context and other libraries' memory are outside the
    cap). Returns the fraction; on a non-CUDA device nothing is capped and it returns None."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = gib * 2**30 / total
    if not 0 < fraction <= 1:
        raise UserError(f"a memory cap of {gib} GiB does not fit {device}, which has {total / 2**30:.1f} GiB; use a "
                        f"cap above 0 and at most that")
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


_COMPILED: dict[Callable, Callable] = {}

# Compiles of one glue function a process may make (torch._dynamo's recompile_limit, 8 by default): one per input
# shape, gradient mode and caller (the block's gated add and the TTT wrapper's share a function). Past the limit
# Dynamo runs the function eagerly, with only a warning: a process that runs several layouts (the speed benchmark's
# training and 3-s and 63-s guided steps; training that samples at the end) lost its 63-s gated adds that way.
GLUE_RECOMPILE_LIMIT = 64


def compiled_on_cuda(fn: Callable, x: torch.Tensor, enabled: bool) -> Callable:
    """`fn` torch.compile'd when `enabled` and `x` is on CUDA (dynamic=False: one compile per input shape, the
    compiled function shared by every caller, up to GLUE_RECOMPILE_LIMIT shapes), `fn` itself elsewhere: compiling
    for the CPU is a C++ build per shape. For the elementwise glue around the model's big kernels
    (`ttt.compile_glue`, `model.compile_attention_glue`, `model.compile_block_glue`)."""
    if not (enabled and x.is_cuda):
        return fn
    if fn not in _COMPILED:
        allow_glue_recompiles()
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn]


def allow_glue_recompiles() -> None:
    """Raise Dynamo's per-function recompile limit to GLUE_RECOMPILE_LIMIT (never lower it)."""
    import torch._dynamo.config as dynamo

    dynamo.recompile_limit = max(dynamo.recompile_limit, GLUE_RECOMPILE_LIMIT)


def triton_runs_on(x: torch.Tensor, min_capability: tuple[int, int]) -> bool:
    """Whether a Triton kernel can run on `x`: on CUDA from compute capability `min_capability` on, with Triton
    installed; off CUDA only inside Triton's interpreter (TRITON_INTERPRET=1, how the tests run kernels on a CPU)."""
    if x.device.type != "cuda":
        return os.environ.get("TRITON_INTERPRET", "0") == "1"
    if torch.cuda.get_device_capability(x.device) < min_capability:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
