"""A training step's GPU memory as a sum of counted parts, phase by phase, for the setups whose every block and
every sub-module is checkpointed (the stage configs' policy) or, for CogVideoX, whose whole blocks are (their parts
unchecked), with their block inputs kept, nested or offloaded, and the MLP whole or over token chunks. The shapes
come from the backbone's preset and layout (`Geometry.of`), so it serves every backbone; its constants were measured
on CogVideoX-5B and, where its rows allow, on another backbone (Wan); a part that uses a constant carried over from
CogVideoX-5B says it is extrapolated (`BlockConstants.how`).

What grows with the video is countable: every checkpointed block unit saves its input for backward (batch x
tokens/sp x dim in the stream's dtype, plus a few bytes a token of other saved tensors: measured 296 B/token from
the offloaded bytes at 9, 18 and 63 s), and the block that runs needs a working set. The working set is named part
by part, each a function of the tokens one GPU holds, the heads, the head dim, the TTT mini-batch and scan group and
sp (`working_set`):
- the MLP's hidden activations: tokens (or one chunk's, `checkpointing.ffn_chunk_tokens`) x the hidden width in the
  stream's dtype;
- fp32 upcasts of the stream (the norms and the gated residual add): tokens x dim x 4 bytes;
- the TTT scan's checkpoints: the fast weights (two fp32 matrices of head_dim x 4 head_dim per head for TTT-MLP,
  one head_dim x head_dim for TTT-Linear) once per scan group of mini-batches, for the forward and the reverse pass;
- with the text cross-attended (Wan), the keys and values of every segment's text;
- attention and the remaining stream-sized temporaries (q, k, v, the attention output, the gradients flowing back,
  the adaLN-modulated inputs): a measured number of stream-sized tensors (`stream_copies`, fitted at 9 s);
- in Wan's window-wise form (attention one window at a time, the TTT passes over token chunks and their scans over
  groups of heads), which makes neither attention's tensors nor the fp32 upcasts whole: that form's own measured
  number of stream-sized tensors (`window_stream_copies`) and one head group's scan checkpoints, its step
  `window_time` times the plain form's;
- with whole-block checkpointing (the block's parts not checkpointed on their own), the parts' activations, kept
  through the block's backward instead of recomputed a second time: a measured number of stream-sized tensors
  (`block_stream_copies`), its step `block_time` times the sub-block step's.

Where the peak falls depends on the policy, so each phase is counted and the largest wins (`train_peak`):
the end of forward (every saved input, no gradients yet), each unit's backward recompute (the inputs still saved,
the gradients of the blocks already done, the working set), and the optimizer step (weights, all gradients,
the optimizer state). With nested checkpointing (spans of k units) forward keeps one input per span and a span's
backward its k units' inputs: about n / k + k instead of n. With activation offload the inputs go to a host pool of
exact-size buffers (as many as `checkpointing.offload_host_gib` holds; the rest stay on the GPU) and two are on the
GPU at a time in backward (the one in use and the one prefetched).

The allocator reserves more than it allocates: `reserved_fraction` of the peak, plus, with offload, a few
stream-sized blocks that the side stream's copies keep from reuse. That offload reserve is larger in a process's
first step (compilation and autotuning run beside the first copies: `first_step_offload_reserved_units`, measured
2.5 inputs at 18 s) than in the steps after it (`offload_reserved_units`), while from the second step on the
optimizer state is live in backward and raises the allocated peak. The allocator keeps what it reserved, and the
later steps' growth lands on top of the first step's pool, so a one-GPU training process peaks at its first step's
reserve plus that growth, or at its later steps' own reserve if larger (`train_peak`); a one-step benchmark at its
first step alone.
The constants are measured per GPU kind and per backbone (costs.json's "blocks" table, keyed by backbone, written
from benchmarks/results by benchmarks/plan_accuracy.py's `--fit`): a backbone with measurements of its own gets
those constants, and CogVideoX-5B's (`REFERENCE_BACKBONE`) for the rest, each part saying which
(`BlockConstants.how`). The structure carries the growth, so the 9-s calibration predicts 18 and 63 s
(docs/memory.md, "Planner accuracy").
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from tttvideo.config.schema import Config
from tttvideo.memory.plan.count import Counted, fsdp_shard_degree
from tttvideo.memory.techniques import SUB_BLOCK_POLICY, WHOLE_BLOCK_POLICY, checkpoint_policy, window_form

GIB = 2**30

# the setup the block model is measured for: every block and each of its four parts checkpointed, one block a unit
BLOCK_MODEL_POLICY = SUB_BLOCK_POLICY
# whole blocks checkpointed, their parts not (WHOLE_BLOCK_POLICY): counted as the sub-block model plus the parts'
# measured activations (`BlockConstants.block_stream_copies`), on the measured backbones only
MEASURED_ADAPTERS = ("qkvo",)
# adapters whose activations are the measured ones': full fine-tuning saves the same block inputs and runs the same
# working sets (its extra gradients and optimizer state are counted parts); LoRA adds low-rank activations
BLOCK_MODEL_ADAPTERS = MEASURED_ADAPTERS + ("sft",)
MEASURED_PRESETS = ("cogvideox-5b",)
MEASURED_BACKBONES = ("cogvideox",)


# the backbone whose constants every other backbone starts from, and how the parts name where a constant was measured
REFERENCE_BACKBONE = "cogvideox"
MEASURED_ON = {"cogvideox": "CogVideoX-5B", "wan": "Wan2.1-1.3B"}
# the constants a backbone's own table may replace; step time is never carried over (another backbone's blocks
# cost other FLOPs), so a backbone without time_points of its own has no predicted step time
CARRIED = ("stream_copies", "saved_extra_per_token", "reserved_fraction", "offload_reserved_units",
           "first_step_offload_reserved_units", "nested_time", "offload_time", "sp_reserved_fraction",
           "fsdp_reserved_fraction")
# what the plan's notes call them
CONSTANT_NAMES = {"stream_copies": "stream copies", "saved_extra_per_token": "bytes saved beside each input",
                  "reserved_fraction": "reserve", "offload_reserved_units": "offload reserve",
                  "first_step_offload_reserved_units": "offload reserve", "nested_time": "time factors",
                  "offload_time": "time factors", "sp_reserved_fraction": "sp reserve",
                  "fsdp_reserved_fraction": "FSDP reserve"}


@dataclass(frozen=True)
class BlockConstants:
    """The measured constants of the block model for one GPU kind and backbone (costs.json, "blocks")."""

    stream_copies: float  # stream-sized tensors live in a block's backward recompute beyond the counted parts
    saved_extra_per_token: float  # bytes a token a checkpointed unit saves beyond its input
    reserved_fraction: float  # the allocator's reserved above allocated, as a fraction of the peak
    offload_reserved_units: float  # with offload, from a process's second step on: extra reserved, in saved inputs
    # step time against the same step with the inputs kept (one process, 9 s): nested recomputes each span once
    # more; offload's copies hide behind compute
    nested_time: float = 1.0
    offload_time: float = 1.0
    # measured (tokens, seconds) of the step with the inputs kept: the step time's curve (`costs.Curve`)
    time_points: tuple[tuple[float, float], ...] = ()
    source: str = ""
    # with offload, in a process's first step (compiling beside the first copies): extra reserved, in saved inputs
    first_step_offload_reserved_units: float = 0.0
    backbone: str = REFERENCE_BACKBONE  # the backbone these constants serve
    carried: frozenset[str] = frozenset()  # names of the constants carried over from REFERENCE_BACKBONE
    # with sequence parallelism (sp > 1): the reserved above allocated, as a fraction of the peak, in place of
    # reserved_fraction (the all-to-all buffers of every exchange come and go in sizes the one-GPU step has not);
    # 0: not measured, reserved_fraction
    sp_reserved_fraction: float = 0.0
    # with FSDP over several GPUs and no sp: the same, in place of reserved_fraction (each block's parameters
    # gathered and its gradients reduce-scattered in buffers the one-GPU step has not); 0: not measured
    fsdp_reserved_fraction: float = 0.0
    # in a backbone's window-wise training form (`Geometry.window_form`): the stream-sized tensors live in a block's
    # backward recompute, in place of stream_copies and the counted fp32 upcasts (that form makes neither whole);
    # 0: not measured, the plain form's parts (an over-count)
    window_stream_copies: float = 0.0
    # that form's step time against the same step without it (its per-window checkpoints, the TTT layer's chunks
    # and head groups recompute and serialise what the plain form runs at once)
    window_time: float = 1.0
    # whole-block checkpointing (the parts unchecked): the stream-sized tensors the block's parts keep through its
    # backward beyond the sub-block working set, and the step time against the sub-block step's; 0: not measured
    block_stream_copies: float = 0.0
    block_time: float = 1.0

    @classmethod
    def from_dict(cls, d: dict) -> "BlockConstants":
        """One backbone's table; a table without the first step's offload reserve has the later steps' one."""
        return cls(float(d["stream_copies"]), float(d["saved_extra_per_token"]), float(d["reserved_fraction"]),
                   float(d["offload_reserved_units"]), float(d.get("nested_time", 1.0)),
                   float(d.get("offload_time", 1.0)),
                   tuple((float(t), float(v)) for t, v in d.get("time_points", ())), str(d.get("source", "")),
                   float(d.get("first_step_offload_reserved_units", d["offload_reserved_units"])),
                   sp_reserved_fraction=float(d.get("sp_reserved_fraction", 0.0)),
                   fsdp_reserved_fraction=float(d.get("fsdp_reserved_fraction", 0.0)),
                   window_stream_copies=float(d.get("window_stream_copies", 0.0)),
                   window_time=float(d.get("window_time", 1.0)),
                   block_stream_copies=float(d.get("block_stream_copies", 0.0)),
                   block_time=float(d.get("block_time", 1.0)))

    @classmethod
    def for_backbone(cls, table: dict, backbone: str) -> "BlockConstants":
        """The constants of `backbone` from a GPU kind's "blocks" table keyed by backbone: its own where it has
        them, REFERENCE_BACKBONE's for the rest (never its step time). A table of one backbone's constants (no
        backbone keys) is REFERENCE_BACKBONE's."""
        if "stream_copies" in table:
            table = {REFERENCE_BACKBONE: table}
        reference = table[REFERENCE_BACKBONE]
        if backbone == REFERENCE_BACKBONE:
            return dataclasses.replace(cls.from_dict(reference), backbone=backbone)
        own = table.get(backbone, {})
        merged = {**{k: v for k, v in reference.items() if k in CARRIED}, **own}
        carried = frozenset(k for k in CARRIED if k not in own)
        return dataclasses.replace(cls.from_dict(merged), backbone=backbone, carried=carried)

    def to_dict(self) -> dict:
        return {"stream_copies": self.stream_copies, "saved_extra_per_token": self.saved_extra_per_token,
                "reserved_fraction": self.reserved_fraction, "offload_reserved_units": self.offload_reserved_units,
                "first_step_offload_reserved_units": self.first_step_offload_reserved_units,
                "nested_time": self.nested_time, "offload_time": self.offload_time,
                "time_points": [list(p) for p in self.time_points], "source": self.source,
                "sp_reserved_fraction": self.sp_reserved_fraction,
                "fsdp_reserved_fraction": self.fsdp_reserved_fraction,
                **({"window_stream_copies": self.window_stream_copies, "window_time": self.window_time}
                   if self.window_stream_copies else {}),
                **({"block_stream_copies": self.block_stream_copies, "block_time": self.block_time}
                   if self.block_stream_copies else {})}

    def how(self, what: str, *constants: str) -> str:
        """A part's basis `what` ("measured", "counted x measured") from `constants`, naming the backbone they were
        measured on when it is not the reference's, and saying when one is carried over from the reference."""
        if any(c in self.carried for c in constants):
            return what.replace("measured", f"measured on {MEASURED_ON[REFERENCE_BACKBONE]}, extrapolated")
        if self.backbone == REFERENCE_BACKBONE:
            return what
        return what.replace("measured", f"measured on {MEASURED_ON.get(self.backbone, self.backbone)}")

    @property
    def extrapolated(self) -> bool:
        """Whether any constant is carried over from another backbone."""
        return bool(self.carried)

    def time_factor(self, cfg: Config) -> float:
        ck = cfg.checkpointing
        # the copies can only add work: a measured offload factor below 1 is one run's noise, and would rank
        # offloading a short video (nothing to gain) above keeping its inputs
        inputs = self.nested_time if ck.nested_span > 1 else max(1.0, self.offload_time) if ck.offload_activations \
            else 1.0
        whole = self.block_time if _whole_block(cfg) else 1.0
        return inputs * whole * (self.window_time if window_form(cfg) else 1.0)

    def step_factor(self, cfg: Config, g: Geometry) -> float:
        """A step's time against the measured step (qkvo, inputs kept): `time_factor`, and the estimates from the
        shapes for the FFN chunks where the MLP runs over chunks (`Geometry.ffn_chunk_time`) and for full
        fine-tuning (`Geometry.full_finetune_time`)."""
        return (self.time_factor(cfg) * (g.ffn_chunk_time() if g.ffn_rows < g.tokens else 1.0)
                * (g.full_finetune_time() if cfg.model.adapter == "sft" else 1.0))


