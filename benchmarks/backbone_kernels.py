"""Where the backbone's forward goes, kernel by kernel, beside diffusers: attention backends, bf16 against fp8 GEMMs.

For the CogVideoX-5B backbone at one duration (3 s: one window of 18,048 tokens, 48 heads of 64) it times, on one
GPU, each piece that could make the forward faster than diffusers' transformer, with its error against an fp32
reference on the same random inputs:

- attention: SDPA with each of its CUDA backends (cuDNN, flash, memory-efficient), forward and forward + backward,
  and SageAttention's 8-bit forward (`sageattention`, when installed);
- the block's four GEMM shapes as F.linear in bf16 and as a row-wise scaled fp8 product (`torch._scaled_mm`, weights
  quantised once, the activations per call; the quantisation is timed with it);
- one inference forward and one training step (forward + backward, no optimizer; --set overrides, e.g. the
  checkpointing) of our backbone (TTT off) and of diffusers' transformer (every block checkpointed), profiled:
  kernel time by kind.

The table is printed and the rows written as JSON (--out). Medians of --repeats after one warm-up.

    PYTHONPATH=src python3 benchmarks/backbone_kernels.py --out benchmarks/results/backbone_kernels_h100.json
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tttvideo.layout import VideoLayout
from tttvideo.memory.profile.profiler import git_commit
from tttvideo.memory.profile.trace import is_kernel, kernel_kind
from tttvideo.models.backbone import get_preset
from tttvideo.models.fp8_storage import quantize_rows
from tttvideo.results import save_json


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def scaled_linear_fp8(x8: torch.Tensor, xs: torch.Tensor, w8: torch.Tensor, ws: torch.Tensor,
                      bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x @ w.T + bias from row-wise scaled fp8 codes of both (cuBLAS fp8 GEMM, row-wise scales)."""
    return torch._scaled_mm(x8, w8.t(), scale_a=xs[:, None], scale_b=ws[None, :], bias=bias, out_dtype=dtype)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


# ----------------------------------------------------------------------------------------------------- attention
def attention_rows(tokens: int, heads: int, head_dim: int, repeats: int) -> list[dict[str, Any]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, heads, tokens, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    ref_heads = 4  # the fp32 reference on a few heads: the error is per head alike
    want = F.scaled_dot_product_attention(*(t[:, :ref_heads].float() for t in (q, k, v)))
    flops = 4 * tokens * tokens * heads * head_dim
    rows = []
    for name, backend in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("memory-efficient", SDPBackend.EFFICIENT_ATTENTION)):
        row: dict[str, Any] = {"piece": "attention", "name": f"SDPA {name}", "dtype": "bf16"}
        try:
            with sdpa_kernel(backend):
                row["error"] = rel_error(F.scaled_dot_product_attention(q[:, :ref_heads], k[:, :ref_heads],
                                                                        v[:, :ref_heads]), want)
                row["forward_ms"] = median_ms(lambda: F.scaled_dot_product_attention(q, k, v), repeats)
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                row["forward_backward_ms"] = median_ms(
                    lambda: F.scaled_dot_product_attention(qg, kg, vg).sum().backward(), repeats)
        except RuntimeError as e:
            row["error_message"] = str(e).splitlines()[0][:200]
        rows.append(row)
    # the layout a model hands over matters: [B, S, H, D] transposed to [B, H, S, D] without a copy (each head's rows
    # 3,072 elements apart) against contiguous heads
    qs, ks, vs = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        row = {"piece": "attention", "name": "SDPA cuDNN, [B, S, H, D] views", "dtype": "bf16",
               "error": rel_error(F.scaled_dot_product_attention(qs[:, :ref_heads], ks[:, :ref_heads],
                                                                 vs[:, :ref_heads]), want),
               "forward_ms": median_ms(lambda: F.scaled_dot_product_attention(qs, ks, vs), repeats)}
        qg, kg, vg = (t.detach().requires_grad_() for t in (qs, ks, vs))
        row["forward_backward_ms"] = median_ms(lambda: F.scaled_dot_product_attention(qg, kg, vg).sum().backward(),
                                               repeats)
        rows.append(row)
    try:
        from sageattention import sageattn
    except ImportError:
        rows.append({"piece": "attention", "name": "SageAttention", "error_message": "sageattention not installed"})
    else:
        row = {"piece": "attention", "name": "SageAttention 1 (int8 QK, fp16 PV)", "dtype": "int8/fp16"}
        row["error"] = rel_error(sageattn(q[:, :ref_heads], k[:, :ref_heads], v[:, :ref_heads]), want)
        row["forward_ms"] = median_ms(lambda: sageattn(q, k, v), repeats)
        rows.append(row)
    for row in rows:
        for key, mult in (("forward_ms", 1.0), ("forward_backward_ms", 3.5)):
            if key in row:
                row[key.replace("_ms", "_tflops")] = mult * flops / (row[key] * 1e-3) / 1e12
    return rows


