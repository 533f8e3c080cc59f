"""`tttv sample` under torchrun: which rank samples which story, with which sequence-parallel group, and which half
of classifier-free guidance.

The ranks form a mesh ("stories", "guidance", "sp"), sp innermost so that the ranks splitting one video's tokens are
neighbours (one host):

- sp (`parallel.sp`): Ulysses sequence parallelism inside the model; every rank of the group is called with the same
  inputs and returns the whole prediction;
- guidance (2 with `sample.split_guidance`, else 1): the first half computes the unconditional prediction, the second
  the conditional one, and one all-gather per step gives every rank both;
- stories (`parallel.dp_replicate x parallel.dp_shard`, or what is left of WORLD_SIZE with dp_shard = -1): each
  story group samples every n-th story, and its first rank decodes and writes them.

Every rank holds the whole model: no FSDP at inference, since the 5B transformer with TTT in bf16 (about 14.5 GB)
fits each GPU and sharding it would all-gather every block at every step. Every rank of a group draws the same
seeded noise and gets the same predictions, so all of them step the same latents.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tttvideo.config.schema import Config
from tttvideo.device import resolve_device
from tttvideo.errors import ConfigError, UserError
from tttvideo.parallel.group import bound_mesh_timeouts, start_group
from tttvideo.parallel.launch import SharedError, check_launch, rank_device
from tttvideo.parallel.mesh import check_sp_divides_heads, check_tensor_parallel
from tttvideo.parallel.sequence import SequenceParallel
from tttvideo.parallel.watchdog import active_watch, finish
from tttvideo.sample.solvers import GuidanceSchedule

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class SampleDegrees:
    guidance: int  # 2 with sample.split_guidance, else 1
    sp: int
    story_groups: int

    @property
    def world_size(self) -> int:
        return self.guidance * self.sp * self.story_groups


def resolve_sample_degrees(cfg: Config, heads: int, world_size: int) -> SampleDegrees:
    """The degrees of a sampling launch of `world_size` ranks for a model of `heads` attention heads; each
    inconsistency is one ConfigError naming the key."""
    par = cfg.parallel
    check_tensor_parallel(par, "parallel.sp and sample.split_guidance")
    if cfg.sample.offload_blocks:
        raise ConfigError("sample.offload_blocks is not supported with several processes (every rank holds the whole "
                          "model); set sample.offload_blocks = false, or sample in one process")
    check_sp_divides_heads(par, heads)
    if cfg.memory.chunked_inference and par.sp > 1:
        raise ConfigError(f"memory.chunked_inference runs the blocks of one process; with parallel.sp = {par.sp} "
                          f"each rank already holds 1/{par.sp} of the activations: set memory.chunked_inference = "
                          f"false, or parallel.sp = 1")
    guidance = 2 if cfg.sample.split_guidance else 1
    per_group = guidance * par.sp
    if par.dp_shard == -1:
        if world_size % per_group:
            raise ConfigError(f"{_product_text(guidance, par.sp)} = {per_group} does not divide the world size "
                              f"{world_size} (WORLD_SIZE); launch a multiple of {per_group} processes")
        groups = world_size // per_group
    else:
        groups = par.dp_replicate * par.dp_shard
    degrees = SampleDegrees(guidance, par.sp, groups)
    if degrees.world_size != world_size:
        raise ConfigError(f"{_product_text(guidance, par.sp)} x story groups (parallel.dp_replicate x dp_shard = "
                          f"{groups}) = {degrees.world_size}, but the world size (WORLD_SIZE) is {world_size}; the "
                          f"product must equal it (parallel.dp_shard = -1 fills it in)")
    return degrees


def _product_text(guidance: int, sp: int) -> str:
    split = "2 (sample.split_guidance)" if guidance == 2 else "1 (sample.split_guidance = false)"
    return f"{split} x parallel.sp = {guidance} x {sp}"


@dataclass(frozen=True)
class GuidanceSplit:
    """The two ranks that share one classifier-free-guided prediction: group rank 0 computes the unconditional
    pass, group rank 1 the conditional one."""

    group: dist.ProcessGroup
    conditional: bool  # this rank computes the conditional prediction

    def exchange(self, mine: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(unconditional, conditional) on both ranks, from this rank's prediction (one all-gather)."""
        parts = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(parts, mine.contiguous(), group=self.group)
        return parts[0], parts[1]


