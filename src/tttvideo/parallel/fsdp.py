"""FSDP2 sharding of the long-video DiT.

Each transformer block is its own FSDP unit (its parameters are all-gathered just before it runs and freed after,
its gradients reduce-scattered as its backward ends), then the root takes what is left: the embeddings, the
timestep MLP and the output head. A `MixedPrecisionPolicy` sets the dtype the gathered parameters compute in and
the dtype gradients are reduced in; the sharded parameters (and so the optimizer state) keep the dtype they had.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

if TYPE_CHECKING:
    from tttvideo.models.backbone import Backbone


def shard_model(model: "Backbone", mesh: DeviceMesh, param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = None, reshard_after_forward: bool = True) -> "Backbone":
    """Shard `model` in place over `mesh` (1-D: FSDP; 2-D (replicate, shard): HSDP) and return it.

    param_dtype / reduce_dtype: None keeps the parameters' own dtype. reshard_after_forward=False keeps the
    gathered blocks between forward and backward (less communication, more memory). Gradients are averaged over
    the mesh: with sequence parallelism the mesh must include the sp ranks (`ParallelPlan.fsdp_mesh` does).
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # the root's parameters are used at the start (embeddings) and the end (output head) of the forward: keeping
    # them gathered through the blocks saves an all-gather in backward for a few MB
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    return model
