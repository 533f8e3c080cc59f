"""The measured half of the planner: activation memory and step time per token, per GPU kind.

Local attention works window by window and the TTT scan, the MLP and every projection token by token, so a step's
activation memory (its peak minus what `plan_count` counts) and its time are, for a fixed setup, linear in the tokens
one GPU holds: value = per_token x tokens + fixed. The two coefficients are fitted by least squares from profiler
runs at two or more durations (`benchmarks/plan_calibration.py`, which writes `plan_costs.json` beside this module
and checks the predictions against held-out runs).

A coefficient pair belongs to a regime, the switches that change what a step allocates or how long it takes:
- activation, training: preset, weight dtype (fp32 weights under bf16 autocast keep bf16 copies), adapter, activation
  checkpointing policy, activation offload;
- activation, sampling: preset, weight dtype, forward (plain at batch 2 or 1, or chunked with G TTT head groups);
- time: the activation regime, and in training whether the fp8 weights stream from host memory (copies on the
  compute stream, not hidden). Weight storage and optimizer are left out: an fp8 layer's upcast and an 8-bit AdamW
  step cost under 3% of a step (docs/memory.md), below what the fit resolves; sampling's block streaming is left
  out too (prefetched on a side stream, +2% at 63 s).
Weights, gradients and optimizer state are counted, not fitted, so one regime covers every weight dtype and
optimizer. A regime with no measurement has no prediction: the planner lists it as unmeasured and never picks it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tttvideo.config.schema import Config

COSTS_FILE = Path(__file__).with_name("plan_costs.json")


@dataclass(frozen=True)
class Linear:
    """value = per_token x tokens + fixed, fitted from `points` runs."""

    per_token: float
    fixed: float
    points: int = 0

    def __call__(self, tokens: float) -> float:
        return self.per_token * tokens + self.fixed

    @classmethod
    def fit(cls, points: list[tuple[float, float]]) -> "Linear":
        """Least squares through (tokens, value) points; one point gives a line through the origin."""
        if not points:
            raise ValueError("no points to fit")
        if len({t for t, _ in points}) == 1:
            t, v = points[0][0], sum(v for _, v in points) / len(points)
            return cls(v / t, 0.0, len(points))
        n = len(points)
        mt = sum(t for t, _ in points) / n
        mv = sum(v for _, v in points) / n
        slope = sum((t - mt) * (v - mv) for t, v in points) / sum((t - mt) ** 2 for t, _ in points)
        return cls(slope, mv - slope * mt, n)


@dataclass
class CostTable:
    gpu: str
    device: str = ""
    source: str = ""
    activation: dict[str, Linear] = field(default_factory=dict)
    time: dict[str, Linear] = field(default_factory=dict)
    # measured sequence-parallel efficiency per degree: step time on sp GPUs = one GPU's / (sp x efficiency)
    sp_efficiency: dict[int, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        def lines(d: dict[str, Linear]) -> dict[str, Any]:
            return {k: {"per_token": v.per_token, "fixed": v.fixed, "points": v.points} for k, v in sorted(d.items())}

        return {"gpu": self.gpu, "device": self.device, "source": self.source,
                "activation": lines(self.activation), "time": lines(self.time),
                "sp_efficiency": {str(k): v for k, v in sorted(self.sp_efficiency.items())}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CostTable":
        def lines(x: dict[str, Any]) -> dict[str, Linear]:
            return {k: Linear(float(v["per_token"]), float(v["fixed"]), int(v.get("points", 0))) for k, v in x.items()}

        return cls(d["gpu"], d.get("device", ""), d.get("source", ""), lines(d.get("activation", {})),
                   lines(d.get("time", {})), {int(k): float(v) for k, v in d.get("sp_efficiency", {}).items()})


def known_gpus(path: Path = COSTS_FILE) -> list[str]:
    return sorted(json.loads(path.read_text())) if path.is_file() else []


def load_costs(gpu: str, path: Path = COSTS_FILE) -> CostTable:
    """The committed table of one GPU kind ("h100", ...)."""
    from tttvideo.errors import UserError

    if path != COSTS_FILE and not path.is_file():
        raise UserError(f"costs file {path} does not exist; benchmarks/plan_calibration.py writes one")
    try:
        tables = json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError as err:
        raise UserError(f"costs file {path} is not valid JSON ({err}); write it with benchmarks/plan_calibration.py"
                        ) from None
    if gpu not in tables:
        raise UserError(f"no measured costs for GPU kind {gpu!r}; measured: {', '.join(sorted(tables)) or 'none'} "
                        f"(benchmarks/plan_calibration.py measures a new one); pick the nearest with --gpu-kind")
    return CostTable.from_dict(tables[gpu])


def save_costs(table: CostTable, path: Path = COSTS_FILE) -> None:
    tables = json.loads(path.read_text()) if path.is_file() else {}
    tables[table.gpu] = table.to_dict()
    path.write_text(json.dumps(tables, indent=1, sort_keys=True) + "\n")


# ------------------------------------------------------------------------------------------------ regime keys
def checkpoint_policy(cfg: Config) -> str:
    """'none', 'block' (whole blocks), 'sub-block' (blocks and their four parts, as the stage configs), or 'custom'
    (per-layer rules or another mix: not a regime the planner proposes)."""
    ck = cfg.checkpointing
    parts = (ck.attention, ck.forward_ttt, ck.reverse_ttt, ck.mlp)
    if ck.layers or (ck.block and ck.group_size != 1):
        return "custom"
    if not ck.block and not any(parts):
        return "none"
    if ck.block and not any(parts):
        return "block"
    if ck.block and all(parts):
        return "sub-block"
    return "custom"


def sample_forward(cfg: Config) -> str:
    m = cfg.memory
    if m.chunked_inference:
        return f"chunked-g{m.ttt_head_groups}"
    return "plain-b2" if cfg.sample.cfg_batched else "plain-b1"


def activation_key(cfg: Config, phase: str) -> str:
    if phase == "sample":
        return f"{cfg.model.preset}|{cfg.model.dtype}|sample|{sample_forward(cfg)}"
    offload = "offload" if cfg.checkpointing.offload_activations else "resident"
    return f"{cfg.model.preset}|{cfg.model.dtype}|train|{cfg.model.adapter}|{checkpoint_policy(cfg)}|{offload}"


def time_key(cfg: Config, phase: str) -> str:
    if phase == "sample":
        return activation_key(cfg, phase)
    return activation_key(cfg, phase) + ("|streamed" if cfg.memory.stream_frozen_weights else "")
