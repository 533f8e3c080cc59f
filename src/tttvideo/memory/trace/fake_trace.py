"""What holds the memory of one block unit's training forward and backward, at full size, on the CPU.

    python -m tttvideo.memory.trace.fake_trace CONFIG [--set key=value ...] [--unit 0] [--top 15]

Builds the config's model under FakeTensorMode (shapes and dtypes, no storage: a 63-s Wan block costs no memory),
makes the fake CPU tensors allocate as a CUDA step would (`gpu_stand_ins.cuda_like`: CUDA autocast's fp32
operators, the fused attention kernels' buffers, the Triton TTT wrappers' buffers) and runs, under bf16 autocast as
`train.precision` says, one checkpointed block unit of the model (`checkpointing` as configured: block, sub-module
and FFN-chunk checkpointing) on stream-sized inputs: its forward, then its backward with the recompute (its
output, the next unit's input, is not counted in backward). `LiveBytes` counts the bytes alive op by op; the table
lists what was alive at each phase's peak, grouped by where it was made. The inputs (the stream x, the text
features, the time projection) are counted; weights are not (the planner counts them), nor are the other units'
saved inputs, gradients and optimizer state, nor the allocator's fragmentation.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass

import torch

from tttvideo.memory.trace.live_bytes import LiveBytes, PeakPart

GIB = 2**30


@dataclass
class PhasePeak:
    phase: str  # "forward" or "backward"
    peak: int  # bytes alive at the peak (inputs included)
    parts: list[PeakPart]


@dataclass
class UnitTrace:
    tokens: int
    dim: int
    blocks: tuple[int, int]  # [start, stop) of the unit
    phases: list[PhasePeak]
    input_shape: tuple[int, ...] = ()  # the unit's input x (the planner counts it among the saved inputs)
    input_bytes: int = 0

    def working_set(self, phase: str) -> tuple[int, list[PeakPart]]:
        """A phase's peak without the unit's input x: (bytes, parts), what the block that runs adds to the saved
        inputs, weights, gradients and optimizer state (`memory.plan.activations.train_peak` with a trace)."""
        ph = next(p for p in self.phases if p.phase == phase)
        parts = list(ph.parts)
        for i, p in enumerate(parts):
            if p.site.endswith("_block_inputs") and p.shape == self.input_shape:
                parts[i] = PeakPart(p.site, p.module, p.op, p.dtype, p.shape, p.count - 1, p.nbytes - self.input_bytes)
                break
        return ph.peak - self.input_bytes, [p for p in parts if p.nbytes > 0]


def _block_inputs(model, cfg, layout, dtype: torch.dtype) -> tuple:
    """The stream x [B, L, dim] (requiring grad, as every unit but the first gets it), the embedded text
    [B, n, text_len, dim] and the time projection [B, 6, dim], in the dtype autocast gives them."""
    spec = model.spec
    B = cfg.train.batch_size
    x = torch.empty(B, layout.total_tokens, spec.dim, dtype=dtype).requires_grad_(True)
    text = torch.empty(B, layout.num_segments, layout.text_tokens, spec.dim, dtype=dtype)
    projection = torch.empty(B, 6, spec.dim, dtype=dtype)
    return x, text, projection


def _fake_cpu_tensors(model: torch.nn.Module) -> None:
    """Every meta parameter and buffer of `model` replaced by a fake CPU tensor of its shape and dtype (inside
    FakeTensorMode)."""
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                m._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                         requires_grad=p.requires_grad)
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = torch.empty(b.shape, dtype=b.dtype)


@contextlib.contextmanager
def _cold_layout_tables():
    """The per-layout tables every block shares (window indices, RoPE tables, scan orders: lru-cached by layout and
    device) emptied before and after: the trace counts them once, as block 0 makes them on the GPU, and no fake
    tensor stays in a cache for real code to find."""
    from tttvideo.models import attention as cogvideox_attention
    from tttvideo.models.wan import attention as wan_attention
    from tttvideo.sequence import bidirectional, full_attention
    from tttvideo.ttt import eta_layout, layer

    caches = (wan_attention.window_gather, wan_attention.window_table, wan_attention.window_rope,
              wan_attention.window_indices, layer.layout_tensors, bidirectional.scan_permutations,
              cogvideox_attention.window_tensors, cogvideox_attention.window_covers, full_attention.global_rope,
              eta_layout.eta_rows_on)
    for c in caches:
        c.cache_clear()
    try:
        yield
    finally:
        for c in caches:
            c.cache_clear()


def trace_unit(cfg, unit: int = 0, fake: bool = True) -> UnitTrace:
    """Trace block unit `unit` of the config's model (a Wan backbone: the inputs are its block's); `fake=False`
    runs it on real CPU tensors instead (small configs only: the tests compare the two)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tttvideo.config.loader import with_overrides
    from tttvideo.dtypes import torch_dtype
    from tttvideo.errors import ConfigError
    from tttvideo.memory.trace.gpu_stand_ins import cuda_like
    from tttvideo.models.backbone import backbone_of, layout_of
    from tttvideo.models.build import build_model

    if backbone_of(cfg.model.preset).name != "wan":
        raise ConfigError(f"model.preset {cfg.model.preset!r} is not a Wan preset; the trace feeds a "
                          "Wan block's inputs")
    # no weights are read: the fake model has random (absent) values
    cfg = with_overrides(cfg, ["model.pretrained_path=", "train.init_from="])
    layout = layout_of(cfg)
    autocast = cfg.train.precision in ("bf16", "fp16")
    act = torch_dtype(cfg.train.precision) if autocast else torch_dtype(cfg.model.dtype)
    if fake:
        model = build_model(cfg, "meta")  # the skeleton: every shape, dtype and requires_grad, no data
        mode = FakeTensorMode(allow_non_fake_inputs=True)
    else:
        model = build_model(cfg, "cpu")
        mode = contextlib.nullcontext()
    with mode, _cold_layout_tables():
        if fake:
            _fake_cpu_tensors(model)
        units = model.block_units
        if not 0 <= unit < len(units):
            raise ConfigError(f"--unit {unit} is not one of the model's {len(units)} block units")
        start, stop, _ = units[unit]
        phases = []
        with cuda_like(), torch.autocast("cpu", dtype=act, enabled=autocast):
            live = LiveBytes(model)
            with live:
                x, text, projection = _block_inputs(model, cfg, layout, act)
                y = model._run_units(x, unit, unit + 1, text, projection, layout)
                phases.append(PhasePeak("forward", live.peak, live.peak_parts()))
                # the unit's output is the next unit's input: the block model counts it among the saved inputs
                live.forget(y)
                grad = torch.empty_like(y)
                live.reset_peak()
                torch.autograd.backward(y, grad)
                phases.append(PhasePeak("backward", live.peak, live.peak_parts()))
    return UnitTrace(layout.total_tokens * cfg.train.batch_size, model.spec.dim, (start, stop), phases,
                     tuple(x.shape), x.numel() * x.element_size())


