"""A training step's GPU memory as a sum of counted parts, phase by phase, for the setups whose every block and
every sub-module is checkpointed (the stage configs' policy), with their block inputs kept, nested or offloaded, and
the MLP whole or over token chunks. The shapes come from the backbone's preset and layout (`Geometry.of`), so it
serves every backbone; its constants were measured on CogVideoX-5B, and for another backbone (Wan) every part that
uses one says it is extrapolated (`Geometry.how`).

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
  the adaLN-modulated inputs): a measured number of stream-sized tensors (`stream_copies`, fitted at 9 s).

Where the peak falls depends on the policy, so each phase is counted and the largest wins (`train_peak`):
the end of forward (every saved input, no gradients yet), each unit's backward recompute (the inputs still saved,
the gradients of the blocks already done, the working set), and the optimizer step (weights, all gradients,
the optimizer state). With nested checkpointing (spans of k units) forward keeps one input per span and a span's
backward its k units' inputs: about n / k + k instead of n. With activation offload the inputs go to a host pool of
exact-size buffers (as many as `checkpointing.offload_host_gib` holds; the rest stay on the GPU) and two are on the
GPU at a time in backward (the one in use and the one prefetched).

The allocator reserves more than it allocates: `reserved_fraction` of the peak, plus, with offload, a few
stream-sized blocks that the side stream's copies keep from reuse (`offload_reserved_units`). Both constants are
measured (costs.json's "blocks" table of a GPU kind, written from benchmarks/results by benchmarks/plan_accuracy.py's
`--fit`); the structure carries the growth, so the 9-s calibration predicts 18 and 63 s (docs/memory.md, "Planner
accuracy").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tttvideo.config.schema import Config
from tttvideo.layout import VideoLayout
from tttvideo.memory.plan.count import Counted

GIB = 2**30

# the setup the block model is measured for: every block and each of its four parts checkpointed, one block a unit
BLOCK_MODEL_POLICY = "sub-block"
MEASURED_ADAPTERS = ("qkvo",)
# adapters whose activations are the measured ones': full fine-tuning saves the same block inputs and runs the same
# working sets (its extra gradients and optimizer state are counted parts); LoRA adds low-rank activations
BLOCK_MODEL_ADAPTERS = MEASURED_ADAPTERS + ("sft",)
MEASURED_PRESETS = ("cogvideox-5b",)
MEASURED_BACKBONES = ("cogvideox",)


@dataclass(frozen=True)
class BlockConstants:
    """The measured constants of the block model for one GPU kind (costs.json, "blocks")."""

    stream_copies: float  # stream-sized tensors live in a block's backward recompute beyond the counted parts
    saved_extra_per_token: float  # bytes a token a checkpointed unit saves beyond its input
    reserved_fraction: float  # the allocator's reserved above allocated, as a fraction of the peak
    offload_reserved_units: float  # with offload: extra reserved memory, in saved inputs
    # step time against the same step with the inputs kept (one process, 9 s): nested recomputes each span once
    # more; offload's copies hide behind compute
    nested_time: float = 1.0
    offload_time: float = 1.0
    # measured (tokens, seconds) of the step with the inputs kept: the step time's curve (`costs.Curve`)
    time_points: tuple[tuple[float, float], ...] = ()
    source: str = ""

    @classmethod
    def from_dict(cls, d: dict) -> "BlockConstants":
        return cls(float(d["stream_copies"]), float(d["saved_extra_per_token"]), float(d["reserved_fraction"]),
                   float(d["offload_reserved_units"]), float(d.get("nested_time", 1.0)),
                   float(d.get("offload_time", 1.0)),
                   tuple((float(t), float(v)) for t, v in d.get("time_points", ())), str(d.get("source", "")))

    def to_dict(self) -> dict:
        return {"stream_copies": self.stream_copies, "saved_extra_per_token": self.saved_extra_per_token,
                "reserved_fraction": self.reserved_fraction, "offload_reserved_units": self.offload_reserved_units,
                "nested_time": self.nested_time, "offload_time": self.offload_time,
                "time_points": [list(p) for p in self.time_points], "source": self.source}

    def time_factor(self, cfg: Config) -> float:
        ck = cfg.checkpointing
        # the copies can only add work: a measured offload factor below 1 is one run's noise, and would rank
        # offloading a short video (nothing to gain) above keeping its inputs
        return self.nested_time if ck.nested_span > 1 else max(1.0, self.offload_time) if ck.offload_activations \
            else 1.0


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
    reserved: int
    host: int
    notes: list[str] = field(default_factory=list)

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
        return cls(spec.num_layers, dim, heads, hd, act, per_gpu * batch, cfg.ttt.mini_batch_size,
                   max(1, cfg.ttt.scan_checkpoint_group_size), state, getattr(spec, "ffn_dim", 4 * dim), rows,
                   batch * text, backbone.name, layout.window_tokens)

    @property
    def stream(self) -> int:
        """Bytes of one stream-sized tensor (tokens x dim)."""
        return self.tokens * self.dim * self.act_bytes

    @property
    def measured(self) -> bool:
        """Whether the block model's constants were measured on this backbone (else extrapolated to it)."""
        return self.backbone in MEASURED_BACKBONES

    def how(self, what: str) -> str:
        """A part's basis, saying where a constant measured on CogVideoX-5B is carried over to another backbone."""
        if self.measured or "measured" not in what:
            return what
        return what.replace("measured", "measured on CogVideoX-5B, extrapolated")

    def ffn_chunk_time(self) -> float:
        """Step time with the MLP over token chunks against without: one more forward of the MLP in a step of about
        five forwards' work under sub-block checkpointing (forward, block recompute, part recompute, backward at
        twice a forward), weighted by the MLP's share of a block's matrix work per token (estimated from the shapes,
        not measured)."""
        d = self.dim
        mlp = 4 * d * self.hidden
        block = (mlp + 8 * d * d  # attention q/k/v/o
                 + 4 * self.window_tokens * d  # attention scores and values over a window
                 + 16 * d * d  # the TTT layer's projections, both passes
                 + (4 * d * d + 4 * self.cross_text_tokens * d if self.cross_text_tokens else 0))
        return 1 + mlp / (5 * block)


