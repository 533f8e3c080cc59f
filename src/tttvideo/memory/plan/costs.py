"""The measured half of the planner: activation memory and step time as functions of the tokens one GPU holds, per
GPU kind, for the regimes the counted block model (`tttvideo.memory.plan.activations`, whose measured constants sit
in the same table under "blocks", one table a backbone) does not cover.

Local attention works window by window and the TTT scan, the MLP and every projection token by token, so for a
fixed setup a step's activation memory (its peak minus what `count` counts) and its time grow with the tokens
and nothing else. Not always on one line: the plain sampling forward measured 205-210 KB per token at 3-18 s and
173 KB at 63 s. So a cost is the measured points themselves (`Curve`): linear between two measured token counts,
along the nearest two beyond them. What the allocator reserves above a step's peak is a curve over the tokens as
well (`CostTable.reserve`). `benchmarks/plan_calibration.py` measures the points, writes `costs.json` beside this
module and checks the predictions against held-out runs.

A curve belongs to a regime, the switches that change what a step allocates or how long it takes (the techniques
whose `regime` is "activation", `tttvideo.memory.techniques`, each naming its part of the key):
- activation, training: preset, weight dtype (fp32 weights under bf16 autocast keep bf16 copies), adapter, activation
  checkpointing policy, activation offload;
- activation, sampling: preset, weight dtype, forward (plain at batch 2 or 1, or chunked with G TTT head groups);
- time: the activation regime alone, a micro-batch's step without its optimizer step. Weight storage and streaming
  are left out: an fp8 layer's upcast and the host copies of streamed weights each cost a few percent of a step
  (docs/memory.md: streamed fp8 weights +1.7% at 9 s, streamed sampling blocks +2% at 63 s). The optimizer step is
  not: an 8-bit AdamW step costs about 0.4 ms per trainable tensor (0.5 s for the lora set, against AdamW's 0.04
  s), about 7 % of a one-micro-batch lora step at 3 s. Its measured cost per optimizer (`optimizer`, fitted from
  benchmarks/optimizer_step.py by `tttvideo.memory.plan.optimizer_time`) is taken out of every calibration step
  and added back per target, divided by its micro-batches a step.
Weights, gradients and optimizer state are counted, not fitted, so one regime covers every weight dtype and
optimizer. A regime with no measurement has no prediction: the planner lists it as unmeasured and never picks it.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tttvideo.config.schema import Config
from tttvideo.memory.plan.optimizer_time import OptimizerCost
from tttvideo.memory.techniques import (ACTIVATION_OFFLOAD, CHECKPOINTING, CHUNKED_INFERENCE, FFN_CHUNKS,
                                        GUIDANCE_PASSES, NESTED_CHECKPOINTING)

COSTS_FILE = Path(__file__).with_name("costs.json")


@dataclass(frozen=True)
class Curve:
    """value(tokens) through measured (tokens, value) points: linear between neighbours, extended along the first or
    last two beyond them; one point gives a line through the origin."""

    points: tuple[tuple[float, float], ...]

    def __call__(self, tokens: float) -> float:
        pts = self.points
        if len(pts) == 1:
            return pts[0][1] * tokens / pts[0][0]
        k = min(max(bisect.bisect_left([t for t, _ in pts], tokens) - 1, 0), len(pts) - 2)
        (t0, v0), (t1, v1) = pts[k], pts[k + 1]
        return v0 + (v1 - v0) * (tokens - t0) / (t1 - t0)

    @classmethod
    def fit(cls, points: list[tuple[float, float]]) -> "Curve":
        """The curve through `points`, repeated measurements at one token count averaged."""
        if not points:
            raise ValueError("no points to fit")
        by_tokens: dict[float, list[float]] = {}
        for t, v in points:
            by_tokens.setdefault(float(t), []).append(float(v))
        return cls(tuple((t, sum(v) / len(v)) for t, v in sorted(by_tokens.items())))


@dataclass
class CostTable:
    gpu: str
    device: str = ""
    source: str = ""
    activation: dict[str, Curve] = field(default_factory=dict)
    time: dict[str, Curve] = field(default_factory=dict)
    # measured sequence-parallel efficiency per degree: step time on sp GPUs = one GPU's / (sp x efficiency)
    sp_efficiency: dict[int, float] = field(default_factory=dict)
    # per activation regime: what the allocator reserved above what was allocated at the peak (bytes), a curve over
    # the same tokens as the activation's. Not a share of the whole: the weights, allocated once in blocks of their
    # own size, leave no gaps, and what the gaps come from (a step's freed activations of other sizes) grows with the
    # tokens: the plain guided forward left 0.75 / 2.94 / 5.90 GiB at 3 / 9 / 18 s, 4.4 / 12.5 / 17.6 % of the peak
    reserve: dict[str, Curve] = field(default_factory=dict)
    # the counted block model's measured constants (tttvideo.memory.plan.activations), keyed by backbone
    # ("cogvideox": every constant; another backbone: those measured on it), None where not measured
    blocks: dict[str, Any] | None = None
    # per chunked sampling regime: the fixed part of the floor under its curve (`floor`), bytes
    floors: dict[str, float] = field(default_factory=dict)
    # per optimizer (train.optimizer): one step's time (`optimizer_time`); empty: the time curves hold the
    # calibration runs' optimizer steps, and no target's is added
    optimizer: dict[str, OptimizerCost] = field(default_factory=dict)

    def floor(self, cfg: Config, phase: str) -> int | None:
        """The least activation of a chunked sampling forward's batch-1 pass (`FLOOR_STREAMS`): its streams plus the
        regime's measured fixed part; None where the regime has no floor."""
        fixed = self.floors.get(activation_key(cfg, phase)) if phase == "sample" else None
        streams = chunked_floor_streams(cfg) if fixed is not None else None
        return None if streams is None else int(streams + fixed)

    def to_dict(self) -> dict[str, Any]:
        def lines(d: dict[str, Curve]) -> dict[str, Any]:
            return {k: [list(p) for p in v.points] for k, v in sorted(d.items())}

        return {"gpu": self.gpu, "device": self.device, "source": self.source,
                "activation": lines(self.activation), "time": lines(self.time),
                "sp_efficiency": {str(k): v for k, v in sorted(self.sp_efficiency.items())},
                "reserve": lines(self.reserve),
                **({"floors": dict(sorted(self.floors.items()))} if self.floors else {}),
                **({"optimizer": {k: v.to_dict() for k, v in sorted(self.optimizer.items())}}
                   if self.optimizer else {}),
                **({"blocks": self.blocks} if self.blocks else {})}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CostTable":
        def lines(x: dict[str, Any]) -> dict[str, Curve]:
            return {k: Curve(tuple((float(t), float(v)) for t, v in pts)) for k, pts in x.items()}

        return cls(d["gpu"], d.get("device", ""), d.get("source", ""), lines(d.get("activation", {})),
                   lines(d.get("time", {})), {int(k): float(v) for k, v in d.get("sp_efficiency", {}).items()},
                   lines(d.get("reserve", {})), d.get("blocks"),
                   {k: float(v) for k, v in d.get("floors", {}).items()},
                   {k: OptimizerCost.from_dict(v) for k, v in d.get("optimizer", {}).items()})


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
    if not isinstance(tables, dict):
        raise UserError(f"costs file {path} is not a costs table (a JSON object of GPU kinds); write it with "
                        f"benchmarks/plan_calibration.py")
    if gpu not in tables:
        raise UserError(f"no measured costs for GPU kind {gpu!r}; measured: {', '.join(sorted(tables)) or 'none'} "
                        f"(benchmarks/plan_calibration.py measures a new one); pick the nearest with --gpu-kind")
    try:
        return CostTable.from_dict(tables[gpu])
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise UserError(f"costs file {path}: the {gpu!r} table is not one benchmarks/plan_calibration.py writes "
                        f"({type(err).__name__}: {err}); write it with that script") from None


