"""The trainer's view of a torchrun launch: which rank this is, who reads which samples, and the few collectives the
training loop needs (agreeing on a loss, a flag, a decision rank 0 took).

With WORLD_SIZE 1 `TrainRanks.start` initialises nothing (`distributed` is false), every collective is the identity
and the trainer runs its one-process code path. Otherwise the process group and the mesh come from
`tttvideo.parallel.init_parallel`, the model is sharded with FSDP2 over `plan.fsdp_mesh`, and the ranks of one
sequence-parallel group share a data-parallel rank, so they read the same samples and draw the same noise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from tttvideo.config.schema import Config
from tttvideo.errors import ConfigError, UserError
from tttvideo.parallel import ParallelPlan, close_parallel, init_parallel, shard_model
from tttvideo.parallel.mesh import barrier
from tttvideo.parallel.group import start_group
from tttvideo.parallel.watchdog import PeerWatch
# re-exported: the trainer and `tttv train` import them from here
from tttvideo.parallel.launch import SharedError, check_launch, launch_rank, rank_device

if TYPE_CHECKING:
    from tttvideo.models.backbone import Backbone
    from tttvideo.parallel import SequenceParallel

T = TypeVar("T")
P = TypeVar("P")

__all__ = ["SharedError", "TrainRanks", "launch_rank", "rank_device"]


@dataclass
class TrainRanks:
    plan: ParallelPlan
    rank: int
    world_size: int
    device: torch.device  # where the collectives' tensors live (nccl takes CUDA tensors only)
    watch: PeerWatch | None = field(default=None, repr=False)  # None with one process

    @classmethod
    def start(cls, cfg: Config, heads: int, device: torch.device) -> "TrainRanks":
        """(WORLD_SIZE > 1) Start the process group (nccl on CUDA, gloo on CPU) with its watch and compare the
        ranks' configs, then validate `[parallel]` against WORLD_SIZE and the model's `heads` and build the mesh."""
        world = check_launch("train", "training")
        # the ranks' configs are compared first: a config only some ranks have may fail the checks below on those
        # ranks alone, whose SharedError rank 0 would then never say
        watch = start_group(cfg, "train", device.type) if world > 1 else None
        if world > 1 and cfg.train.precision == "fp16":
            raise SharedError("train.precision 'fp16' is not supported with several processes (the gradient scaler "
                              "does not unscale sharded gradients); use 'bf16'")
        try:
            plan = init_parallel(cfg.parallel, heads, device_type=device.type)
        except ConfigError as err:
            raise SharedError(str(err)) from None
        if not plan.distributed:
            return cls(plan, 0, 1, device)
        return cls(plan, dist.get_rank(), dist.get_world_size(), device, watch)

    # ------------------------------------------------------------------ who is who
    @property
    def distributed(self) -> bool:
        return self.plan.distributed

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.plan.dp_rank

    @property
    def dp_size(self) -> int:
        return self.plan.dp_size

    @property
    def sequence(self) -> SequenceParallel | None:
        return self.plan.sequence

    def shard(self, model: Backbone, param_dtype: torch.dtype | None) -> None:
        """FSDP2 over the plan's mesh; gradients are reduced in fp32 whatever the compute dtype."""
        if self.distributed:
            shard_model(model, self.plan.fsdp_mesh, param_dtype=param_dtype, reduce_dtype=torch.float32)

    def close(self) -> None:
        if self.distributed:
            with self.phase("the last barrier"):
                barrier()
            if self.watch is not None:
                self.watch.stop()
            close_parallel(wait=False)

    # ------------------------------------------------------------------ phases, for the watch's messages
    def phase(self, name: str, step: int | None = None, slow: bool = False) -> AbstractContextManager[None]:
        """What this rank is doing (`PeerWatch.phase`); nothing with one process."""
        if self.watch is None:
            return contextlib.nullcontext()
        return self.watch.phase(name, step, slow=slow)

    def phases(self, inner: P) -> P:
        """`inner` (the OOM watch, a `StepProfiler`) with each phase the step opens in it opened in the watch too;
        `inner` itself with one process."""
        if self.watch is None:
            return inner
        return _AlsoWatched(inner, self)  # type: ignore[return-value]

    # ------------------------------------------------------------------ collectives (identities on one process)
    def barrier(self) -> None:
        if self.distributed:
            with self.phase("barrier"):
                barrier()

    def broadcast(self, value: T) -> T:
        """Rank 0's `value` on every rank."""
        if not self.distributed:
            return value
        box = [value]
        with self.phase("rank 0's decision" if self.is_main else "waiting for rank 0's decision"):
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def on_main(self, fn: Callable[[], T]) -> T:
        """Run `fn` on rank 0 alone and give every rank its result; a UserError there is raised on every rank as
        a SharedError (so that the others do not wait forever for a rank that stopped)."""
        if not self.distributed:
            return fn()
        result: tuple[bool, object] = (True, None)
        if self.is_main:
            try:
                result = (True, fn())
            except UserError as err:
                result = (False, str(err))
        ok, value = self.broadcast(result)
        if not ok:
            raise SharedError(str(value))
        return value  # type: ignore[return-value]

    def mean(self, value: float) -> float:
        """The mean of `value` over all ranks (the ranks of an sp group hold the same loss, so this is also the
        mean over the data-parallel ranks)."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        with self.phase("all-reduce of the loss"):
            dist.all_reduce(t)
        return float(t[0]) / self.world_size

    def all_true(self, flag: bool) -> bool:
        if not self.distributed:
            return flag
        t = torch.tensor([0 if flag else 1], dtype=torch.int64, device=self.device)
        with self.phase("all-reduce of the finite-loss check"):
            dist.all_reduce(t)
        return int(t[0]) == 0

    def largest_floats(self, values: list[float], what: str = "the memory peaks") -> list[float]:
        """Each value's maximum over the ranks, in one all-reduce (the memory peaks a step reports are the
        largest of any rank's, not rank 0's alone); `what` names them in the watch's phase."""
        if not self.distributed:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        with self.phase(f"all-reduce of {what}"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [float(v) for v in t.tolist()]

    def largest(self, value: int) -> int:
        """`value`'s maximum over the ranks (a stop signal, a count: small integers, exact in float64)."""
        return int(self.largest_floats([value], "the stop signals")[0])



class _AlsoWatched:
    """A step profiler whose phases are also the watch's; every other attribute is the profiler's own."""

    def __init__(self, inner: Any, ranks: TrainRanks):
        self._inner, self._ranks = inner, ranks

    @contextlib.contextmanager
    def phase(self, name: str, step: int | None = None) -> Iterator[None]:
        with self._ranks.phase(name, step), self._inner.phase(name, step):
            yield

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
