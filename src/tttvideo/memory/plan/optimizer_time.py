"""The time of one optimizer step, which the planner adds to a micro-batch's model step once per optimizer step.

The time curves and the block model's time points are measured by steps of one micro-batch each (`tttv profile`,
`benchmarks/memory_techniques.py`, the stage chain at a global batch of one video a GPU), so each measured step
holds one optimizer step, of the optimizer its setup ran. `benchmarks/plan_calibration.py fit` takes that step out
of every time point before fitting, and `tttv plan` adds the target's back, divided by its micro-batches a step
(`train.grad_accum`): a recipe stage of 64 micro-batches pays it once per 64.

An optimizer step's time is measured apart (`benchmarks/optimizer_step.py`: one step over a setup's trainable
tensors with random gradients, per optimizer) and fitted per optimizer as
    seconds = per_tensor_s x trainable tensors + per_gradient_byte_s x gradient bytes,
both terms at least zero. On an H100 torchao's 8-bit AdamW is almost all the first (0.39 ms a tensor: one compiled
update each), AdamW (torch's fused multi-tensor step) almost all the second. Under FSDP2 each GPU steps its shard
of every tensor: the tensors count whole, the bytes divided by the shard degree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tttvideo.config.batch import batch_plan
from tttvideo.config.schema import Config
from tttvideo.errors import ConfigError

# bytes a value of each dtype the optimizer_step results name
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class OptimizerCost:
    """One optimizer's step time on one GPU kind: a cost per trainable tensor and per gradient byte."""

    per_tensor_s: float
    per_gradient_byte_s: float

    def __call__(self, tensors: int, gradient_bytes: float) -> float:
        return self.per_tensor_s * tensors + self.per_gradient_byte_s * gradient_bytes

    def to_dict(self) -> dict[str, float]:
        return {"per_tensor_s": self.per_tensor_s, "per_gradient_byte_s": self.per_gradient_byte_s}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OptimizerCost:
        return cls(float(d["per_tensor_s"]), float(d["per_gradient_byte_s"]))


def _least_squares(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(a, b) >= 0 minimising the squared relative error of a x tensors + b x bytes against seconds, over rows of
    (tensors, bytes, seconds); one term alone where both together would make one negative."""
    x = np.array([[t / s, g / s] for t, g, s in rows])
    ones = np.ones(len(rows))

    def solve(cols: list[int]) -> np.ndarray:
        out = np.zeros(2)
        out[cols] = np.linalg.lstsq(x[:, cols], ones, rcond=None)[0]
        return out

    both = solve([0, 1])
    if (both >= 0).all():
        return float(both[0]), float(both[1])
    best = min((solve([0]), solve([1])), key=lambda ab: float(((x @ ab - 1) ** 2).sum()))
    return float(best[0]), float(best[1])


def fit_optimizer_costs(rows: list[dict[str, Any]]) -> dict[str, OptimizerCost]:
    """Per optimizer, the cost fitted to `benchmarks/optimizer_step.py`'s rows (its JSON's "rows": optimizer,
    tensors, params, dtype, median_step_s)."""
    by: dict[str, list[tuple[float, float, float]]] = {}
    for r in rows:
        if r.get("median_step_s"):
            grad_bytes = r["params"] * DTYPE_BYTES[r["dtype"]]
            by.setdefault(r["optimizer"], []).append((float(r["tensors"]), float(grad_bytes),
                                                      float(r["median_step_s"])))
    return {name: OptimizerCost(*_least_squares(points)) for name, points in sorted(by.items())}


def optimizer_step_s(costs: dict[str, OptimizerCost], cfg: Config, gpus: int = 1) -> float | None:
    """Seconds of one optimizer step of `cfg`'s trainable tensors (its `train.optimizer`) on each of `gpus` GPUs;
    None where that optimizer was not measured."""
    from tttvideo.memory.plan.count import fsdp_shard_degree, model_bytes

    cost = costs.get(cfg.train.optimizer)
    if cost is None:
        return None
    b = model_bytes(cfg)
    return cost(b.trainable_tensors, b.gradients / fsdp_shard_degree(cfg, gpus))


def micro_batches(cfg: Config, gpus: int = 1) -> int:
    """Micro-batches per optimizer step of a training launch on `gpus` GPUs, as the trainer derives them
    (`tttvideo.config.batch.batch_plan` over the data-parallel replicas); a global batch the launch does not divide,
    which the trainer refuses, is rounded up here, so that the planner still ranks the setup."""
    t = cfg.train
    replicas = max(1, gpus // max(1, cfg.parallel.sp))
    try:
        return batch_plan(t, replicas)[0]
    except ConfigError:
        return max(1, math.ceil(t.global_batch / (t.batch_size * replicas)))