def saved_input(g: Geometry, k: BlockConstants) -> int:
    """Bytes a checkpointed unit saves for backward: its input and the other per-token tensors it saves."""
    return g.stream + int(g.tokens * k.saved_extra_per_token)


def working_set(g: Geometry, k: BlockConstants) -> list[Part]:
    """The largest working set inside one block's backward recompute, part by part."""
    checkpoints = math.ceil(g.tokens / (g.mini_batch * g.scan_group))
    chunked = g.ffn_rows < g.tokens
    rows = f"{g.ffn_rows} rows (one chunk)" if chunked else "tokens"
    parts = [
        Part(f"working set: MLP hidden ({rows} x {g.hidden} x {g.act_bytes} B)", g.ffn_rows * g.hidden * g.act_bytes,
             "counted"),
        Part("working set: fp32 upcasts of the stream (tokens x dim x 4 B)", g.tokens * g.dim * 4, "counted"),
        Part(f"working set: TTT scan checkpoints ({checkpoints} x {g.heads} heads x {g.ttt_state_values} fp32, "
             "forward and reverse)", 2 * checkpoints * g.heads * g.ttt_state_values * 4, "counted"),
        Part(f"working set: attention and other stream-sized temporaries ({k.stream_copies:.1f} x tokens x dim)",
             int(k.stream_copies * g.stream), g.how("counted x measured")),
    ]
    if g.cross_text_tokens:
        parts.append(Part(f"working set: cross-attention keys and values of the text ({g.cross_text_tokens} tokens "
                          f"x dim, 2 x {g.act_bytes} B)", 2 * g.cross_text_tokens * g.dim * g.act_bytes, "counted"))
    return parts


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