def save_costs(table: CostTable, path: Path = COSTS_FILE) -> None:
    """Write `table` as its GPU kind's entry; a table without block-model constants keeps those already there
    (benchmarks/plan_calibration.py fits the curves and the optimizer step, benchmarks/plan_accuracy.py --fit the
    block model)."""
    tables = json.loads(path.read_text()) if path.is_file() else {}
    kept = tables.get(table.gpu, {}).get("blocks")
    tables[table.gpu] = table.to_dict()
    if table.blocks is None and kept:
        tables[table.gpu]["blocks"] = kept
    path.write_text(json.dumps(tables, indent=1, sort_keys=True) + "\n")


# ------------------------------------------------------------------------------------------------ regime keys
def sample_forward(cfg: Config) -> str:
    """The sampling forward's regime: the chunked forward's head groups, or the plain one's guidance batch."""
    return CHUNKED_INFERENCE.regime_tag(cfg) or GUIDANCE_PASSES.regime_tag(cfg)


def long_range_tag(cfg: Config) -> str:
    """"" for the TTT-MLP layer every cost so far was measured with; "|<layer>" for any other (TTT-Linear, none, a
    baseline), so that its regimes are its own and unmeasured until someone measures them."""
    from tttvideo.sequence.build import configured_layer  # here: the rest of this module needs no torch

    layer = configured_layer(cfg.model)
    layer = f"ttt-{cfg.ttt.kind}" if layer == "ttt" else layer
    return "" if layer == "ttt-mlp" else f"|{layer}"