@dataclass(frozen=True)
class Part:
    """One counted part: its name, bytes, where it lives and how it is known."""

    name: str
    nbytes: int
    how: str  # "counted" (shapes and dtypes), "measured" (a constant from a run), "counted x measured"
    where: str = "gpu"  # or "host"


@dataclass
class Breakdown:
    """A setup's memory: the parts at the peak phase, the peak (allocated), the reserved estimate and host bytes."""

    phase: str  # where the peak falls
    parts: list[Part]
    allocated: int
    reserved: int  # what the allocator holds at the process's peak: the largest of its steps' reserves
    host: int
    notes: list[str] = field(default_factory=list)
    first_step_reserved: int = 0  # a process's first step's reserve (compilation, first offload copies)

    @property
    def activation(self) -> int:
        """What the step allocates beyond weights, gradients and optimizer state at the peak."""
        return self.allocated - sum(p.nbytes for p in self.parts if p.name.startswith(
            ("weights", "gradients", "optimizer")))


@dataclass(frozen=True)
class Geometry:
    """What the counts need of the model and the video, per GPU: read from the backbone's preset (`BackboneSpec`)
    and layout, so one block model serves every backbone."""

    units: int  # checkpointed block units (blocks: group_size 1)
    dim: int
    heads: int  # the TTT layer's heads (CogVideoX: attention's; Wan: width / ttt_head_dim)
    head_dim: int  # the TTT layer's head dim
    act_bytes: int  # bytes of one stream element (bf16 under autocast or bf16 weights, else the weights' dtype)
    tokens: int  # tokens one GPU holds (batch x total / sp)
    mini_batch: int
    scan_group: int
    ttt_state_values: int  # fast-weight values per head (0: no TTT layer)
    hidden: int = 0  # the MLP's hidden width (4 dim for CogVideoX, ffn_dim for Wan)
    ffn_rows: int = 0  # rows of the MLP's hidden layer at once: the tokens, or batch x one chunk
    cross_text_tokens: int = 0  # text tokens a block cross-attends to (all segments; 0: text in the stream)
    backbone: str = "cogvideox"
    window_tokens: int = 0  # tokens of one attention window
    # the window-wise training form (Wan: checkpointing.attention_by_window with the TTT passes over token chunks,
    # ttt_chunk_tokens): attention one window at a time, the TTT passes' gates and residual adds folded into their
    # chunks, so the block's stream-sized temporaries are fewer (`BlockConstants.window_stream_copies`)
    window_form: bool = False
    # TTT heads whose scan runs at once in backward: all, or one group's (checkpointing.ttt_head_groups, each
    # group checkpointed on its own; with ttt_chunk_tokens only)
    scan_heads: int = 0
    # whole-block checkpointing: the parts' activations live through the block's backward (`whole_block_parts`)
    whole_block: bool = False

    @classmethod
    def of(cls, cfg: Config, gpus: int = 1) -> "Geometry":
        from tttvideo.models.backbone import backbone_of, layout_of

        backbone = backbone_of(cfg.model.preset)
        spec = backbone.presets[cfg.model.preset]
        layout = layout_of(cfg)
        sp = cfg.parallel.sp if gpus > 1 else 1
        heads = getattr(spec, "ttt_heads", spec.num_attention_heads)
        hd = getattr(spec, "ttt_head_dim", spec.attention_head_dim)
        dim = spec.num_attention_heads * spec.attention_head_dim
        state = 0
        if cfg.model.use_ttt and cfg.model.sequence_layer == "ttt":
            state = 2 * hd * 4 * hd + 5 * hd if cfg.ttt.kind == "mlp" else hd * hd + hd
        autocast = cfg.train.precision in ("bf16", "fp16")
        act = 2 if autocast or cfg.model.dtype in ("bf16", "fp16") else 4
        batch = cfg.train.batch_size
        per_gpu = layout.total_tokens // sp
        chunk = cfg.checkpointing.ffn_chunk_tokens
        rows = batch * (min(per_gpu, chunk) if chunk > 0 else per_gpu)
        text = 0 if layout.text_in_stream else layout.num_segments * layout.text_tokens
        ck = cfg.checkpointing
        groups = ck.ttt_head_groups if ck.ttt_chunk_tokens > 0 else 1
        return cls(spec.num_layers, dim, heads, hd, act, per_gpu * batch, cfg.ttt.mini_batch_size,
                   max(1, cfg.ttt.scan_checkpoint_group_size), state, getattr(spec, "ffn_dim", 4 * dim), rows,
                   batch * text, backbone.name, layout.window_tokens, window_form(cfg), math.ceil(heads / groups),
                   _whole_block(cfg))

    @property
    def stream(self) -> int:
        """Bytes of one stream-sized tensor (tokens x dim)."""
        return self.tokens * self.dim * self.act_bytes

    @property
    def measured(self) -> bool:
        """Whether this backbone has measured per-token curves (CogVideoX): the block model then serves only the
        setup its constants were fitted on (`fits_block_model`)."""
        return self.backbone in MEASURED_BACKBONES

    def _matrix_work(self) -> tuple[float, float, float]:
        """Per token, a block's forward matrix work (FLOPs): (the MLP's, the linear layers qkvo leaves frozen: the
        MLP and Wan's cross-attention q/o, the whole block's). Estimated from the shapes; the scan's few FLOPs
        are left out."""
        d = self.dim
        mlp = 4 * d * self.hidden
        cross_proj = 4 * d * d if self.cross_text_tokens else 0
        block = (mlp + 8 * d * d  # attention q/k/v/o
                 + 4 * self.window_tokens * d  # attention scores and values over a window
                 + 16 * d * d  # the TTT layer's projections, both passes
                 + (cross_proj + 4 * self.cross_text_tokens * d if self.cross_text_tokens else 0))
        return mlp, mlp + cross_proj, block

    def _step_forwards(self) -> int:
        """A training step's work in forwards of the block: forward, the block's recompute, the parts' recompute
        under sub-block checkpointing (none with whole blocks), and backward at twice a forward."""
        return 4 if self.whole_block else 5

    def ffn_chunk_time(self) -> float:
        """Step time with the MLP over token chunks against without: one more forward of the MLP in a step of about
        five forwards' work under sub-block checkpointing (`_step_forwards`), weighted by the MLP's share of a
        block's matrix work per token (estimated from the shapes, not measured)."""
        mlp, _, block = self._matrix_work()
        return 1 + mlp / (self._step_forwards() * block)

    def full_finetune_time(self) -> float:
        """Step time of sft (every weight trains) against qkvo, the adapter the step times are measured with: the
        weight gradients of the linear layers qkvo leaves frozen, one more forward of their matrix work, in a step
        whose backward otherwise lacks it (estimated from the shapes, not measured; the optimizer's larger step is
        left out)."""
        _, frozen, block = self._matrix_work()
        step = self._step_forwards() * block
        return step / (step - frozen)


