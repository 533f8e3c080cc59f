"""`tttv plan`: predict the peak GPU memory and step time of every setup the project offers for a config, and pick
the fastest that fits.

A candidate is the config with one option of each memory technique it varies (`Candidate.options`, typed setters
that the techniques of `tttvideo.memory.techniques` offer):
- training: activation checkpointing (whole blocks, whole blocks keeping the attention outputs or those and the
  backbone's matrix products', or blocks and their four parts), activation offload to host
  memory, fp8 storage of the frozen weights (not with `sft`, which freezes none) resident or streamed from host
  memory (one GPU), AdamW or 8-bit AdamW, and on several GPUs the sequence-parallel degree (the rest FSDP2 sharding);
- sampling: the plain forward with guidance batched or in two passes, the chunked forward with 1, 2 or 4 TTT head
  groups, blocks streamed from host memory or resident, fp8 storage of the frozen weights, and on several GPUs
  sequence parallelism.
The adapter, the duration and the resolution are the user's experiment, not memory switches: they stay as given.

Each candidate's memory is a sum of counted parts. Weights, gradients and optimizer state are counted from the
model built on the meta device (`count`). What a step allocates beyond them comes, for training with every block
and sub-module checkpointed (the stage configs' policy, with the block inputs kept, nested or offloaded), from the
counted block model (`tttvideo.memory.plan.activations`: saved inputs, the working set of the block that runs, the
phase where the peak falls, host bytes, the allocator's reserved margin, the largest of a process's first step and
its later steps; its constants measured per backbone), and otherwise from
the measured per-token curves of the setup's regime (`costs`): its activations, and what the allocator reserves above
what is allocated, at least FRAGMENTATION of the peak (FRAGMENTATION_STREAMED with weights streamed from host
memory). A setup fits a card of M bytes when
its reserved peak + CUDA_CONTEXT <= M x (1 - margin) (default MARGIN, `tttv plan --margin`). Each prediction says
how it was made (`basis`): counted, interpolated between measured lengths, or extrapolated beyond them. The best
candidate is the fastest that fits; a candidate whose regime was never measured is listed but never chosen.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tttvideo.config.schema import Config
from tttvideo.dtypes import sampling_dtype
from tttvideo.errors import UserError
from tttvideo.memory.guard.compile_pool import compile_pool_bytes, compile_workers
from tttvideo.memory.plan.activations import (MEASURED_ADAPTERS, MEASURED_BACKBONES, BlockConstants, Breakdown,
                                              Geometry, Part, fits_block_model, train_peak)
from tttvideo.memory.plan.costs import FLOOR_STREAMS, CostTable, Curve, activation_key, time_key
from tttvideo.memory.plan.count import Counted, count, fsdp_shard_degree, process_host_bytes
from tttvideo.memory.plan.optimizer_time import micro_batches, optimizer_step_s
from tttvideo.memory.techniques import (ACTIVATION_OFFLOAD, ADAMW_8BIT, CHECKPOINTING, CHUNKED_INFERENCE, FFN_CHUNKS,
                                        FP8_STREAMING, FP8_WEIGHTS, GUIDANCE_PASSES, NESTED_CHECKPOINTING, REGISTRY,
                                        SAMPLE_BLOCK_OFFLOAD, SEQUENCE_PARALLEL, WINDOW_FORM, MemoryTechnique,
                                        Option)
from tttvideo.models.backbone import backbone_of, layout_of

GIB = 2**30
FRAGMENTATION = 0.05  # reserved above allocated at the peak, as a fraction (docs/memory.md: measured 2-8%)
# With streamed weights: on the H100 a 9-s run predicted at 21.96 GiB ran out of memory under a 23.2 GiB cap (5.6%
# above), where a resident one predicted at 44.78 GiB ran under 47.2 (5.4% above); docs/memory.md, plan check
FRAGMENTATION_STREAMED = 0.10
CUDA_CONTEXT = int(0.8 * GIB)  # measured 0.5-0.8 GiB outside PyTorch on H100 / H200 with torch 2.11
MARGIN = 0.05  # the share of the card the chosen setup leaves free (`tttv plan --margin`)
# Sampling on two H200s at 63 s against one GPU's batch-2 guided forward, the forward whose time the sample costs hold
# (benchmarks/results/sample_parallel_h200.json, one run): the two guided passes split over two GPUs take 34.1 s
# against 55.9 s (1.64x; against two passes of batch 1 it is the whole 2.01x), the batch-2 forward under sp = 2
# 38.6 s (1.45x: 72 % efficiency, where training's sp = 2 step measured 75 %)
SPLIT_GUIDANCE_SPEEDUP = 1.64
SAMPLE_SP_EFFICIENCY = {2: 0.724}
# ... and their activations (peak allocated less the 13.6 GiB of weights) against the one-GPU batch-2 forward's 53.0
# GiB: one batch-1 pass a rank (split) 26.5 GiB, 0.50; the batch-2 forward under sp = 2 38.8 GiB, 0.73 (not 0.5: the
# all-to-all buffers and the whole-sequence tensors each rank holds beside its half)
SPLIT_GUIDANCE_ACTIVATION = 0.50
SAMPLE_SP_ACTIVATION = {2: 0.73}


@dataclass(frozen=True)
class Candidate:
    """A setup the planner tries: the config with one option of each technique it varies applied."""

    label: str
    options: tuple[Option, ...]

    def apply(self, cfg: Config) -> Config:
        """A copy of `cfg` with the candidate's options set."""
        out = copy.deepcopy(cfg)
        for option in self.options:
            option.apply(out)
        return out

    def settings(self, applied: Config) -> dict[str, Any]:
        """The keys the candidate's options set, with their values in `applied` (`apply`'s result): what a plan
        file writes."""
        out: dict[str, Any] = {}
        for option in self.options:
            for key in option.keys:
                section, name = key.split(".")
                out.setdefault(key, getattr(getattr(applied, section), name))
        return out