def activation_key(cfg: Config, phase: str) -> str:
    if phase == "sample":  # the dtype the sampler builds on a GPU (sample.dtype), where the costs are measured
        from tttvideo.dtypes import sampling_dtype  # here: the rest of this module needs no torch

        dtype = sampling_dtype(cfg.model.dtype, cfg.sample.dtype, cuda=True)
        return f"{cfg.model.preset}|{dtype}|sample|{sample_forward(cfg)}{long_range_tag(cfg)}"
    extra = "".join("|" + tag for tag in (NESTED_CHECKPOINTING.regime_tag(cfg), FFN_CHUNKS.regime_tag(cfg)) if tag)
    return (f"{cfg.model.preset}|{cfg.model.dtype}|train|{cfg.model.adapter}|{CHECKPOINTING.regime_tag(cfg)}|"
            f"{ACTIVATION_OFFLOAD.regime_tag(cfg)}{extra}{long_range_tag(cfg)}")


def time_key(cfg: Config, phase: str) -> str:
    return activation_key(cfg, phase)


# The chunked sampling forward (`tttvideo.models.chunked_inference`) peaks either inside a TTT scan, where the stream,
# the attention output and the scan's buffers for one head group are alive (4-6 stream-sized tensors: the curves
# follow that peak), or outside the scan, attention window by window and the MLP over token chunks: the stream and
# the attention output (FLOOR_STREAMS) and a working set of one window or chunk that does not grow with the video.
# Below the measured lengths the curve's line can fall under the second peak, so the chunked regimes carry a floor:
# FLOOR_STREAMS streams plus a fixed part, the least (activation - FLOOR_STREAMS streams) of their calibration runs:
# every run's peak is at least that phase's, so the least is at or above its fixed part (the safe side).
FLOOR_STREAMS = 2


def chunked_floor_streams(cfg: Config) -> int | None:
    """FLOOR_STREAMS stream-sized tensors of a chunked sampling forward's batch-1 pass, bytes; None for a setup
    without the chunked forward."""
    if not CHUNKED_INFERENCE.is_on(cfg):
        return None
    from tttvideo.dtypes import sampling_dtype, torch_dtype  # here: the rest of this module needs no torch
    from tttvideo.models.backbone import get_preset, layout_of

    spec = get_preset(cfg.model.preset)
    item = torch_dtype(sampling_dtype(cfg.model.dtype, cfg.sample.dtype, cuda=True)).itemsize
    dim = spec.num_attention_heads * spec.attention_head_dim
    return FLOOR_STREAMS * layout_of(cfg).total_tokens * dim * item


def gpu_kind(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100': the cost table a device's name points to."""
    lowered = name.lower()
    for kind in ("h200", "h100", "a100", "l40s", "l4", "4090", "3090"):
        if kind in lowered:
            return kind
    return lowered.split()[-1] if lowered else ""