def saved_input(g: Geometry, k: BlockConstants) -> int:
    """Bytes a checkpointed unit saves for backward: its input and the other per-token tensors it saves."""
    return g.stream + int(g.tokens * k.saved_extra_per_token)


def working_set(g: Geometry, k: BlockConstants) -> list[Part]:
    """The largest working set inside one block's backward recompute, part by part."""
    checkpoints = math.ceil(g.tokens / (g.mini_batch * g.scan_group))
    chunked = g.ffn_rows < g.tokens
    rows = f"{g.ffn_rows} rows (one chunk)" if chunked else "tokens"
    scan_heads = g.scan_heads or g.heads
    groups = f" (one group of {g.heads // scan_heads})" if scan_heads < g.heads else ""
    parts = [
        Part(f"working set: MLP hidden ({rows} x {g.hidden} x {g.act_bytes} B)", g.ffn_rows * g.hidden * g.act_bytes,
             "counted"),
        Part(f"working set: TTT scan checkpoints ({checkpoints} x {scan_heads} heads{groups} x "
             f"{g.ttt_state_values} fp32, forward and reverse)", 2 * checkpoints * scan_heads * g.ttt_state_values * 4,
             "counted"),
    ]
    if g.window_form and k.window_stream_copies > 0:
        parts.append(Part(f"working set: stream-sized tensors of the window-wise form ({k.window_stream_copies:.1f} x "
                          "tokens x dim)", int(k.window_stream_copies * g.stream),
                          k.how("counted x measured", "window_stream_copies")))
    else:
        parts[1:1] = [Part("working set: fp32 upcasts of the stream (tokens x dim x 4 B)", g.tokens * g.dim * 4,
                           "counted")]
        parts.append(Part(f"working set: attention and other stream-sized temporaries ({k.stream_copies:.1f} x "
                          "tokens x dim)", int(k.stream_copies * g.stream), k.how("counted x measured",
                                                                                   "stream_copies")))
    if g.cross_text_tokens:
        parts.append(Part(f"working set: cross-attention keys and values of the text ({g.cross_text_tokens} tokens "
                          f"x dim, 2 x {g.act_bytes} B)", 2 * g.cross_text_tokens * g.dim * g.act_bytes, "counted"))
    return parts