def format_trace(trace: UnitTrace, top: int = 15) -> str:
    stream = trace.tokens * trace.dim * 2
    lines = [f"block unit {trace.blocks[0]}..{trace.blocks[1] - 1}: {trace.tokens:,} tokens x {trace.dim}; one bf16 "
             f"stream-sized tensor = {stream / GIB:.3f} GiB"]
    for ph in trace.phases:
        lines.append("")
        lines.append(f"{ph.phase}: peak {ph.peak / GIB:.2f} GiB alive ({ph.peak / stream:.1f} bf16 streams)")
        lines.append(f"  {'GiB':>7} {'n':>3}  {'dtype':9} {'shape':28} {'made in':40} {'module':30} op")
        for p in ph.parts[:top]:
            lines.append(f"  {p.nbytes / GIB:7.3f} {p.count:3d}  {p.dtype:9} {str(list(p.shape)):28} {p.site[:40]:40} "
                         f"{p.module[:30]:30} {p.op}")
        rest = ph.parts[top:]
        if rest:
            lines.append(f"  {sum(p.nbytes for p in rest) / GIB:7.3f} {sum(p.count for p in rest):3d}  "
                         f"(the other {len(rest)} groups)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from tttvideo.config.loader import load_config
    from tttvideo.errors import UserError

    parser = argparse.ArgumentParser(prog="python -m tttvideo.memory.trace.fake_trace", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--unit", type=int, default=0, help="the block unit to trace (default 0)")
    parser.add_argument("--top", type=int, default=15, help="rows per phase (default 15)")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        trace = trace_unit(cfg, args.unit)
    except UserError as e:
        print(f"fake_trace: error: {e}", file=sys.stderr)
        return 2
    print(format_trace(trace, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
