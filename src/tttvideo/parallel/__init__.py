"""Multi-process execution: the device mesh from `[parallel]` (mesh), FSDP2 sharding of the model (fsdp) and Ulysses
sequence parallelism inside it (sequence). docs/parallel.md describes what is integrated so far.

The names below load their module on first use: `tttvideo.parallel.launch` (a process's rank, read from the
environment) is imported by every command before its inputs are checked, and must not pull in FSDP and torch."""

from __future__ import annotations

import importlib

_HOMES = {"shard_model": "fsdp", "Degrees": "mesh", "ParallelPlan": "mesh", "close_parallel": "mesh",
          "init_parallel": "mesh", "resolve_degrees": "mesh", "SequenceParallel": "sequence"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