def whole_block_parts(g: Geometry, k: BlockConstants) -> list[Part]:
    """With whole-block checkpointing: what the block's parts keep for its backward (their activations, recomputed
    once with the block instead of twice), beyond the sub-block working set."""
    if not g.whole_block:
        return []
    return [Part(f"working set: the parts' activations, kept through the block's backward (whole-block "
                 f"checkpointing: {k.block_stream_copies:.1f} x tokens x dim)", int(k.block_stream_copies * g.stream),
                 "counted x measured")]


def _whole_block(cfg: Config) -> bool:
    return checkpoint_policy(cfg) == WHOLE_BLOCK_POLICY


def nested_span_of(cfg: Config) -> int:
    return cfg.checkpointing.nested_span if cfg.checkpointing.nested_span > 1 else 1


def offloaded_units(cfg: Config, g: Geometry, k: BlockConstants) -> int:
    """How many saved inputs the host pool takes: all, or as many as checkpointing.offload_host_gib holds."""
    if not cfg.checkpointing.offload_activations:
        return 0
    cap = cfg.checkpointing.offload_host_gib
    saved = -(-g.units // nested_span_of(cfg))  # what forward saves: one input per unit, or per span of units
    if cap <= 0:
        return saved
    return min(saved, int(cap * GIB) // max(1, saved_input(g, k)))


def _step_peak(cfg: Config, counted: Counted, k: BlockConstants, g: Geometry, optimizer_state_live: bool,
               traced: tuple[list[Part], list[Part]] | None = None) -> tuple[str, list[Part]]:
    """The phase where one training step peaks and its parts; `optimizer_state_live=False`: a process's first step,
    whose optimizer state appears only at its optimizer step; `traced`: the (forward, backward) working sets of the
    block that runs from a trace of it (`memory.plan.traced`) instead of the counted `working_set`."""
    s = saved_input(g, k)
    ws_forward = ws = working_set(g, k)
    if traced is not None:
        ws_forward, ws = traced
    ws = ws + whole_block_parts(g, k)  # forward runs each block without saving; its backward keeps the parts'
    n = g.units
    grad_per_unit = counted.gradients // max(1, n)
    opt = counted.optimizer if optimizer_state_live else 0
    span = nested_span_of(cfg)
    off = offloaded_units(cfg, g, k)
    # forward saves units in order; the pool takes the first `off` of them
    spans = [(i, min(i + span, n)) for i in range(0, n, span)]

    def on_gpu_inputs(unit: int) -> tuple[int, str]:
        """Saved inputs on the GPU while `unit`'s backward runs: those forward saved (one a span) up to the running
        span's, and the running span's recomputed unit inputs, whose first is the span's own."""
        j = next(j for j, (a, b) in enumerate(spans) if a <= unit < b)
        within = unit - spans[j][0]  # unit inputs of the running span beyond its first
        units = f" + {within} of this span's unit inputs" if span > 1 else ""
        if off:
            kept = max(0, j + 1 - off)  # saved inputs up to this one the pool had no room for
            back = min(2, j + 1, off)
            return kept + back + within, f"{kept} kept on the GPU + {back} fetched back from the host{units}"
        return j + 1 + within, ("span inputs" + units if span > 1 else "inputs")

    phases: list[tuple[str, list[Part]]] = []
    base = [Part("weights (storage dtypes)", counted.weights, "counted")]
    if opt:
        base.append(Part("optimizer state", opt, "counted"))
    fwd_inputs = len(spans) - off
    phases.append(("end of forward", base + [Part(f"saved inputs: {fwd_inputs} x {s / GIB:.3f} GiB", fwd_inputs * s,
                                                  "counted")] + ws_forward))
    for unit in range(n - 1, -1, -1):
        live, what = on_gpu_inputs(unit)
        grads = counted.gradients if unit == 0 else (n - unit) * grad_per_unit
        phases.append((f"backward of block {unit}", base + [
            Part(f"gradients ({n - unit} of {n} blocks)", grads, "counted"),
            Part(f"saved inputs: {live} x {s / GIB:.3f} GiB ({what})", live * s, "counted")] + ws))
    phases.append(("optimizer step", [Part("weights (storage dtypes)", counted.weights, "counted"),
                                      Part("gradients", counted.gradients, "counted"),
                                      Part("optimizer state", counted.optimizer, "counted")]))
    return max(phases, key=lambda p: sum(x.nbytes for x in p[1]))


def train_peak(cfg: Config, counted: Counted, k: BlockConstants, gpus: int = 1,
               first_step_only: bool = False,
               traced: tuple[list[Part], list[Part]] | None = None) -> Breakdown:
    """The peak of a training process of `cfg` (block model policy) as counted parts: its later steps' allocated
    peak (the optimizer state live in backward) and the larger of the two reserves, the first step's (its offload
    reserve is larger) and the later steps' (their allocated peak is). `first_step_only`: a process that runs one
    step (what a one-step benchmark measures); `traced`: the block's working sets from a trace (`_step_peak`)."""
    g = Geometry.of(cfg, gpus)
    s = saved_input(g, k)
    off = offloaded_units(cfg, g, k)
    saved = -(-g.units // nested_span_of(cfg))
    sp = cfg.parallel.sp if gpus > 1 else 1
    sp_reserve = sp > 1 and k.sp_reserved_fraction > 0
    fsdp_reserve = sp == 1 and fsdp_shard_degree(cfg, gpus) > 1 and k.fsdp_reserved_fraction > 0
    fraction, fraction_key = ((k.sp_reserved_fraction, "sp_reserved_fraction") if sp_reserve
                              else (k.fsdp_reserved_fraction, "fsdp_reserved_fraction") if fsdp_reserve
                              else (k.reserved_fraction, "reserved_fraction"))

    def reserve(allocated: int, units: float) -> int:
        return int(allocated * (1 + fraction) + (units * s if off else 0))

    first_phase, first_parts = _step_peak(cfg, counted, k, g, optimizer_state_live=False, traced=traced)
    first_allocated = sum(p.nbytes for p in first_parts)
    first_reserved = reserve(first_allocated, k.first_step_offload_reserved_units)
    if first_step_only:
        phase, parts, allocated, reserved, units = (first_phase, first_parts, first_allocated, first_reserved,
                                                    k.first_step_offload_reserved_units)
    else:
        phase, parts = _step_peak(cfg, counted, k, g, optimizer_state_live=True, traced=traced)
        allocated = sum(p.nbytes for p in parts)
        units = k.offload_reserved_units
        reserved = reserve(allocated, units)
    host = off * s
    notes = []
    if off:
        parts = parts + [Part(f"host: {off} offloaded inputs x {s / GIB:.3f} GiB (exact-size pool)", host, "counted",
                              "host")]
        if off < saved:
            notes.append(f"host pool holds {off} of {saved} saved block inputs; the rest stay on the GPU")
    if traced is not None:
        notes.append("working sets traced on fake tensors (memory.trace.fake_trace), not measured")
    if k.carried:
        carried = ", ".join(dict.fromkeys(CONSTANT_NAMES[c] for c in CARRIED if c in k.carried))
        notes.append(f"{g.backbone}: block model's {carried} measured on {MEASURED_ON[REFERENCE_BACKBONE]}, "
                     "extrapolated")
    which = "the first step's" if first_step_only else "later steps'"
    parts = parts + [Part(f"allocator: reserved over allocated ({fraction:.1%}"
                          + (f" with sp = {sp}" if sp_reserve else f" with FSDP over {gpus} GPUs" if fsdp_reserve
                             else "")
                          + (f" + {units:.2g} inputs held by the side stream's copies, {which}" if off and units
                             else "")
                          + ")", reserved - allocated,
                          k.how("measured", fraction_key, *(["offload_reserved_units"] if off else [])))]
    # The allocator keeps what it reserved, so a process peaks at least at its first step's reserve. With offload,
    # what later steps allocate beyond the first step's peak (the optimizer state, live in backward from step 2 on)
    # lands on top of that pool: across the measured two-step runs the reserve grew by 0.85-1.5x the allocated
    # growth, never less, so the first step's offload reserve stays. Not where the fraction was fitted to whole
    # processes' peaks (sp, FSDP: it holds this already), nor where the first step's offload reserve is another
    # backbone's (Wan's own 63-s process peaks without it).
    grown = max(0, allocated - first_allocated)
    keeps_first = fraction_key == "reserved_fraction" and "first_step_offload_reserved_units" not in k.carried
    kept = first_reserved + grown if keeps_first else first_reserved
    if not first_step_only and kept > reserved:
        parts.append(Part(f"allocator: the first step's reserve above the later steps' ({first_allocated / GIB:.2f} "
                          f"GiB allocated at its {first_phase}, + {fraction:.1%} + "
                          f"{k.first_step_offload_reserved_units:.2g} inputs held by the first copies"
                          + (f", + the {grown / GIB:.2f} GiB allocated later on top" if keeps_first else "") + ")",
                          kept - reserved, k.how("measured", fraction_key, "first_step_offload_reserved_units")))
        notes.append(f"first step reserves {first_reserved / GIB:.1f} GiB, kept"
                     + (f"; later growth on top: {kept / GIB:.1f} GiB" if keeps_first else ""))
        reserved = kept
    return Breakdown(phase, parts, allocated, reserved, host, notes, first_reserved)


def fits_block_model(cfg: Config, gpus: int = 1, k: BlockConstants | None = None) -> bool:
    """Whether the block model counts this setup: every block and sub-module checkpointed (or, for the measured kind
    below, whole blocks alone), one block a unit, no kept outputs, the TTT-MLP layer (or none), and either

    - the measured kind: CogVideoX-5B, qkvo adapter (or sft: the same activations, more counted
      gradients and state), weights stored and computed in bf16, nested checkpointing and
      offload not both on. Other CogVideoX setups keep their measured per-token curves: the model's constants,
      fitted on this kind, under-predict LoRA with fp8 weights (its 18-s profile by 20%) and over-predict fp32
      weights under autocast (by 18% at 9 s), benchmarks/results/plan_accuracy_h100.json. This kind with whole blocks
      checkpointed and their parts not is counted too, where `k` (the constants at hand; None: assumed) holds the
      parts' measured activations (`BlockConstants.block_stream_copies`); or
    - another backbone (Wan), which has no measured curves at all: its parts are counted from its preset and layout
      with its own measured constants where it has them and CogVideoX-5B's carried over for the rest
      (`BlockConstants.for_backbone`), every adapter and weight dtype, and both nested checkpointing and offload at
      once (each saved span input in the host pool, the running span's unit inputs recomputed on the GPU). Its
      predictions say which constants are extrapolated.

    With sequence parallelism the parts are counted at the tokens one GPU holds (tokens / sp; the all-to-all buffers
    are stream-sized temporaries of the shard, inside the measured stream copies: the 63-s sp = 2 step allocated 75.9
    GiB per GPU on two H200s, counted 75.2), and the reserve is the one measured with sp (that run reserved 1.28x
    what it allocated, against 1.07x on one GPU: `BlockConstants.sp_reserved_fraction`)."""
    from tttvideo.memory.plan.costs import long_range_tag
    from tttvideo.models.backbone import backbone_of

    ck = cfg.checkpointing
    policy = checkpoint_policy(cfg)
    if long_range_tag(cfg):
        return False
    if backbone_of(cfg.model.preset).name not in MEASURED_BACKBONES:
        return policy == BLOCK_MODEL_POLICY
    whole = policy == WHOLE_BLOCK_POLICY and (k is None or k.block_stream_copies > 0)
    return ((policy == BLOCK_MODEL_POLICY or whole) and cfg.model.preset in MEASURED_PRESETS
            and cfg.model.adapter in BLOCK_MODEL_ADAPTERS and cfg.model.dtype == "bf16"
            and not (ck.nested_span > 1 and ck.offload_activations))
