"""Multi-process execution: the device mesh from `[parallel]` (mesh), FSDP2 sharding of the model (fsdp) and Ulysses
sequence parallelism inside it (sequence). docs/parallel.md describes what is integrated so far."""

from tttvideo.parallel.fsdp import shard_model
from tttvideo.parallel.mesh import Degrees, ParallelPlan, close_parallel, init_parallel, resolve_degrees
from tttvideo.parallel.sequence import SequenceParallel

__all__ = ["Degrees", "ParallelPlan", "SequenceParallel", "close_parallel", "init_parallel", "resolve_degrees",
           "shard_model"]
