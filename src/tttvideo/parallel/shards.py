"""A whole tensor and this rank's part of it, for state kept beside FSDP2's sharded parameters: a one-process
checkpoint's optimizer state copied into the shards (`tttvideo.train.dcp`), the EMA of sharded weights
(`tttvideo.train.ema`), which is saved whole and read back by any number of processes."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`: the local shard of a DTensor, else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_part(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of `whole` (a tensor of `like`'s global shape) that this rank holds of `like`: a view, for a DTensor
    the region its placements give this rank (FSDP2's uneven last shard included), else `whole` itself."""
    if tuple(whole.shape) != tuple(like.shape):
        raise ValueError(f"a tensor of shape {tuple(whole.shape)} for one of {tuple(like.shape)}")
    if not isinstance(like, DTensor):
        return whole
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    return whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def gather_whole(part: torch.Tensor, like: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """The whole tensor of which `part` is this rank's part, laid out as `like` (a DTensor, or a plain tensor: then
    `part` is whole already), in host memory where `keep` (the rank that writes it), else None. A collective
    when `like` is a DTensor: every rank calls it, one tensor at a time, so a GPU holds one whole tensor at most."""
    if isinstance(like, DTensor):
        whole = DTensor.from_local(part, like.device_mesh, like.placements, shape=like.shape,
                                   stride=like.stride()).full_tensor()
    else:
        whole = part
    return whole.detach().to("cpu", copy=True) if keep else None


def reshard(model: torch.nn.Module) -> None:
    """Free every FSDP2 unit's gathered parameters, so that the sharded ones are the parameters again. A forward
    outside training (a validation video) leaves the root unit's gathered: a write into the shards then would not
    reach the next forward, which would use the gathered copy as it stands."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