# ---------------------------------------------------------------------------------------------------- GEMMs
def linear_rows(tokens: int, dim: int, repeats: int) -> list[dict[str, Any]]:
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    quantize = torch.compile(quantize_rows, dynamic=False)
    for name, k, n in (("q, k, v, o", dim, dim), ("MLP up", dim, 4 * dim), ("MLP down", 4 * dim, dim)):
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / math.sqrt(k)
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        want = F.linear(x[:1024].float(), w.float(), b.float())
        w8, ws = quantize_rows(w)
        flops = 2 * tokens * k * n
        bf16_ms = median_ms(lambda: F.linear(x, w, b), repeats)
        quant_ms = median_ms(lambda: quantize(x), repeats)
        x8, xs = quantize(x)
        mm_ms = median_ms(lambda: scaled_linear_fp8(x8, xs, w8, ws, b, torch.bfloat16), repeats)
        fp8_err = rel_error(scaled_linear_fp8(*quantize(x[:1024]), w8, ws, b, torch.bfloat16), want)
        rows.append({"piece": "linear", "name": f"{name} ({k} -> {n})", "bf16_ms": bf16_ms,
                     "bf16_tflops": flops / bf16_ms / 1e9, "bf16_error": rel_error(F.linear(x[:1024], w, b), want),
                     "fp8_quantize_ms": quant_ms, "fp8_mm_ms": mm_ms, "fp8_tflops": flops / mm_ms / 1e9,
                     "fp8_error": fp8_err, "speedup_with_quantize": bf16_ms / (quant_ms + mm_ms)})
    return rows