@dataclass
class Prediction:
    candidate: Candidate
    config: Config
    tokens_per_gpu: int
    counted: Counted
    activation: int | None  # bytes; None when the regime was never measured
    step_s: float | None
    fits: bool | None  # None: unknown (not measured); False also when the host cannot hold the launch (host_fits)
    notes: list[str] = field(default_factory=list)
    reserved: int | None = None  # the allocator's reserved peak (what must fit the card)
    host: int = 0  # host bytes of what is offloaded
    breakdown: Breakdown | None = None  # the counted parts (block model setups)
    basis: str = ""  # how the activations were predicted: counted / interpolated / extrapolated / not measured
    # the step time against the same setup with the inputs kept (block model: recomputes, FFN chunks); ranks
    # setups whose time is not predicted
    relative_time: float = 1.0
    # videos one step trains: one per data-parallel rank (FSDP's ranks each take their own; an sp group one between
    # them), so that setups are ranked by time per video, not per step
    videos: int = 1
    # host bytes of a process beside what it offloads: libraries, the weights it loads, Inductor's compile workers
    # (`count.process_host_bytes`, `memory.guard.compile_pool.compile_pool_bytes`)
    host_process: int = 0
    # whether the launch's processes on one host fit its memory (None: not checked, no host size given)
    host_fits: bool | None = None
    # whether the reserved peak and the CUDA context fit the card less the margin, the host aside (None: unknown)
    gpu_fits: bool | None = None

    @property
    def host_total(self) -> int:
        """Host memory of one process: what it offloads and what it holds anyway."""
        return self.host + self.host_process

    @property
    def seconds_per_video(self) -> float | None:
        return None if self.step_s is None else self.step_s / self.videos

    @property
    def peak(self) -> int | None:
        return None if self.activation is None else self.counted.total + self.activation


def _option(technique: MemoryTechnique, label: str, cfg: Config, phase: str, gpus: int) -> Option:
    return next(o for o in technique.options(cfg, phase, gpus) if o.label == label)


def candidates(cfg: Config, phase: str, gpus: int = 1) -> list[Candidate]:
    """Every setup the registered techniques offer for `phase` on `gpus` GPUs, in a fixed order."""
    if phase == "train":
        return _train_candidates(cfg, gpus)
    if phase != "sample":
        raise ValueError(f"phase must be 'train' or 'sample', got {phase!r}")
    return _sample_candidates(cfg, gpus)


