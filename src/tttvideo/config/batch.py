"""How many micro-batches make an optimizer step: `train.batch_size`, `train.grad_accum` and `train.global_batch`
against the data-parallel replicas of a launch. The trainer derives its accumulation here, and the planner
(`tttvideo.memory.plan.optimizer_time`) the share of the optimizer step each micro-batch carries."""

from __future__ import annotations

from tttvideo.config.schema import TrainConfig
from tttvideo.errors import ConfigError


def batch_plan(train: TrainConfig, world_size: int) -> tuple[int, int]:
    """(grad_accum, global_batch) from batch_size, grad_accum and global_batch, checking that they agree."""
    per_step = train.batch_size * world_size
    if train.grad_accum == 0 and train.global_batch == 0:
        return 1, per_step
    if train.grad_accum == 0:
        if train.global_batch % per_step:
            raise ConfigError(
                f"train.global_batch {train.global_batch} is not a multiple of train.batch_size {train.batch_size} x "
                f"{world_size} GPU(s) = {per_step}; change one of them or set train.grad_accum"
            )
        return train.global_batch // per_step, train.global_batch
    if train.global_batch and train.global_batch != per_step * train.grad_accum:
        raise ConfigError(
            f"train.global_batch {train.global_batch} != batch_size {train.batch_size} x grad_accum "
            f"{train.grad_accum} x {world_size} GPU(s) = {per_step * train.grad_accum}; set grad_accum = 0 to derive it"
        )
    return train.grad_accum, per_step * train.grad_accum
