"""The device mesh of a torchrun launch, from the config's `[parallel]` section.

WORLD_SIZE ranks form a 3-D mesh ("dp_replicate", "dp_shard", "sp"), sp innermost, so that the ranks of one
sequence-parallel group are neighbours (one host, NVLink). Data parallelism runs over dp_replicate x dp_shard (each
such rank reads its own samples); the sp ranks of a group share one sample. FSDP shards the parameters over
dp_shard x sp (the sp ranks hold partial gradients that its reduce-scatter completes, as torchtitan does for context
parallelism) and, with dp_replicate > 1, replicates that over dp_replicate (HSDP).

With WORLD_SIZE 1 nothing is initialised: the plan has no mesh and no sequence parallelism, and the model runs its
one-process code path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tttvideo.config.schema import ParallelConfig
from tttvideo.errors import ConfigError, UserError
from tttvideo.parallel.group import bound_mesh_timeouts
from tttvideo.parallel.sequence import SequenceParallel

MESH_DIMS = ("dp_replicate", "dp_shard", "sp")


@dataclass(frozen=True)
class Degrees:
    """The size of each mesh dimension, validated against the world size and the model."""

    dp_replicate: int
    dp_shard: int
    sp: int

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.sp

    @property
    def data_parallel(self) -> int:
        """Ranks that read different samples."""
        return self.dp_replicate * self.dp_shard


def check_tensor_parallel(cfg: ParallelConfig, instead: str) -> None:
    """Only tensor_parallel = 1 exists; `instead` names the keys that split the work."""
    if cfg.tensor_parallel != 1:
        raise ConfigError(f"parallel.tensor_parallel = {cfg.tensor_parallel}: tensor parallelism is not implemented; "
                          f"split the work with {instead} instead")


def check_sp_divides_heads(cfg: ParallelConfig, heads: int) -> None:
    """Ulysses gives each sp rank whole attention heads: sp must divide the model's `heads`."""
    if heads % cfg.sp:
        divisors = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
        raise ConfigError(f"parallel.sp = {cfg.sp} does not divide the model's {heads} attention heads; use one of "
                          f"{divisors}")


def resolve_degrees(cfg: ParallelConfig, heads: int, world_size: int) -> Degrees:
    """The degrees of `cfg` for `world_size` ranks and a model of `heads` attention heads; dp_shard = -1 takes what
    dp_replicate and sp leave. Every inconsistency is one ConfigError naming the key."""
    check_tensor_parallel(cfg, "parallel.dp_shard and parallel.sp")
    if cfg.dp_shard == 0 or cfg.dp_shard < -1:
        raise ConfigError(f"parallel.dp_shard = {cfg.dp_shard} is not a degree; use -1 (the ranks dp_replicate and sp "
                          f"leave) or a number of ranks from 1 up")
    check_sp_divides_heads(cfg, heads)
    if world_size % cfg.sp:
        raise ConfigError(f"parallel.sp = {cfg.sp} does not divide the world size {world_size} (WORLD_SIZE)")
    dp_shard = cfg.dp_shard
    if dp_shard == -1:
        if world_size % (cfg.dp_replicate * cfg.sp):
            raise ConfigError(f"parallel.dp_replicate x sp = {cfg.dp_replicate} x {cfg.sp} does not divide the world "
                              f"size {world_size} (WORLD_SIZE), so parallel.dp_shard = -1 has no whole value")
        dp_shard = world_size // (cfg.dp_replicate * cfg.sp)
    degrees = Degrees(cfg.dp_replicate, dp_shard, cfg.sp)
    if degrees.world_size != world_size:
        raise ConfigError(f"parallel.dp_replicate x dp_shard x sp = {cfg.dp_replicate} x {dp_shard} x {cfg.sp} = "
                          f"{degrees.world_size}, but the world size (WORLD_SIZE) is {world_size}; the product must "
                          f"equal it (dp_shard = -1 fills it in)")
    return degrees


@dataclass(frozen=True)
class ParallelPlan:
    """What one rank needs to run its part: the degrees, the mesh, its data-parallel coordinates and, with sp > 1,
    its sequence-parallel group (pass `sequence` to the model's forward)."""

    degrees: Degrees
    mesh: DeviceMesh | None  # None with one rank
    fsdp_mesh: DeviceMesh | None  # (dp_replicate, dp_shard x sp) or (dp_shard x sp,); None with one rank
    sequence: SequenceParallel | None  # None with sp = 1
    dp_rank: int  # which samples this rank reads: 0 .. degrees.data_parallel - 1

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @property
    def dp_size(self) -> int:
        return self.degrees.data_parallel


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_parallel(cfg: ParallelConfig, heads: int, device_type: str | None = None) -> ParallelPlan:
    """Validate `cfg` against WORLD_SIZE and the model's `heads`, then build the mesh (initialising the default
    process group if torchrun started this process and nobody has yet). device_type: 'cuda' or 'cpu' (gloo);
    None picks CUDA when present."""
    degrees = resolve_degrees(cfg, heads, world_size())
    if degrees.world_size == 1:
        return ParallelPlan(degrees, None, None, None, 0)
    if not hasattr(DeviceMesh, "_unflatten"):
        raise UserError(f"multi-process runs need torch >= 2.9 (DeviceMesh._unflatten); this is {torch.__version__}")
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # One flat mesh, unflattened into the named views (torchtitan's way: slicing a flattened dimension out of the
    # 3-D mesh is deprecated). Each view makes its own process groups over the same ranks.
    world = init_device_mesh(device_type, (degrees.world_size,), mesh_dim_names=("world",))
    mesh = world._unflatten(0, (degrees.dp_replicate, degrees.dp_shard, degrees.sp), MESH_DIMS)
    fsdp = world._unflatten(0, (degrees.dp_replicate, degrees.dp_shard * degrees.sp), ("dp_replicate", "dp_shard_sp"))
    fsdp_mesh = fsdp if degrees.dp_replicate > 1 else fsdp["dp_shard_sp"]
    bound_mesh_timeouts(cfg, mesh, fsdp)
    sequence = SequenceParallel.of(mesh["sp"].get_group()) if degrees.sp > 1 else None
    dp_rank = mesh["dp_replicate"].get_local_rank() * degrees.dp_shard + mesh["dp_shard"].get_local_rank()
    return ParallelPlan(degrees, mesh, fsdp_mesh, sequence, dp_rank)


def barrier() -> None:
    """`dist.barrier()` on the default group, naming this rank's GPU to NCCL: without it NCCL guesses the device
    and torch warns on every rank at every barrier ("barrier(): using the device under current context")."""
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def close_parallel(wait: bool = True) -> None:
    """Tear down the default process group if this process has one (end of a run, or of a test). With `wait`
    (a run that completed on every rank) the ranks first wait for each other, so that none closes its connections
    while another still talks over them: a gloo rank that finished first once died in teardown ("terminate called
    without an active exception") after a complete run. A rank leaving on an error does not wait: the others may
    be inside another collective."""
    if dist.is_available() and dist.is_initialized():
        if wait:
            barrier()
        dist.destroy_process_group()