@dataclass
class SampleRanks:
    """This rank's part of a sampling launch."""

    degrees: SampleDegrees
    rank: int
    device: torch.device
    story_group: int  # which stories this rank samples: story_group, story_group + story_groups, ...
    sequence: SequenceParallel | None  # None with sp = 1
    split: GuidanceSplit | None  # None without sample.split_guidance
    writes: bool  # the first rank of its story group: it decodes and writes the group's videos

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def mine(self, items: list[T]) -> list[T]:
        """The entries of a per-story list that this rank's story group samples."""
        return items[self.story_group::self.degrees.story_groups]

    def gather(self, fn: Callable[[], list[T]]) -> list[T]:
        """Run `fn` on every rank and give every rank all their results, in rank order; a UserError on any rank is
        raised on all of them as a SharedError (so that no rank waits for one that stopped)."""
        try:
            outcome: tuple[bool, object] = (True, fn())
        except UserError as err:
            outcome = (False, f"{err}")
        outcomes: list[tuple[bool, object]] = [(True, [])] * self.degrees.world_size
        watch = active_watch()
        if watch is not None:  # a story group with one story more keeps the others waiting, legitimately
            watch.wait_for_all("their stories")
        dist.all_gather_object(outcomes, outcome)
        failed = [str(value) for ok, value in outcomes if not ok]
        if failed:
            raise SharedError(failed[0])
        return [item for _, value in outcomes for item in value]  # type: ignore[union-attr]

    def close(self) -> None:
        finish()
        if dist.is_initialized():
            dist.destroy_process_group()


def start_sample_ranks(cfg: Config, heads: int) -> SampleRanks:
    """Check the launch, start the process group (`tttvideo.parallel.group`: the ranks' configs compared), check
    the degrees (every rank raises the same SharedError), then build the mesh and this rank's groups."""
    world = check_launch("sample", "sampling")
    device = rank_device(resolve_device(cfg.sample.device, "sample.device"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # a bounded timeout, the watch, and the ranks' configs compared before the checks that a config only some ranks
    # have could fail on those ranks alone
    start_group(cfg, "sample", device.type)
    try:
        degrees = resolve_sample_degrees(cfg, heads, world)
    except ConfigError as err:
        raise SharedError(str(err)) from None
    warn_if_nothing_to_split(cfg)
    mesh = init_device_mesh(device.type, (degrees.story_groups, degrees.guidance, degrees.sp),
                            mesh_dim_names=("stories", "guidance", "sp"))
    bound_mesh_timeouts(cfg.parallel, mesh)
    sequence = SequenceParallel.of(mesh["sp"].get_group()) if degrees.sp > 1 else None
    split = None
    if degrees.guidance == 2:
        split = GuidanceSplit(mesh["guidance"].get_group(), conditional=mesh["guidance"].get_local_rank() == 1)
    writes = mesh["guidance"].get_local_rank() == 0 and mesh["sp"].get_local_rank() == 0
    return SampleRanks(degrees, dist.get_rank(), device, mesh["stories"].get_local_rank(), sequence, split, writes)


def warn_if_nothing_to_split(cfg: Config) -> None:
    """sample.split_guidance at guidance 1 for every step: there is no unconditional pass to split off, so the
    second half of the ranks repeats the conditional one."""
    s = cfg.sample
    if not s.split_guidance:
        return
    scales = GuidanceSchedule(s.cfg_schedule, s.cfg, s.cfg_start, s.cfg_ramp_exp).scales(s.steps)
    if all(scale == 1.0 for scale in scales):
        log.warning("sample.split_guidance = true does nothing at guidance scale 1 (sample.cfg = %g): both halves of "
                    "the ranks run the same conditional pass; set sample.split_guidance = false and use the ranks "
                    "for parallel.sp or more stories", s.cfg)
