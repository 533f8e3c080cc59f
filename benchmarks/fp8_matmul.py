"""fp8 matrix products for frozen weights (`model.fp8_matmul`) beside the same weights upcast from fp8 storage and in
bf16, in one process: the guided sampling step (time, attention / TTT / rest) at a short and a long duration, the
output error of one guided prediction against bf16 weights, and each frozen layer shape alone.

    PYTHONPATH=src python3 benchmarks/fp8_matmul.py --train-durations 3 9 --out benchmarks/results/fp8_matmul_h100.json
    PYTHONPATH=src python3 benchmarks/fp8_matmul.py --preset tiny --device cpu --height 32 --width 48 \
        --text-tokens 8 --long 6 --timed-blocks 1 --out /tmp/fp8.json                               # CPU smoke run

One model (random weights, seed 0, `model.adapter` qkvo as the stage configs: q, k, v, o and TTT trained and kept
in bf16, every other linear frozen) is measured four times, changed in place between: "bf16" (frozen weights in
bf16), "fp8 storage" (`model.frozen_weights = 'fp8'`: e4m3 codes upcast to bf16 in every call), "fp8 matmul"
(`model.fp8_matmul`: activations quantised per token, torch._scaled_mm) and "fp8 matmul, every linear" (sampling
with `sample.fp8_linears = 'all'`: the trained linears in fp8 too; not a training variant). The guided step is
`benchmarks/sample.py`'s (batch 2, CUDA events around every block's attention and TTT); the long duration runs its
first --timed-blocks blocks and adds the mean block time for the rest. The error is the relative L2 distance of one
guided prediction at the short duration from the bf16 model's. The layer table times F.linear on the upcast weight
against `fp8_linear` (quantisation of the input included) at the short step's token count (batch 2), median of
--repeats, and the quantisation alone: `quantize_tokens_fast` (the Triton kernel on a GPU with fp8) against the
torch.compile'd `quantize_tokens` fp8_linear ran before it. With --train-durations, the trainer's training step
(forward + backward of one video, `benchmarks/model_step.py`'s step and timing, its default checkpointing; weights
in fp32 on the CPU) of each variant at those durations, a fresh model each.

The JSON (default benchmarks/results/fp8_matmul_<gpu>.json) holds the device, torch, commit and every row; the
table is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/sample.py, run as a script or module
import model_step  # noqa: E402
import sample  # noqa: E402

from tttvideo.layout import VideoLayout  # noqa: E402
from tttvideo.models.backbone import get_preset  # noqa: E402
from tttvideo.models import build_model  # noqa: E402
from tttvideo.models.fp8_storage import (Fp8Linear, check_fp8_matmul, fp8_linear, quantize_tokens,  # noqa: E402
                                         quantize_tokens_fast, store_every_linear_fp8, store_fp8,
                                         use_fp8_matmul, use_quantize_kernel)
from tttvideo.train.distributed import TrainRanks  # noqa: E402

# each variant's settings on top of model_step's config (qkvo adapter: the trained layers stay in bf16), in the
# order they are measured
VARIANT_SETTINGS = {"bf16": ("model.frozen_weights=dtype",),
                    "fp8 storage": ("model.frozen_weights=fp8",),
                    "fp8 matmul": ("model.frozen_weights=fp8", "model.fp8_matmul=true"),
                    # sampling only: the trained linears too (nothing trains when sampling)
                    "fp8 matmul, every linear": ("model.frozen_weights=fp8", "model.fp8_matmul=true",
                                                 "sample.fp8_linears=all")}
VARIANTS = tuple(VARIANT_SETTINGS)
TRAIN_VARIANTS = VARIANTS[:3]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="cogvideox-5b")
    ap.add_argument("--short", type=int, default=3, help="seconds: every block runs, and the error is measured")
    ap.add_argument("--long", type=int, default=63, help="seconds: --timed-blocks run, the rest extrapolated")
    ap.add_argument("--timed-blocks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=720)
    ap.add_argument("--text-tokens", type=int, default=0, help="0 = the original's per-duration length")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--train-durations", type=int, nargs="*", default=[],
                    help="seconds: also time the training step of each variant there")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override")
    ap.add_argument("--out", default="")
    return ap.parse_args(argv)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` calls after one warm-up (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def layer_rows(model, tokens: int, device: torch.device, dtype: torch.dtype, repeats: int) -> list[dict]:
    """Each distinct frozen layer shape: F.linear on the upcast weight against fp8_linear, at `tokens` rows."""
    rows, seen = [], set()
    for layer in (m for m in model.modules() if isinstance(m, Fp8Linear) and m.fp8_matmul):
        shape = (layer.in_features, layer.out_features)
        if shape in seen:
            continue
        seen.add(shape)
        x = torch.randn(tokens, layer.in_features, device=device, dtype=dtype)
        weight = layer.weight.to(dtype)
        bias = None if layer.bias is None else layer.bias.to(dtype)
        plain = timed(lambda: F.linear(x, weight, bias), device, repeats)
        in_fp8 = timed(lambda: fp8_linear(x, layer.weight_fp8, layer.weight_scale, bias, dtype), device, repeats)
        flops = 2 * tokens * layer.in_features * layer.out_features
        rows.append({"in": shape[0], "out": shape[1], "tokens": tokens, "layers": sum(
            isinstance(m, Fp8Linear) and (m.in_features, m.out_features) == shape for m in model.modules()),
            "bf16_ms": plain * 1e3, "fp8_ms": in_fp8 * 1e3, "speedup": plain / in_fp8,
            "bf16_tflops": flops / plain / 1e12, "fp8_tflops": flops / in_fp8 / 1e12,
            **quantize_timings(x, device, repeats)})
    return rows


def quantize_timings(x: torch.Tensor, device: torch.device, repeats: int) -> dict:
    """fp8_linear's input quantisation alone: what it runs (`quantize_tokens_fast`: the Triton kernel on a GPU with
    fp8, the reference elsewhere) against the torch.compile'd reference it replaced (eager off CUDA), with the
    bandwidth each reaches (x read once, codes and scales written once)."""
    compiled = torch.compile(quantize_tokens, dynamic=True) if x.is_cuda else quantize_tokens
    fast, reference = timed(lambda: quantize_tokens_fast(x), device, repeats), timed(lambda: compiled(x), device,
                                                                                     repeats)
    moved = x.numel() * (x.element_size() + 1) + x.shape[0] * 4
    return {"quantize_kernel": "triton" if use_quantize_kernel(x) else "reference", "quantize_ms": fast * 1e3,
            "quantize_compiled_ms": reference * 1e3, "quantize_gbs": moved / fast / 1e9,
            "quantize_compiled_gbs": moved / reference / 1e9}


def train_rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """The training step of each variant at each of --train-durations (model_step's build, step and timing)."""
    rows = []
    for duration in args.train_durations:
        for variant in TRAIN_VARIANTS:
            margs = model_step.parse_args([
                "--preset", args.preset, "--device", str(device), "--durations", str(duration),
                "--height", str(args.height), "--width", str(args.width), "--text-tokens", str(args.text_tokens),
                "--steps", str(args.repeats), "--warmup", "1", "--dtype", "bf16" if device.type == "cuda" else "fp32",
                *[x for s in (*VARIANT_SETTINGS[variant], *args.overrides) for x in ("--set", s)]])
            cfg = model_step.bench_config(margs)
            ranks = TrainRanks.start(cfg, get_preset(cfg.model.preset).num_attention_heads, device)
            model, _, _ = model_step.build(cfg, device)
            layout = VideoLayout.from_config(cfg.layout, cfg.ttt, f"{duration}s")
            row, failure = model_step.run_duration(cfg, model, layout, margs, device, float("inf"), ranks)
            keep = ("median_step_s", "step_s", "mfu", "peak_allocated_gib", "peak_reserved_gib", "error")
            rows.append({"variant": variant, "duration_s": duration, "tokens": layout.total_tokens,
                         **{k: row[k] for k in keep if k in row}})
            if failure:
                rows[-1]["fast_path_failure"] = failure
            print(json.dumps(rows[-1]), flush=True)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16
    sample_args = sample.parse_args(["--preset", args.preset, "--height", str(args.height), "--width",
                                     str(args.width), "--text-tokens", str(args.text_tokens),
                                     *[x for s in ["model.adapter=qkvo", *args.overrides] for x in ("--set", s)]])
    cfg = sample.benchmark_config(sample_args)
    cfg.model.frozen_weights, cfg.model.fp8_matmul = "fp8", True
    check_fp8_matmul(cfg, device)  # a GPU without fp8 tensor cores: one sentence before any build
    cfg.model.frozen_weights, cfg.model.fp8_matmul = "dtype", False
    env = sample.environment(device)
    gpu = env["device"].split()[1].lower() if device.type == "cuda" else "cpu"
    out = Path(args.out or f"benchmarks/results/fp8_matmul_{gpu}.json")
    report = sample.Report(out, {"benchmark": "fp8_matmul", **env, "preset": args.preset, "gpus": 1, "use_ttt": True,
                                 "command": " ".join(["python3", "benchmarks/fp8_matmul.py", *(argv or sys.argv[1:])]),
                                 "steps": [], "layers": []})
    data = report.data
    torch.manual_seed(0)
    model = build_model(cfg, device=device).eval()  # qkvo and TTT keep requires_grad: store_fp8 leaves them
    short, long = (VideoLayout.from_config(cfg.layout, cfg.ttt, f"{s}s", phase="sample") for s in (args.short,
                                                                                                    args.long))
    x, text, uncond = sample.step_inputs(model.spec, short, device, dtype, seed=1)
    reference = None
    for variant in VARIANTS:
        if variant == "fp8 storage":
            data["fp8_layers"] = store_fp8(model)
        elif variant == "fp8 matmul":
            data["fp8_matmul_layers"] = use_fp8_matmul(model, device)[0]
        elif variant == "fp8 matmul, every linear":
            data["fp8_matmul_every_layers"] = store_every_linear_fp8(model, device, True)[0]
        with torch.no_grad():
            prediction = sample.guided_step(model, short, x, text, uncond, batched=True)
        reference = prediction if reference is None else reference
        for layout, blocks in ((short, None), (long, args.timed_blocks)):
            row = sample.measure(model, layout, device, dtype, blocks, args.repeats, batched=True)
            row.update(variant=variant, duration_s=layout.duration_s, tokens=layout.total_tokens)
            if layout is short:
                row["error_vs_bf16"] = rel(prediction, reference)
            data["steps"].append(row)
            print(json.dumps(row), flush=True)
            report.save()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    data["layers"] = layer_rows(model, 2 * short.total_tokens, device, dtype, args.repeats)
    report.save()
    del model
    if args.train_durations:
        data["train"] = train_rows(args, device)
        report.save()
    print_table(data)
    return 0


def print_table(data: dict) -> None:
    print(f"\nfp8 matrix products for frozen weights, {data['device']}, torch {data['torch']}, "
          f"commit {data['git_commit']}")
    print("\n| variant | duration | guided step (s) | attention | TTT | rest | peak alloc (GiB) | error vs bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in data["steps"]:
        if "step_s" not in r:
            print(f"| {r['variant']} | {r['duration_s']} s | {r.get('error') or 'out of memory'} | | | | | |")
            continue
        err = f"{100 * r['error_vs_bf16']:.2f} %" if "error_vs_bf16" in r else ""
        peak = f"{r['peak_allocated_gib']:.1f}" if "peak_allocated_gib" in r else "-"
        extra = " (extrapolated)" if r["blocks_timed"] < r["blocks_total"] else ""
        print(f"| {r['variant']} | {r['duration_s']} s | {r['step_s']:.3f}{extra} | {r['attention_s']:.3f} | "
              f"{r['ttt_s']:.3f} | {r['rest_s']:.3f} | {peak} | {err} |")
    print("\n| frozen layer (in -> out) | layers | tokens | bf16 ms | fp8 ms | speedup | bf16 TFLOP/s | fp8 TFLOP/s | "
          "quantize by | quantize ms (GB/s) | compiled reference ms (GB/s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in data["layers"]:
        print(f"| {r['in']} -> {r['out']} | {r['layers']} | {r['tokens']} | {r['bf16_ms']:.3f} | {r['fp8_ms']:.3f} | "
              f"{r['speedup']:.2f}x | {r['bf16_tflops']:.0f} | {r['fp8_tflops']:.0f} | {r['quantize_kernel']} | "
              f"{r['quantize_ms']:.3f} ({r['quantize_gbs']:.0f}) | {r['quantize_compiled_ms']:.3f} "
              f"({r['quantize_compiled_gbs']:.0f}) |")
    if data.get("train"):
        print("\n| training step (forward + backward) | duration | median s | peak alloc (GiB) |")
        print("|---|---|---|---|")
        for r in data["train"]:
            step = f"{r['median_step_s']:.3f}" if "median_step_s" in r else r.get("error", "-")
            peak = f"{r['peak_allocated_gib']:.1f}" if "peak_allocated_gib" in r else "-"
            print(f"| {r['variant']} | {r['duration_s']} s | {step} | {peak} |")


if __name__ == "__main__":
    raise SystemExit(main())