def train_peak(cfg: Config, counted: Counted, k: BlockConstants, gpus: int = 1,
               optimizer_state_live: bool = True,
               traced: tuple[list[Part], list[Part]] | None = None) -> Breakdown:
    """The peak of a training step of `cfg` (block model policy) as counted parts; `optimizer_state_live=False`:
    the first step of a process, whose optimizer state appears only at its optimizer step; `traced`: the (forward,
    backward) working sets of the block that runs from a trace of it (`memory.plan.traced`) instead of the counted
    `working_set`."""
    g = Geometry.of(cfg, gpus)
    s = saved_input(g, k)
    ws_forward = ws = working_set(g, k)
    if traced is not None:
        ws_forward, ws = traced
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

    phases: list[tuple[str, int, list[Part]]] = []
    base = [Part("weights (storage dtypes)", counted.weights, "counted")]
    if opt:
        base.append(Part("optimizer state", opt, "counted"))
    fwd_inputs = len(spans) - off
    phases.append(("end of forward", 0, base + [Part(f"saved inputs: {fwd_inputs} x {s / GIB:.3f} GiB", fwd_inputs * s,
                                                     "counted")] + ws_forward))
    for unit in range(n - 1, -1, -1):
        live, what = on_gpu_inputs(unit)
        grads = counted.gradients if unit == 0 else (n - unit) * grad_per_unit
        phases.append((f"backward of block {unit}", 0, base + [
            Part(f"gradients ({n - unit} of {n} blocks)", grads, "counted"),
            Part(f"saved inputs: {live} x {s / GIB:.3f} GiB ({what})", live * s, "counted")] + ws))
    optimizer_step = [Part("weights (storage dtypes)", counted.weights, "counted"),
                      Part("gradients", counted.gradients, "counted"),
                      Part("optimizer state", counted.optimizer, "counted")]
    phases.append(("optimizer step", 0, optimizer_step))
    phase, _, parts = max(phases, key=lambda p: sum(x.nbytes for x in p[2]))
    allocated = sum(p.nbytes for p in parts)
    reserved = int(allocated * (1 + k.reserved_fraction) + (k.offload_reserved_units * s if off else 0))
    host = off * s
    notes = []
    if off:
        parts = parts + [Part(f"host: {off} offloaded inputs x {s / GIB:.3f} GiB (exact-size pool)", host, "counted",
                              "host")]
        if off < len(spans):
            notes.append(f"host pool holds {off} of {len(spans)} saved block inputs; the rest stay on the GPU")
    if traced is not None:
        notes.append("working sets traced on fake tensors (memory.trace.fake_trace), not measured")
    if not g.measured:
        notes.append(f"{g.backbone}: block model constants measured on CogVideoX-5B, extrapolated"
                     + (" (the saved extra per token and the reserve)" if traced is not None else ""))
    parts = parts + [Part(f"allocator: reserved over allocated ({k.reserved_fraction:.0%}"
                          + (f" + {k.offload_reserved_units:g} inputs held by the side stream's copies" if off else "")
                          + ")", reserved - allocated, g.how("measured"))]
    return Breakdown(phase, parts, allocated, reserved, host, notes)


def fits_block_model(cfg: Config, gpus: int = 1) -> bool:
    """Whether the block model counts this setup: every block and sub-module checkpointed, one block a unit, no
    kept outputs, the TTT-MLP layer (or none), no sequence parallelism across GPUs, and either

    - the measured kind: CogVideoX-5B, qkvo adapter (or sft: the same activations, more counted
      gradients and state), weights stored and computed in bf16, nested checkpointing and
      offload not both on. Other CogVideoX setups keep their measured per-token curves: the model's constants,
      fitted on this kind, under-predict LoRA with fp8 weights (its 18-s profile by 20%) and over-predict fp32
      weights under autocast (by 18% at 9 s), benchmarks/results/plan_accuracy_h100.json; or
    - another backbone (Wan), which has no measured curves at all: its parts are counted from its preset and layout
      with the constants measured on CogVideoX-5B carried over, every adapter and weight dtype, and both nested
      checkpointing and offload at once (each saved span input in the host pool, the running span's unit inputs
      recomputed on the GPU). Its predictions say the constants are extrapolated.

    With sp > 1 Ulysses' all-to-all buffers raise the reserve far above one GPU's (a 63-s sp = 2 run reserved 1.28x
    what it allocated), so those setups wait for a measurement."""
    from tttvideo.memory.plan.costs import long_range_tag
    from tttvideo.memory.techniques import checkpoint_policy
    from tttvideo.models.backbone import backbone_of

    ck = cfg.checkpointing
    common = (not long_range_tag(cfg) and (gpus == 1 or cfg.parallel.sp == 1)
              and checkpoint_policy(cfg) == BLOCK_MODEL_POLICY)
    if backbone_of(cfg.model.preset).name not in MEASURED_BACKBONES:
        return common
    return (common and cfg.model.preset in MEASURED_PRESETS and cfg.model.adapter in BLOCK_MODEL_ADAPTERS
            and cfg.model.dtype == "bf16" and not (ck.nested_span > 1 and ck.offload_activations))
