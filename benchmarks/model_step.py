"""One training step (forward + backward) of CogVideoX-5B + TTT-MLP at full size: time, memory, parameters, MFU.

Random initialisation built on the meta device and materialised directly on the GPU in bf16; batch 1; the `qkvo`
adapter (SPEC section 4); whole-block activation checkpointing plus the TTT scan checkpointing, which is what fits
80 GB. For 3 s (18,048 tokens) and 9 s (51,456 tokens) it prints the median step time, peak allocated / reserved
memory and model FLOPs utilisation with the FLOP count split into dense matmuls (6 x per-token params x tokens),
attention (the local windows) and the TTT scan; recomputation is not counted (model FLOPs, not hardware FLOPs).
No optimizer step. Results go to benchmarks/results/model_step*.json.

    python benchmarks/model_step.py                                   # the GPU run
    python benchmarks/model_step.py --preset tiny --device cpu --dtype fp32 --height 64 --width 96 \
        --text-tokens 8 --durations 3 --steps 1 --out /tmp/x.json    # a CPU smoke run of the same code
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tttvideo.config.schema import CheckpointingConfig, TTTConfig  # noqa: E402
from tttvideo.layout import VideoLayout  # noqa: E402
from tttvideo.models import apply_adapter, apply_checkpointing, get_preset, init_model, trainable_summary  # noqa: E402
from tttvideo.ttt import ops  # noqa: E402

# Dense bf16 tensor-core peak of an H100 SXM / H200 (datasheet, no sparsity).
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def per_token_params(model) -> dict[str, int]:
    """Weights applied to every token (the adaLN linears act once per sample on the timestep: left out)."""
    blocks = 0
    for name, p in model.blocks.named_parameters():
        if p.dim() < 2 or ".norm1." in f".{name}" or ".norm2." in f".{name}":
            continue  # biases, norms, gates, modulation
        if name.endswith(("W1", "W2")):
            continue  # TTT inner weights: counted by the scan's own FLOPs
        blocks += p.numel()  # attention q/k/v/o, MLP, TTT wq/wk/wv/wo and the eta gate weight
    return {
        "blocks": blocks,
        "text": model.embed.text.weight.numel(),
        "video": model.embed.patch.weight.numel() + model.proj_out.weight.numel(),
    }


def model_flops(model, layout: VideoLayout) -> dict[str, float]:
    """Model FLOPs of one forward + backward (backward = 2 x forward)."""
    spec = model.spec
    tok = per_token_params(model)
    dense = 6 * (tok["blocks"] * layout.total_tokens + tok["text"] * layout.total_text_tokens
                 + tok["video"] * layout.video_tokens)
    # QK^T and PV of every window: 4 W^2 C forward per window per layer
    attention = 3 * 4 * layout.num_segments * layout.window_tokens**2 * spec.dim * spec.num_layers
    ttt = 0.0
    if model.use_ttt:
        D = spec.attention_head_dim
        E = model.blocks[0].ttt.ttt.W1.shape[-1]
        # seven b x D x E GEMMs per mini-batch and head (SPEC section 3: 229 kFLOP per token-head for D 64, E 256)
        per_token_head = 14 * D * E if model.ttt_config.kind == "mlp" else 8 * D * D
        ttt = 3 * 2 * per_token_head * spec.num_attention_heads * layout.ttt_tokens * spec.num_layers
    return {"dense": float(dense), "attention": float(attention), "ttt": float(ttt),
            "total": float(dense + attention + ttt)}


def run_case(model, layout: VideoLayout, args, device, dtype, deadline: float) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    latents = torch.randn(1, layout.latent_frames, model.spec.in_channels, layout.latent_height, layout.latent_width,
                          generator=g, device=device, dtype=dtype)
    text = torch.randn(1, layout.num_segments, layout.text_tokens, model.spec.text_embed_dim, generator=g,
                       device=device, dtype=dtype)
    target = torch.randn(latents.shape, generator=g, device=device, dtype=dtype)
    t = torch.tensor([500.0], device=device)

    def step() -> float:
        model.zero_grad(set_to_none=True)
        sync()
        start = time.perf_counter()
        out = model(latents, text, t, layout)
        loss = (out.float() - target.float()).square().mean()
        loss.backward()
        sync()
        return time.perf_counter() - start

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    warm = [step() for _ in range(args.warmup)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        if times and time.perf_counter() + max(times) > deadline:
            break  # stay inside the device call's limit; report what was measured
        times.append(step())
    flops = model_flops(model, layout)
    median = statistics.median(times)
    peak = PEAK_BF16.get(next((k for k in PEAK_BF16 if k in device_name(device)), ""), None)
    row = {
        "duration_s": layout.duration_s,
        "tokens": layout.total_tokens,
        "ttt_tokens": layout.ttt_tokens,
        "layout": layout.summary(),
        "warmup_s": warm,
        "step_s": times,
        "median_step_s": median,
        "flops": flops,
        "achieved_tflops": flops["total"] / median / 1e12,
        "mfu": flops["total"] / median / peak if peak and dtype == torch.bfloat16 else None,
        "peak_flops_assumed": peak,
    }
    if device.type == "cuda":
        row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    del latents, text, target
    return row


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cogvideox-5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--durations", type=int, nargs="+", default=[3, 9])
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=720)
    ap.add_argument("--text-tokens", type=int, default=0, help="0: the original's length per duration")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--block-group", type=int, default=1, help="blocks per activation checkpoint (0: none)")
    ap.add_argument("--scan-group", type=int, default=16, help="TTT scan checkpoint group (mini-batches)")
    ap.add_argument("--ttt-backend", default="auto", choices=list(ops.BACKENDS))
    ap.add_argument("--budget-s", type=float, default=480, help="stop timing new steps after this many seconds")
    ap.add_argument("--commit", default=os.environ.get("GIT_COMMIT", "unknown"))
    ap.add_argument("--out", default="benchmarks/results/model_step.json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    deadline = t0 + args.budget_s
    device, dtype = torch.device(args.device), DTYPES[args.dtype]

    # which TTT scan ran: count calls that reach the PyTorch reference through ops.py
    reference_calls = [0]
    ref = ops.ttt_mlp_reference

    def counted_reference(*a, **k):
        reference_calls[0] += 1
        return ref(*a, **k)

    ops.ttt_mlp_reference = counted_reference

    spec = get_preset(args.preset)
    ttt_cfg = TTTConfig(kind="mlp", mini_batch_size=64, base_lr=0.1, scan_checkpoint_group_size=args.scan_group,
                        backend=args.ttt_backend)
    torch.manual_seed(0)
    build_start = time.perf_counter()
    model = init_model(spec, ttt_cfg, use_ttt=True, dtype=dtype, device=device)
    build_s = time.perf_counter() - build_start
    apply_adapter(model, "qkvo")
    ckpt = CheckpointingConfig(block=args.block_group > 0, group_size=max(args.block_group, 1))
    apply_checkpointing(model, ckpt)
    groups = {r["group"]: r for r in trainable_summary(model)}
    params = {
        "total": groups["total"]["params"],
        "trainable": groups["total"]["trainable"],
        "ttt": groups.get("ttt", {}).get("params", 0) + groups.get("gates", {}).get("params", 0),
        "per_group": groups,
        "per_token_matmul": per_token_params(model),
    }
    print(f"{device_name(device)}: {args.preset} built in {build_s:.1f} s, {params['total'] / 1e9:.3f} B params "
          f"(TTT {params['ttt'] / 1e9:.3f} B, trainable {params['trainable'] / 1e9:.3f} B)", flush=True)

    rows = []
    last_step, last_tokens = 0.0, 1
    for duration in args.durations:
        layout = VideoLayout.create(duration, args.height, args.width, patch_size=spec.patch_size,
                                    text_tokens=args.text_tokens, mini_batch_size=64)
        reference_calls[0] = 0
        failure = None
        remaining = deadline - time.perf_counter()
        estimate = last_step * layout.total_tokens / last_tokens if last_step else 0.0
        if estimate > remaining:
            rows.append({"duration_s": duration, "tokens": layout.total_tokens,
                         "error": f"skipped: one step would take about {estimate:.0f} s, {remaining:.0f} s left"})
            print(rows[-1], flush=True)
            continue
        if estimate and (args.warmup + 1) * estimate > remaining:
            args.warmup, args.steps = 0, 1  # one unwarmed step is all the time allows
        try:
            row = run_case(model, layout, args, device, dtype, deadline)
        except torch.cuda.OutOfMemoryError as e:
            row = {"duration_s": duration, "tokens": layout.total_tokens, "error": f"OOM: {str(e).splitlines()[0]}"}
        except Exception as e:  # noqa: BLE001 - a failing fast path must not cost the whole device run
            if args.ttt_backend == "reference":
                raise
            failure = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            row = None
        if row is None:
            # outside the except block, so that the traceback (and the graph it holds) is gone
            print(f"TTT backend {args.ttt_backend} failed ({failure}); rerunning with the reference", flush=True)
            for m in model.ttt_modules():
                m.ttt.backend = "reference"
            args.ttt_backend = "reference"
            model.zero_grad(set_to_none=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            row = run_case(model, layout, args, device, dtype, deadline)
        if "median_step_s" in row:
            last_step, last_tokens = row["median_step_s"], layout.total_tokens
        row["unwarmed"] = args.warmup == 0
        row["ttt_scan_checkpoint_group_size"] = args.scan_group
        row["ttt_backend"] = "reference" if reference_calls[0] else f"triton ({args.ttt_backend})"
        if failure:
            row["fast_path_failure"] = failure
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("layout",)}), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    result = {
        "benchmark": "model_step",
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cuda": torch.version.cuda,
        "git_commit": args.commit,
        "preset": args.preset,
        "dtype": args.dtype,
        "batch": 1,
        "adapter": "qkvo",
        "checkpointing": {"block_group_size": args.block_group, "ttt_scan_checkpoint_group_size": args.scan_group},
        "optimizer_step": False,
        "flops_convention": "model FLOPs: dense 6 x per-token matmul params x tokens (all weights, also frozen ones); "
                            "attention 3 x 4 x windows x W^2 x C per layer; TTT-MLP 3 x 2 directions x 14 D E per "
                            "token-head; recomputation not counted",
        "params": params,
        "build_s": build_s,
        "results": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir, Path(args.out).name).write_text(json.dumps(result, indent=2))

    print(f"\n{result['device']}, torch {result['torch']}, {args.preset} + TTT-MLP, bf16={args.dtype == 'bf16'}, "
          f"batch 1, qkvo, block checkpoint group {args.block_group}, scan group {args.scan_group}")
    print(f"{'dur':>4} {'tokens':>7} {'step s':>8} {'alloc GiB':>9} {'resv GiB':>9} {'dense TF':>9} {'attn TF':>8} "
          f"{'TTT TF':>8} {'TFLOP/s':>8} {'MFU':>6}  backend")
    for r in rows:
        if "error" in r:
            print(f"{r['duration_s']:>3}s {r['tokens']:>7}  {r['error']}")
            continue
        f = r["flops"]
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        print(f"{r['duration_s']:>3}s {r['tokens']:>7} {r['median_step_s']:>8.2f} {r.get('peak_allocated_gib', 0):>9.1f} "
              f"{r.get('peak_reserved_gib', 0):>9.1f} {f['dense'] / 1e12:>9.1f} {f['attention'] / 1e12:>8.1f} "
              f"{f['ttt'] / 1e12:>8.1f} {r['achieved_tflops']:>8.1f} {mfu:>6}  {r['ttt_backend']}")
    return 0


def _version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