def _train_candidates(cfg: Config, gpus: int) -> list[Candidate]:
    phase = "train"
    # weight storage: (label, fp8 storage option, streaming option); streaming needs the fp8 codes
    stream = FP8_STREAMING.options(cfg, phase, gpus)
    fp8 = FP8_WEIGHTS.options(cfg, phase, gpus)
    storages = [(o.label, o, stream[0]) for o in fp8]
    storages += [("fp8 " + s.label, o, s) for o in fp8 if o.label == "fp8" for s in stream[1:]]
    out = []
    # the block model counts nested spans of offloaded inputs for backbones without measured curves (their host
    # pool may hold the span inputs where it cannot hold every block's); CogVideoX's measured regimes have none
    nest_offloaded = backbone_of(cfg.model.preset).name not in MEASURED_BACKBONES
    for ck, offload, nested, ffn, window, (stored, weights, streamed), optim, sp in itertools.product(
            CHECKPOINTING.options(cfg, phase, gpus), ACTIVATION_OFFLOAD.options(cfg, phase, gpus),
            NESTED_CHECKPOINTING.options(cfg, phase, gpus), FFN_CHUNKS.options(cfg, phase, gpus),
            WINDOW_FORM.options(cfg, phase, gpus), storages, ADAMW_8BIT.options(cfg, phase, gpus),
            SEQUENCE_PARALLEL.options(cfg, phase, gpus)):
        options = (ck, offload, nested, ffn, window, weights, optim, streamed) + ((sp,) if gpus > 1 else ())
        c = Candidate("", options).apply(cfg)
        if c.checkpointing.offload_activations and c.checkpointing.keep:
            continue  # kept outputs stay on the GPU: offloading the rest is a regime nobody measured
        if c.checkpointing.nested_span > 1 and (c.checkpointing.keep or (c.checkpointing.offload_activations
                                                                         and not nest_offloaded)):
            continue  # nesting spans of selective blocks, or nesting what is offloaded anyway: nothing to gain
        if c.checkpointing.ffn_chunk_tokens:
            g = Geometry.of(c, gpus)
            if not fits_block_model(c, gpus) or g.whole_block or g.ffn_rows == g.tokens:
                # only the block model counts the chunks (no chunked curve is measured), and not beside whole blocks
                # (their measured parts' activations hold the MLP's whole); one chunk: no change
                continue
        if window.label and (c.checkpointing.keep or not fits_block_model(c, gpus)):
            continue  # the window-wise form is counted by the block model only (its constants are measured there)
        extra = ", ".join(o.label for o in (offload, nested, ffn, window) if o.label)
        label = f"ckpt {ck.label}{', ' + extra if extra else ''}, {stored} weights, {optim.label}"
        if gpus > 1:
            label += f", sp {c.parallel.sp} x fsdp {gpus // c.parallel.sp}"
        out.append(Candidate(label, options))
    return out


def _sample_candidates(cfg: Config, gpus: int) -> list[Candidate]:
    phase = "sample"
    forwards = []  # (label, options): the plain forward with the guidance batched or in two passes, or chunked
    for chunked in CHUNKED_INFERENCE.options(cfg, phase, gpus):
        if chunked.label == "plain":
            forwards += [(f"plain, {g.label}", (chunked, g)) for g in GUIDANCE_PASSES.options(cfg, phase, gpus)
                         if g.label in ("guidance batched", "two passes")]
        else:
            forwards.append((chunked.label, (chunked,)))
    out = []
    for (fw, fw_options), blocks, weights in itertools.product(
            forwards, SAMPLE_BLOCK_OFFLOAD.options(cfg, phase, gpus), FP8_WEIGHTS.options(cfg, phase, gpus)):
        options = (*fw_options, blocks, weights)
        label = f"{fw}, {blocks.label} blocks, {weights.label} weights"
        if gpus == 1:
            out.append(Candidate(label, options))
            continue
        degrees = {o.label: o for o in SEQUENCE_PARALLEL.options(cfg, phase, gpus)}
        if f"sp {gpus}" in degrees:  # sp over all GPUs
            out.append(Candidate(f"{label}, sp {gpus}", (*options, degrees[f"sp {gpus}"],
                                                         _option(GUIDANCE_PASSES, "not split", cfg, phase, gpus))))
        # or the guidance's two passes split over two halves of the GPUs, each half an sp group; each rank runs one
        # pass, costed by the measured batched regime (the per-pass one is not measured)
        sp = gpus // 2
        if fw == "plain, guidance batched" and gpus % 2 == 0 and f"sp {sp}" in degrees:
            out.append(Candidate(label.replace("guidance batched", f"guidance split over 2 x sp {sp}"),
                                 (*options, degrees[f"sp {sp}"],
                                  _option(GUIDANCE_PASSES, "guidance split", cfg, phase, gpus))))
    return out