# ------------------------------------------------------------------------------------------- forward profiles
def kernel_time_by_kind(fn: Callable[[], Any]) -> dict[str, float]:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for a in prof.key_averages():
        if is_kernel(a) and a.self_device_time_total > 0:
            kind = kernel_kind(a.key)
            totals[kind] = totals.get(kind, 0.0) + a.self_device_time_total / 1e3
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def forward_profiles(duration: int, overrides: list[str]) -> list[dict[str, Any]]:
    try:  # python -m benchmarks.backbone_kernels, or a test
        from benchmarks import diffusers_yardstick, model_step
    except ImportError:  # python benchmarks/backbone_kernels.py: this script's folder is first on sys.path
        import diffusers_yardstick
        import model_step

    args = model_step.parse_args(["--durations", str(duration), "--set", "model.use_ttt=false",
                                  *(a for o in overrides for a in ("--set", o))])
    cfg = model_step.bench_config(args)
    device = torch.device("cuda")
    model, _, _ = model_step.build(cfg, device)
    model.eval()
    layout = VideoLayout.from_config(cfg.layout, cfg.ttt, duration)
    batch = model_step.random_batch(model, layout, torch.bfloat16, device)
    timestep = torch.full((1,), 500, dtype=torch.long, device=device)
    target = torch.randn_like(batch["latents"], dtype=torch.float32)
    rows = []
    with torch.no_grad():
        ours = kernel_time_by_kind(lambda: model(batch["latents"], batch["text"], timestep, layout))
    rows.append({"piece": "forward", "name": "ours, TTT off", "tokens": layout.total_tokens, "by_kind_ms": ours})
    model.train()

    def our_step() -> None:
        F.mse_loss(model(batch["latents"], batch["text"], timestep, layout).float(), target).backward()
        model.zero_grad(set_to_none=True)

    rows.append({"piece": "training step", "name": "ours, TTT off", "overrides": overrides,
                 "by_kind_ms": kernel_time_by_kind(our_step)})
    spec = model.spec
    model = None  # frees it (our_step's closure shares this name)
    torch.cuda.empty_cache()
    theirs = diffusers_yardstick.build(spec, torch.bfloat16, device, "qkvo").eval()
    kwargs = diffusers_yardstick.inputs(theirs, batch["latents"], batch["text"])
    with torch.no_grad():
        their_forward = kernel_time_by_kind(lambda: theirs(**kwargs))
    rows.append({"piece": "forward", "name": "diffusers", "by_kind_ms": their_forward})
    theirs.train()
    theirs.enable_gradient_checkpointing()

    def their_step() -> None:
        F.mse_loss(theirs(**kwargs)[0].float(), target).backward()
        theirs.zero_grad(set_to_none=True)

    rows.append({"piece": "training step", "name": "diffusers", "by_kind_ms": kernel_time_by_kind(their_step)})
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\n| attention | forward ms | TFLOP/s | fwd+bwd ms | TFLOP/s | rel. error vs fp32 |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
        if r["piece"] == "attention":
            if "error_message" in r:
                print(f"| {r['name']} | {r['error_message']} | | | | |")
                continue
            nan = float("nan")
            print(f"| {r['name']} | {r['forward_ms']:.2f} | {r['forward_tflops']:.0f} | "
                  f"{r.get('forward_backward_ms', nan):.2f} | {r.get('forward_backward_tflops', nan):.0f} | "
                  f"{r['error']:.2e} |")
    print("\n| GEMM | bf16 ms | TFLOP/s | fp8 quantise + mm ms | fp8 TFLOP/s (mm) | speed-up | error bf16 / fp8 |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows:
        if r["piece"] == "linear":
            print(f"| {r['name']} | {r['bf16_ms']:.3f} | {r['bf16_tflops']:.0f} | {r['fp8_quantize_ms']:.3f} + "
                  f"{r['fp8_mm_ms']:.3f} | {r['fp8_tflops']:.0f} | {r['speedup_with_quantize']:.2f}x | "
                  f"{r['bf16_error']:.1e} / {r['fp8_error']:.1e} |")
    for r in rows:
        if r["piece"] in ("forward", "training step"):
            total = sum(r["by_kind_ms"].values())
            print(f"\n{r['name']}: {r['piece']} kernel time {total:.1f} ms: " +
                  ", ".join(f"{k} {v:.1f}" for k, v in r["by_kind_ms"].items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--skip", default="", help="comma list of attention,linear,forward to leave out")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override for the forward")
    ap.add_argument("--commit", default=git_commit())
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("backbone_kernels.py times CUDA kernels: no CUDA device here", file=sys.stderr)
        return 2
    skip = set(filter(None, args.skip.split(",")))
    try:
        from benchmarks import model_step
    except ImportError:  # run as a script
        import model_step

    spec = get_preset("cogvideox-5b")
    cfg = model_step.bench_config(model_step.parse_args(["--durations", str(args.duration)]))
    tokens = VideoLayout.from_config(cfg.layout, cfg.ttt, args.duration).total_tokens
    rows: list[dict[str, Any]] = []
    if "attention" not in skip:
        rows += attention_rows(tokens, spec.num_attention_heads, spec.attention_head_dim, args.repeats)
    if "linear" not in skip:
        rows += linear_rows(tokens, spec.dim, args.repeats)
    if "forward" not in skip:
        rows += forward_profiles(args.duration, args.overrides)
    print_table(rows)
    if args.out:
        result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "git_commit": args.commit,
                  "python": platform.python_version(), "duration_s": args.duration, "tokens": tokens, "rows": rows}
        save_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