def predict(cfg: Config, phase: str, candidate: Candidate, costs: CostTable, gpus: int = 1,
            gpu_mem: int | None = None, margin: float = MARGIN, first_step_only: bool = False,
            trace: bool = False, host_mem: int | None = None, processes_per_host: int | None = None) -> Prediction:
    """The prediction of one candidate: for training, of a process that runs several steps (the later steps'
    allocated peak, the optimizer state live in backward, and the largest reserve of any step, the first one's
    included: what must fit the card); `first_step_only`: of a process's first step alone (what a one-step
    benchmark measures); `trace`: for a backbone whose blocks were not measured, the block model's working sets
    from a fake-tensor trace of the candidate's block unit (`memory.plan.traced`) instead of the counted ones.
    `host_mem`: the host memory available to the launch's `processes_per_host` processes (default: all `gpus` on
    one host); the offload pool is then the one the trainer makes there (`activation_offload.pool_share`) and a setup
    whose processes do not fit it does not fit. None: host memory is not checked."""
    c = candidate.apply(cfg)
    if phase == "sample":  # as the sampler builds it on the GPU planned for (sample.dtype)
        c.model.dtype = sampling_dtype(c.model.dtype, c.sample.dtype, cuda=True)
    layout = layout_of(c)
    batch = c.train.batch_size if phase == "train" else 1
    sp = c.parallel.sp if gpus > 1 else 1
    tokens = layout.total_tokens * batch // sp
    counted = count(c, phase, gpus)
    notes = []
    local = processes_per_host or gpus
    host_process, compile_host = process_host_bytes(c), compile_pool_bytes(c, phase)
    breakdown, reserved, host, time_factor = None, None, 0, 1.0
    # each half of the ranks runs one of the two guided passes
    split = 2 if phase == "sample" and gpus > 1 and c.sample.split_guidance else 1
    blocks = BlockConstants.for_backbone(costs.blocks, backbone_of(c.model.preset).name) if costs.blocks else None
    if phase == "train" and blocks is not None and fits_block_model(c, gpus, blocks):
        geometry = Geometry.of(c, gpus)
        traced = None
        if trace and not geometry.measured:
            from tttvideo.memory.plan.traced import traced_working_sets

            traced = traced_working_sets(c)
        counted_as = c
        if host_mem is not None and ACTIVATION_OFFLOAD.is_on(c) and c.checkpointing.offload_host_gib <= 0:
            # the trainer's pool on this host (activation_offload.host_pool_for): what does not fit stays on the GPU
            from tttvideo.models.activation_offload import pool_share

            counted_as = copy.deepcopy(c)
            pool = pool_share(host_mem, host_process + compile_host, local)
            counted_as.checkpointing.offload_host_gib = max(pool, 1) / GIB
            notes.append(f"host pool {pool / GIB:.1f} GiB a process (90 % of the {host_mem / GIB:.0f} GiB available "
                         f"once {local} process(es) hold {(host_process + compile_host) / GIB:.1f} GiB each)")
        breakdown = train_peak(counted_as, counted, blocks, gpus, first_step_only, traced)
        activation = breakdown.allocated - counted.total
        reserved, host = breakdown.reserved, breakdown.host
        if streams_weights(c):
            extra = int(breakdown.allocated * (FRAGMENTATION_STREAMED - FRAGMENTATION))
            share = FRAGMENTATION_STREAMED - FRAGMENTATION
            breakdown.parts.append(Part(f"allocator: weights streamed from host memory (+{share:.0%} of the peak)",
                                        extra, "measured"))
            reserved = breakdown.reserved = reserved + extra
        notes.extend(breakdown.notes)
        if gpus > 1:
            notes.append("host memory per process; " + (
                f"the parts counted at tokens / {sp}, the reserve measured with sp (one 63-s run)" if sp > 1
                else "the reserve measured with FSDP (the two-GPU stage chain, 3-63 s)"
                if blocks.fsdp_reserved_fraction and fsdp_shard_degree(c, gpus) > 1
                else "the reserve is one GPU's (FSDP's not measured)"))
            if sp == 1 and fsdp_shard_degree(c, gpus) > 2 and phase == "train":
                # held out: one reserve fraction, fitted on two GPUs, does not follow FSDP's as shards shrink (with
                # offload one GPU reserves 1.12x, two GPUs 1.28x, four GPUs 1.51x at 30 s; at 63 s four GPUs 1.21x,
                # under the prediction). Not run under the plan's cap on four GPUs, so whether that reserve is needed
                # or cached is not known
                notes.append("FSDP over more than two GPUs with block inputs offloaded: the four-GPU 30-s config "
                             "reserved 9.1 GiB (29 %) above the planner's prediction, the 63-s one 1 % under it "
                             "(docs/parallel.md); leave that room" if ACTIVATION_OFFLOAD.is_on(c) else
                             "FSDP over more than two GPUs: the four-GPU configs reserved 2.6 GiB (16 %) above the "
                             "planner's prediction at 3 s, 3 % above at 18 s and 7 % under at 9 s (docs/parallel.md); "
                             "leave that room")
        basis = ("counted (block model, traced)" if traced else "counted (block model, extrapolated)"
                 if blocks.extrapolated else "counted (block model)")
        if geometry.measured and c.model.adapter not in MEASURED_ADAPTERS:
            notes.append(f"block model measured with qkvo; {c.model.adapter}'s activations counted the same")
        if c.model.adapter == "sft" and blocks.time_points:
            notes.append(f"sft step x{geometry.full_finetune_time():.3f} qkvo's: the weight gradients qkvo skips "
                         "(from the shapes)")
        # the block model's techniques scale the time of the step with the inputs kept; the FFN chunks by an
        # estimate from the shapes (one more forward of the MLP)
        time_factor = blocks.step_factor(c, geometry)
        if geometry.ffn_rows < geometry.tokens:
            notes.append(f"FFN chunks: x{geometry.ffn_chunk_time():.3f} step time estimated from the shapes, "
                         "not measured")
        if geometry.whole_block:
            notes.append(f"whole blocks: x{blocks.block_time:.3f} the sub-block step's time, their parts' activations "
                         f"{blocks.block_stream_copies:.1f} stream copies (measured on one H200 at 30 s)")
        if geometry.window_form and blocks.window_stream_copies:
            notes.append(f"window-wise form: x{blocks.window_time:.2f} step time (measured at 63 s)")
        # the step time of the backbone's own measured steps; a backbone without them has none (its setups are
        # ranked by time_factor, the relative cost of their recomputes)
        time_cost = Curve(blocks.time_points) if blocks.time_points else None
    else:
        act_cost = costs.activation.get(activation_key(c, phase))
        share, per = curve_share(phase, sp, split, notes)
        curve_tokens = layout.total_tokens * batch // per
        activation = None if act_cost is None else max(0, int(act_cost(curve_tokens) * share))
        basis = "not measured" if act_cost is None else _curve_basis(act_cost, curve_tokens)
        floor = costs.floor(c, phase) if sp == 1 and split == 1 else None
        if activation is not None and floor is not None and floor > activation:
            activation, basis = floor, "counted floor (stream copies + measured fixed part)"
            notes.append(f"chunked: the peak outside the TTT scan ({FLOOR_STREAMS} streams and a window's or chunk's "
                         "work) is above the curve here")
        if act_cost is None:
            notes.append("activation regime not measured")
        else:
            # the regime's measured reserve at these tokens where its calibration recorded one, never below the
            # default share of the peak
            allocated = counted.total + activation
            default = FRAGMENTATION_STREAMED if streams_weights(c) else FRAGMENTATION
            gap = costs.reserve.get(activation_key(c, phase))
            reserved = allocated + max(int(allocated * default), 0 if gap is None else int(gap(curve_tokens) * share))
        time_cost = costs.time.get(time_key(c, phase))
    step_s = None
    sp_efficiency = SAMPLE_SP_EFFICIENCY if phase == "sample" else costs.sp_efficiency
    if time_cost is not None:
        one = time_cost(layout.total_tokens * batch) / (SPLIT_GUIDANCE_SPEEDUP if split > 1 else 1) * time_factor
        if sp == 1:
            step_s = one
        elif sp in sp_efficiency:
            step_s = one / (sp * sp_efficiency[sp])
        else:
            notes.append(f"sp {sp} efficiency not measured")
    else:
        notes.append("time not measured")
    if step_s is not None and phase == "train" and costs.optimizer:
        # the curves hold a micro-batch's step without its optimizer step (`optimizer_time`): this setup's, once
        # per optimizer step
        optimizer_s = optimizer_step_s(costs.optimizer, c, gpus)
        accum = micro_batches(c, gpus)
        if optimizer_s is None:
            notes.append(f"{c.train.optimizer} step time not measured")
        else:
            step_s += optimizer_s / accum
            notes.append(f"{c.train.optimizer} step {optimizer_s:.2f} s" + (
                f" once per {accum} micro-batches: +{optimizer_s / accum:.3f} s each" if accum > 1 else ""))
    fits = gpu_fits = None
    if reserved is not None and gpu_mem is not None:
        fits = gpu_fits = card_holds(reserved, gpu_mem, margin)
    host_fits = None
    if host_mem is not None:
        needed = (host + host_process + compile_host) * local
        host_fits = needed <= host_mem
        if not host_fits:
            notes.append(f"host: {local} process(es) need {needed / GIB:.1f} GiB, {host_mem / GIB:.1f} GiB available")
            fits = False if fits is not None else None
    videos = max(1, gpus // sp) if phase == "train" else 1
    if phase == "train" and gpus > 1 and step_s is not None:  # what the ranking compares (`rank`)
        notes.append(f"{videos} video(s) a step: {step_s / videos:.2f} s per video")
    if breakdown is not None:
        breakdown.parts.append(Part("host: the process (libraries; the weights folder it reads)", host_process,
                                    "counted + measured", "host"))
        if compile_host:
            breakdown.parts.append(Part(f"host: Inductor's {compile_workers()} compile workers (this machine's cores)",
                                        compile_host, "measured", "host"))
    return Prediction(candidate, c, tokens, counted, activation, step_s, fits, notes, reserved, host, breakdown, basis,
                      time_factor, videos, host_process + compile_host, host_fits, gpu_fits)


def curve_share(phase: str, sp: int, split: int, notes: list[str]) -> tuple[float, int]:
    """(share of a measured curve's activations, the sp degree its tokens are divided by) for a setup on the
    measured-curve path. Sampling under sp or with a split guidance is counted from the one-GPU batch-2 forward over
    the whole sequence by the shares measured at 63 s; anything else (or an sp degree not measured) at the tokens a
    GPU holds, by the one-GPU per-token costs."""
    share = 1.0
    if phase == "sample" and split > 1:
        share = SPLIT_GUIDANCE_ACTIVATION
        notes.append(f"one guided pass a rank: x{SPLIT_GUIDANCE_ACTIVATION:.2f} the batch-2 forward's activations "
                     "(measured at 63 s)")
    if sp == 1:
        return share, 1
    if phase == "sample" and sp in SAMPLE_SP_ACTIVATION:
        notes.append(f"sp {sp}: x{SAMPLE_SP_ACTIVATION[sp]:.2f} one GPU's activations (measured at 63 s)")
        return share * SAMPLE_SP_ACTIVATION[sp], 1
    notes.append("sp: one-GPU per-token costs")
    return share, sp


def _curve_basis(curve: Curve, tokens: int) -> str:
    lo, hi = curve.points[0][0], curve.points[-1][0]
    if len(curve.points) > 1 and lo <= tokens <= hi:
        return "interpolated (measured curve)"
    return "extrapolated (measured curve)" if tokens != lo else "measured"


def streams_weights(cfg: Config) -> bool:
    """Whether a setup copies weights in from host memory layer by layer (training or sampling)."""
    return any(t.streams_weights and t.is_on(cfg) for t in REGISTRY)


def card_holds(reserved: float, gpu_mem: int, margin: float = 0.0) -> bool:
    """Whether a `reserved` peak and the CUDA context fit a card of `gpu_mem` bytes less `margin` of it."""
    return reserved + CUDA_CONTEXT <= gpu_mem * (1 - margin)


def fits_in(peak: int, gpu_mem: int, streamed: bool = False, margin: float = 0.0) -> bool:
    """Whether an allocated `peak` fits a card of `gpu_mem` bytes: its reserved memory (FRAGMENTATION above it) and
    the CUDA context within the card less `margin` of it."""
    fragmentation = FRAGMENTATION_STREAMED if streamed else FRAGMENTATION
    return card_holds(peak * (1 + fragmentation), gpu_mem, margin)


def plan(cfg: Config, phase: str, gpu_mem: int, costs: CostTable, gpus: int = 1,
         margin: float = MARGIN, trace: bool = False, host_mem: int | None = None,
         processes_per_host: int | None = None) -> list[Prediction]:
    """Every candidate's prediction, best first (`rank`). `trace`, `host_mem`, `processes_per_host`: see `predict`."""
    preds = [predict(cfg, phase, c, costs, gpus, gpu_mem, margin, trace=trace, host_mem=host_mem,
                     processes_per_host=processes_per_host) for c in candidates(cfg, phase, gpus)]
    return sorted(preds, key=rank)


def rank(p: Prediction) -> tuple:
    """The order of `plan`: those that fit by time per video (unknown time last; of equal times the one with fewer
    `overheads`), then those that do not by peak, then the unmeasured."""
    if p.fits:
        per_video = p.seconds_per_video
        return (0, per_video if per_video is not None else float("inf"), p.relative_time, overheads(p.config),
                p.peak)
    if p.fits is False:
        return (1, p.peak, 0, 0, 0)
    return (2, 0, 0, 0, 0)


def overheads(cfg: Config) -> tuple[int, int, int]:
    """What the time fit leaves out, to order setups it predicts as fast: first how many switches round numbers
    (fp8 weights, 8-bit optimizer state), then how many copy weights from host memory each step, then how many hold
    state in host memory; fewer is better."""
    on = [t for t in REGISTRY if t.is_on(cfg)]
    return sum(t.lossy for t in on), sum(t.streams_weights for t in on), sum(t.uses_host for t in on)


def best(preds: list[Prediction]) -> Prediction | None:
    return next((p for p in preds if p.fits), None)


# ------------------------------------------------------------------------------------------------ output
def parse_size(text: str, flag: str = "--gpu-mem") -> int:
    """'24GiB', '24 GiB', '80GB', '24' (GiB) -> bytes; `flag` names the option in the error."""
    t = text.strip().replace(" ", "")
    units = {"gib": GIB, "gb": 10**9, "mib": 2**20, "mb": 10**6, "tib": 2**40}
    for unit, size in sorted(units.items(), key=lambda u: -len(u[0])):
        if t.lower().endswith(unit):
            number = t[: -len(unit)]
            break
    else:
        number, size = t, GIB
    try:
        value = float(number)
    except ValueError:
        raise UserError(f"{flag} {text!r} is not a size; write it like 24GiB, 80GB or 24 (GiB)") from None
    if value <= 0:
        raise UserError(f"{flag} {text!r} must be positive")
    return int(value * size)


def _literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return json.dumps(value)
    raise TypeError(f"cannot write {value!r} as a plan value")


# the first line of every plan file: `tttv plan --out` replaces only a file that starts with it
PLAN_HEADER = "# written by: "


def plan_toml(pred: Prediction, config_path: str | Path | None, out_path: str | Path, command: str,
              extra: dict[str, Any] | None = None) -> str:
    """A config file that includes the user's config and sets the chosen switches."""
    lines = [f"{PLAN_HEADER}{command}",
             f"# predicted peak {pred.peak / GIB:.1f} GiB per GPU"
             + (f", {pred.step_s:.2f} s per step" if pred.step_s is not None else "")
             + f" ({pred.candidate.label})"]
    if config_path:
        rel = os.path.relpath(Path(config_path).resolve(), Path(out_path).resolve().parent)
        lines.append(f"include = {json.dumps(rel)}")
    sections: dict[str, dict[str, Any]] = {}
    for key, value in {**(extra or {}), **pred.candidate.settings(pred.config)}.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    for section, values in sections.items():
        lines.append(f"\n[{section}]")
        lines.extend(f"{name} = {_literal(v)}" for name, v in values.items())
    return "\n".join(lines) + "\n"
