"""One training step of CogVideoX-5B + TTT-MLP at full size: time, memory, parameters, MFU.

The model is the trainer's: `build_model` of a Config (random initialisation built on the meta device and
materialised directly on the device; the `qkvo` adapter; whole-block activation checkpointing plus the TTT scan
checkpointing, which is what fits 80 GB), and the step is the trainer's `TrainStep` on random bf16 latents and text
features of one micro-batch (`train.batch_size` clips: 1, or N with --set train.batch_size=N, the FLOPs counting all
N) with the diffusion objective: forward + backward by default, and the AdamW step as well with --optimizer-step.
The model computes in its own dtype (model.dtype, bf16), without autocast (train.precision fp32).
For 3 s (18,048 tokens) and 9 s (51,456 tokens) it prints the median step time, peak allocated / reserved memory
and model FLOPs utilisation with the FLOP count split into dense matmuls (6 x per-token params x tokens), attention
(the local windows) and the TTT scan; recomputation is not counted (model FLOPs, not hardware FLOPs).

With --forward it also times the inference forward of the same model on the same inputs (no grad, eval mode:
`forward_s`). --yardstick diffusers implies --forward and, after each duration, times diffusers'
CogVideoXTransformer3DModel of the same preset in the same process, on the same latents and one segment's text
(benchmarks/diffusers_yardstick.py: its forward and a forward + backward with every block checkpointed), stores it
under the row's `yardstick` and prints the ratios diffusers time / ours. At 3 s both see the same tokens; at longer
durations diffusers attends over all frames at once (the row's `yardstick.note`). One process only.

Under torchrun the step is the trainer's multi-process one (`tttvideo.train.distributed.TrainRanks`): the model
sharded with FSDP2 over the `[parallel]` mesh, Ulysses sequence parallelism of degree parallel.sp, each data-parallel
rank on its own sample; every rank reports its peak memory and rank 0 writes the result. Results go to
benchmarks/results/model_step*.json. Run it from the repository root with the package importable:

    PYTHONPATH=src python3 benchmarks/model_step.py                    # the GPU run
    PYTHONPATH=src torchrun --nproc_per_node 2 benchmarks/model_step.py --set parallel.sp=2   # two GPUs
    PYTHONPATH=src python3 benchmarks/model_step.py --preset tiny --device cpu --dtype fp32 --height 64 --width 96 \
        --text-tokens 8 --durations 3 --steps 1 --out /tmp/x.json     # a CPU smoke run of the same code
    PYTHONPATH=src python3 benchmarks/model_step.py --yardstick diffusers --set model.use_ttt=false --durations 3 \
        --out benchmarks/results/model_step_yardstick.json            # the backbone against diffusers'
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from tttvideo.config.loader import config_to_dict, load_config
from tttvideo.config.schema import Config
from tttvideo.dtypes import torch_dtype
from tttvideo.layout import VideoLayout
from tttvideo.memory.guard.cap import apply_memory_cap
from tttvideo.memory.profile.profiler import git_commit
from tttvideo.models import CogVideoXTTT, build_model, trainable_summary
from tttvideo.models.backbone import get_preset
from tttvideo.results import save_json
from tttvideo.train.distributed import TrainRanks, rank_device
from tttvideo.train.loss import NoiseSource
from tttvideo.train.step import TrainStep, build_train_step
from tttvideo.ttt import ops

# Dense bf16 tensor-core peak of an H100 SXM / H200 (datasheet, no sparsity).
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12}
DTYPES = ("bf16", "fp32")
ADAPTER = "qkvo"


# ------------------------------------------------------------------------------------------------------- FLOPs
def per_token_params(model: CogVideoXTTT) -> dict[str, int]:
    """Weights applied to every token (the adaLN linears act once per sample on the timestep: left out)."""
    blocks = 0
    # frozen weights stored in fp8 are buffers (weight_fp8), not parameters: they count as the weights they stand for
    weights = [*model.blocks.named_parameters(), *((n, b) for n, b in model.blocks.named_buffers()
                                                   if n.endswith("weight_fp8"))]
    for name, p in weights:
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


def model_flops(model: CogVideoXTTT, layout: VideoLayout) -> dict[str, float]:
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
        # seven b x D x E GEMMs per mini-batch and head (229 kFLOP per token-head for D 64, E 256)
        per_token_head = 14 * D * E if model.ttt_config.kind == "mlp" else 8 * D * D
        ttt = 3 * 2 * per_token_head * spec.num_attention_heads * layout.ttt_tokens * spec.num_layers
    return {"dense": float(dense), "attention": float(attention), "ttt": float(ttt),
            "total": float(dense + attention + ttt)}


# ------------------------------------------------------------------------------------------------------- setup
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cogvideox-5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=DTYPES)
    ap.add_argument("--durations", type=int, nargs="+", default=[3, 9])
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=720)
    ap.add_argument("--text-tokens", type=int, default=0, help="0: the original's length per duration")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--block-group", type=int, default=1, help="blocks per activation checkpoint (0: none)")
    ap.add_argument("--scan-group", type=int, default=16, help="TTT scan checkpoint group (mini-batches)")
    ap.add_argument("--ttt-backend", default="auto", choices=list(ops.BACKENDS))
    ap.add_argument("--optimizer-step", action="store_true", help="time the AdamW step too (unscale, clip, step)")
    ap.add_argument("--forward", action="store_true", help="time the inference forward too (no grad)")
    ap.add_argument("--yardstick", choices=["diffusers"], default=None,
                    help="also time diffusers' CogVideoXTransformer3DModel at the same shape (implies --forward)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="any other config key, applied last (as tttv's --set)")
    ap.add_argument("--budget-s", type=float, default=480, help="stop timing new steps after this many seconds")
    ap.add_argument("--commit", default=git_commit())
    ap.add_argument("--out", default="benchmarks/results/model_step.json")
    args = ap.parse_args(argv)
    if args.yardstick and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        ap.error("--yardstick runs in one process: the yardstick is a single-GPU model")
    args.forward = args.forward or args.yardstick is not None
    return args


def bench_config(args: argparse.Namespace) -> Config:
    """The Config of the benchmarked model and step: the schema's defaults with the flags' settings."""
    block = args.block_group > 0
    return load_config(None, [
        f"model.preset={args.preset}", 'model.pretrained_path=""', f"model.dtype={args.dtype}",
        f"model.adapter={ADAPTER}", "model.use_ttt=true",
        "ttt.kind=mlp", "ttt.mini_batch_size=64", "ttt.base_lr=0.1",
        f"ttt.scan_checkpoint_group_size={args.scan_group}", f"ttt.backend={args.ttt_backend}",
        f"checkpointing.block={str(block).lower()}", f"checkpointing.group_size={max(args.block_group, 1)}",
        f"layout.height={args.height}", f"layout.width={args.width}", f"layout.text_tokens={args.text_tokens}",
        # no autocast: the weights' dtype (model.dtype) is the compute dtype
        "train.precision=fp32", "train.batch_size=1",
        *args.overrides,
    ])


def count_reference_calls() -> list[int]:
    """A counter of calls that reach the PyTorch reference TTT scan through ops.py: which scan ran."""
    calls = [0]
    ref = ops.ttt_mlp_reference

    def counted_reference(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        return ref(*a, **k)

    ops.ttt_mlp_reference = counted_reference
    return calls


def build(cfg: Config, device: torch.device) -> tuple[CogVideoXTTT, float, dict[str, Any]]:
    """The model of `cfg`, the seconds its build took, and its parameter counts."""
    torch.manual_seed(0)
    start = time.perf_counter()
    model = build_model(cfg, device)
    build_s = time.perf_counter() - start
    groups = {r["group"]: r for r in trainable_summary(model)}
    params = {
        "total": groups["total"]["params"],
        "trainable": groups["total"]["trainable"],
        "ttt": groups.get("ttt", {}).get("params", 0) + groups.get("gates", {}).get("params", 0),
        "per_group": groups,
        "per_token_matmul": per_token_params(model),
    }
    return model, build_s, params


def make_step(cfg: Config, model: CogVideoXTTT, device: torch.device, layout: VideoLayout,
              ranks: TrainRanks) -> TrainStep:
    """The trainer's step for `layout` (`build_train_step`: the config's memory techniques, its objective, AdamW
    groups, scaler and clipping), one micro-batch per data-parallel rank."""
    train = cfg.train
    return build_train_step(cfg, model, device, layout, NoiseSource(train.seed, device),
                            global_batch=train.batch_size * ranks.dp_size, ranks=ranks)


# ------------------------------------------------------------------------------------------------------ timing
def random_batch(model: CogVideoXTTT, layout: VideoLayout, dtype: torch.dtype,
                 device: torch.device, samples: int = 1) -> dict[str, torch.Tensor]:
    """A micro-batch of `samples` random clips (`train.batch_size` of them for a training step)."""
    g = torch.Generator(device=device).manual_seed(0)
    latents = torch.randn(samples, layout.latent_frames, model.spec.in_channels, layout.latent_height,
                          layout.latent_width, generator=g, device=device, dtype=dtype)
    text = torch.randn(samples, layout.num_segments, layout.text_tokens, model.spec.text_embed_dim, generator=g,
                       device=device, dtype=dtype)
    return {"latents": latents, "text": text}


def timed(call: Callable[[int], None], prepare: Callable[[], None], args: argparse.Namespace, device: torch.device,
          deadline: float, ranks: TrainRanks) -> tuple[list[float], list[float]]:
    """(warm-up seconds, timed seconds) of call(i) for --warmup then --steps calls, `prepare()` before each one
    untimed; the peak memory statistics are reset between the warm-up and the timed calls."""

    def once(i: int) -> float:
        prepare()
        sync(device)
        start = time.perf_counter()
        call(i)
        sync(device)
        return time.perf_counter() - start

    warm = [once(i) for i in range(args.warmup)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times: list[float] = []
    while len(times) < args.steps:
        # stay inside the device call's limit; report what was measured (all ranks stop after the same step)
        if times and ranks.largest(int(time.perf_counter() + max(times) > deadline)):
            break
        times.append(once(args.warmup + len(times)))
    return warm, times


def time_forward(model: CogVideoXTTT, batch: dict[str, torch.Tensor], layout: VideoLayout,
                 args: argparse.Namespace, device: torch.device, deadline: float, ranks: TrainRanks) -> dict[str, Any]:
    """The inference forward of `model` on the step's inputs (no grad, eval mode; the yardstick's timestep)."""
    timestep = torch.full((batch["latents"].shape[0],), 500, dtype=torch.long, device=device)
    training = model.training
    model.eval()
    with torch.no_grad():
        warm, times = timed(lambda i: model(batch["latents"], batch["text"], timestep, layout, sp=ranks.sequence),
                            lambda: None, args, device, deadline, ranks)
    model.train(training)
    row: dict[str, Any] = {"forward_s": statistics.median(times), "forward_steps_s": times, "forward_warmup_s": warm,
                           "latents_shape": list(batch["latents"].shape), "text_shape": list(batch["text"].shape)}
    if device.type == "cuda":
        row["peak_forward_allocated_gib"] = max(every_rank(ranks, torch.cuda.max_memory_allocated() / 2**30))
    return row


def run_case(cfg: Config, model: CogVideoXTTT, layout: VideoLayout, args: argparse.Namespace, device: torch.device,
             deadline: float, ranks: TrainRanks) -> dict[str, Any]:
    dtype = torch_dtype(cfg.model.dtype)
    # the same on every rank: an sp group shares its samples
    batch = random_batch(model, layout, dtype, device, cfg.train.batch_size)
    forward = time_forward(model, batch, layout, args, device, deadline, ranks) if args.forward else {}
    train_step = make_step(cfg, model, device, layout, ranks)

    def step(i: int) -> None:
        if args.optimizer_step:
            train_step(iter((batch,)), i)
        else:
            train_step.gradients(iter((batch,)), i)

    # freeing the last step's gradients is not timed
    warm, times = timed(step, lambda: train_step.optimizer.zero_grad(set_to_none=True), args, device, deadline, ranks)
    train_step.optimizer.zero_grad(set_to_none=True)
    flops = {k: v * cfg.train.batch_size for k, v in model_flops(model, layout).items()}  # per micro-batch
    median = statistics.median(times)
    peak = PEAK_BF16.get(next((k for k in PEAK_BF16 if k in device_name(device)), ""), None)
    row = {
        "duration_s": layout.duration_s,
        "gpus": ranks.world_size,
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
        **forward,
    }
    if ranks.distributed:  # every data-parallel rank trains its own sample
        row["achieved_tflops"] *= ranks.dp_size
        row["tflops_per_gpu"] = row["achieved_tflops"] / ranks.world_size
        if row["mfu"] is not None:  # utilisation of each GPU, whatever the layout
            row["mfu"] = row["tflops_per_gpu"] * 1e12 / peak
    if device.type == "cuda":
        allocated = every_rank(ranks, torch.cuda.max_memory_allocated() / 2**30)
        reserved = every_rank(ranks, torch.cuda.max_memory_reserved() / 2**30)
        row["peak_allocated_gib"], row["peak_reserved_gib"] = max(allocated), max(reserved)
        if ranks.distributed:
            row["peak_allocated_gib_per_rank"], row["peak_reserved_gib_per_rank"] = allocated, reserved
    # the process's peak resident host memory so far (offloaded activations live there)
    row["peak_host_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if train_step.offload:
        row["offloaded_gib"] = train_step.offloaded_bytes / 2**30
        row["offload_kept_on_gpu_gib"] = train_step.kept_bytes / 2**30
    return row


def every_rank(ranks: TrainRanks, value: float) -> list[float]:
    """`value` of every rank, in rank order."""
    if not ranks.distributed:
        return [value]
    import torch.distributed as dist

    values: list[float] = [0.0] * ranks.world_size
    dist.all_gather_object(values, value)
    return values


def run_duration(cfg: Config, model: CogVideoXTTT, layout: VideoLayout, args: argparse.Namespace,
                 device: torch.device, deadline: float, ranks: TrainRanks) -> tuple[dict[str, Any], str | None]:
    """One duration's row, falling back to the reference TTT scan when the configured fast path fails; returns
    (row, the fast path's failure or None)."""
    failure = None
    try:
        return run_case(cfg, model, layout, args, device, deadline, ranks), None
    except torch.cuda.OutOfMemoryError as e:
        return {"duration_s": layout.duration_s, "tokens": layout.total_tokens,
                "error": f"OOM: {str(e).splitlines()[0]}"}, None
    except Exception as e:  # noqa: BLE001 - a failing fast path must not cost the whole device run
        if cfg.ttt.backend == "reference" or ranks.distributed:  # ranks cannot agree on a retry after a failure
            raise
        failure = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    # outside the except block, so that the traceback (and the graph it holds) is gone
    print(f"TTT backend {cfg.ttt.backend} failed ({failure}); rerunning with the reference", flush=True)
    for m in model.ttt_modules():
        m.ttt.backend = "reference"
    cfg.ttt.backend = "reference"
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return run_case(cfg, model, layout, args, device, deadline, ranks), failure


def run_durations(cfg: Config, model: CogVideoXTTT, args: argparse.Namespace, device: torch.device,
                  deadline: float, reference_calls: list[int], ranks: TrainRanks) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    last_step, last_tokens = 0.0, 1
    for duration in args.durations:
        layout = VideoLayout.from_config(cfg.layout, cfg.ttt, duration)
        reference_calls[0] = 0
        remaining = ranks.broadcast(deadline - time.perf_counter())  # rank 0's clock decides for all
        estimate = last_step * layout.total_tokens / last_tokens if last_step else 0.0
        if estimate > remaining:
            rows.append({"duration_s": duration, "tokens": layout.total_tokens,
                         "error": f"skipped: one step would take about {estimate:.0f} s, {remaining:.0f} s left"})
            print(rows[-1], flush=True)
            continue
        if estimate and (args.warmup + 1) * estimate > remaining:
            args.warmup, args.steps = 0, 1  # one unwarmed step is all the time allows
        row, failure = run_duration(cfg, model, layout, args, device, deadline, ranks)
        if "median_step_s" in row:
            last_step, last_tokens = row["median_step_s"], layout.total_tokens
        row["unwarmed"] = args.warmup == 0
        row["ttt_scan_checkpoint_group_size"] = cfg.ttt.scan_checkpoint_group_size
        row["ttt_backend"] = "reference" if reference_calls[0] else f"triton ({cfg.ttt.backend})"
        if failure:
            row["fast_path_failure"] = failure
        if args.yardstick:
            row["yardstick"] = run_yardstick(cfg, model, layout, row, args, device, deadline, ranks)
        rows.append(row)
        if ranks.is_main:
            print(json.dumps({k: v for k, v in row.items() if k not in ("layout",)}), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def yardstick_module() -> Any:
    """benchmarks/diffusers_yardstick.py, imported only with --yardstick (it imports diffusers)."""
    try:  # python -m benchmarks.model_step, or a test
        from benchmarks import diffusers_yardstick
    except ImportError:  # python benchmarks/model_step.py: this script's folder is first on sys.path
        import diffusers_yardstick

    return diffusers_yardstick


def run_yardstick(cfg: Config, model: CogVideoXTTT, layout: VideoLayout, row: dict[str, Any],
                  args: argparse.Namespace, device: torch.device, deadline: float,
                  ranks: TrainRanks) -> dict[str, Any]:
    """diffusers' transformer of the same preset on the inputs our model got in `row`'s case, timed by the same
    loop, with the ratios diffusers time / ours; an OOM is the yardstick's error."""
    yardstick = yardstick_module()
    # seeded: the case's own inputs
    batch = random_batch(model, layout, torch_dtype(cfg.model.dtype), device, cfg.train.batch_size)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    error = None
    try:
        result = yardstick.run(model.spec, layout, batch, cfg.model.adapter,
                               lambda call, prepare: timed(call, prepare, args, device, deadline, ranks))
    except torch.cuda.OutOfMemoryError as e:
        error = f"OOM: {str(e).splitlines()[0]}"
    # outside the except block, so that a traceback (and the model it holds) is gone too: free it before the next case
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if error is not None:
        return {"name": yardstick.NAME, "version": yardstick.diffusers.__version__, "error": error}
    result["vs_ours"] = {
        "forward": result["forward_s"] / row["forward_s"] if "forward_s" in row else None,
        "train_step": result["train_step_s"] / row["median_step_s"] if "median_step_s" in row else None,
        "ours_includes_optimizer_step": args.optimizer_step,
    }
    return result


# ------------------------------------------------------------------------------------------------------ output
def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def card_tag(device: torch.device) -> str:
    """The results file's card: the planner's cost-table name of the GPU ('h100'), or 'cpu'."""
    from tttvideo.memory.plan.costs import gpu_kind

    return gpu_kind(device_name(device)) if device.type == "cuda" else "cpu"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def print_table(result: dict[str, Any], cfg: Config) -> None:
    ck = result["checkpointing"]
    print(f"\n{result['device']}, torch {result['torch']}, {cfg.model.preset} + TTT-MLP, "
          f"bf16={cfg.model.dtype == 'bf16'}, batch 1, {cfg.model.adapter}, block checkpoint group "
          f"{ck['block_group_size']}, scan group {ck['ttt_scan_checkpoint_group_size']}, "
          f"optimizer step {result['optimizer_step']}, {result['switches']}")
    print(f"{'dur':>4} {'tokens':>7} {'step s':>8} {'alloc GiB':>9} {'resv GiB':>9} {'host GiB':>8} {'dense TF':>9} "
          f"{'attn TF':>8} {'TTT TF':>8} {'TFLOP/s':>8} {'MFU':>6}  backend")
    for r in result["results"]:
        if "error" in r:
            print(f"{r['duration_s']:>3}s {r['tokens']:>7}  {r['error']}")
            continue
        f = r["flops"]
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        print(f"{r['duration_s']:>3}s {r['tokens']:>7} {r['median_step_s']:>8.2f} "
              f"{r.get('peak_allocated_gib', 0):>9.1f} {r.get('peak_reserved_gib', 0):>9.1f} "
              f"{r.get('peak_host_gib', 0):>8.1f} {f['dense'] / 1e12:>9.1f} {f['attention'] / 1e12:>8.1f} "
              f"{f['ttt'] / 1e12:>8.1f} {r['achieved_tflops']:>8.1f} {mfu:>6}  {r['ttt_backend']}")


def print_yardstick(result: dict[str, Any], cfg: Config) -> None:
    """Ours against the yardstick per duration: times and the ratios diffusers time / ours (> 1: ours is faster)."""
    rows = [r for r in result["results"] if "yardstick" in r]
    if not rows:
        return
    first = rows[0]["yardstick"]
    adamw = "includes" if result["optimizer_step"] else "excludes"
    print(f"\nours ({cfg.model.preset}, TTT {'on' if cfg.model.use_ttt else 'off'}) against {first['name']} "
          f"{first['version']}; ratio = diffusers time / ours (> 1: ours faster); our step {adamw} the AdamW step")
    print(f"{'dur':>4} {'tokens':>7} {'fwd s':>8} {'diff fwd':>8} {'ratio':>6} {'step s':>8} {'diff step':>9} "
          f"{'ratio':>6} {'diff GiB fwd/step':>17}")

    def num(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    notes = []
    for r in rows:
        y = r["yardstick"]
        if "error" in y:
            print(f"{r['duration_s']:>3}s {r['tokens']:>7}  diffusers: {y['error']}")
            continue
        ratio = y["vs_ours"]
        memory = f"{num(y['peak_forward_allocated_gib'], '.1f')}/{num(y['peak_train_allocated_gib'], '.1f')}"
        print(f"{r['duration_s']:>3}s {r['tokens']:>7} {num(r.get('forward_s'), '.3f'):>8} {y['forward_s']:>8.3f} "
              f"{num(ratio['forward'], '.2f'):>6} {num(r.get('median_step_s'), '.3f'):>8} {y['train_step_s']:>9.3f} "
              f"{num(ratio['train_step'], '.2f'):>6} {memory:>17}")
        notes.append(f"  {r['duration_s']} s: {y['note']}")
    print("\n".join(notes))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = time.perf_counter() + args.budget_s
    device = rank_device(torch.device(args.device))
    if device.index is not None:  # under torchrun: this rank's GPU
        torch.cuda.set_device(device)
    cfg = bench_config(args)
    capped = apply_memory_cap(cfg.memory, device)  # memory.max_gpu_gib: rehearse a smaller card
    ranks = TrainRanks.start(cfg, get_preset(cfg.model.preset).num_attention_heads, device)
    reference_calls = count_reference_calls()
    model, build_s, params = build(cfg, device)
    ranks.shard(model, None)  # the weights' dtype is the compute dtype (no autocast)
    if ranks.is_main:
        print(f"{device_name(device)} x {ranks.world_size}: {cfg.model.preset} built in {build_s:.1f} s, "
              f"{params['total'] / 1e9:.3f} B params (TTT {params['ttt'] / 1e9:.3f} B, trainable "
              f"{params['trainable'] / 1e9:.3f} B)", flush=True)
    rows = run_durations(cfg, model, args, device, deadline, reference_calls, ranks)
    if not ranks.is_main:
        ranks.close()
        return 0
    result = {
        "benchmark": "model_step",
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cuda": torch.version.cuda,
        "git_commit": args.commit,
        "gpus": ranks.world_size,
        "parallel": dataclasses.asdict(ranks.plan.degrees),
        "preset": cfg.model.preset,
        "dtype": cfg.model.dtype,
        "batch": cfg.train.batch_size,
        "adapter": cfg.model.adapter,
        "checkpointing": {"block_group_size": cfg.checkpointing.group_size if cfg.checkpointing.block else 0,
                          "ttt_scan_checkpoint_group_size": cfg.ttt.scan_checkpoint_group_size},
        "optimizer_step": args.optimizer_step,
        "memory_cap_fraction": capped,
        "switches": {"frozen_weights": cfg.model.frozen_weights, "optimizer": cfg.train.optimizer,
                     "offload_activations": cfg.checkpointing.offload_activations,
                     "max_gpu_gib": cfg.memory.max_gpu_gib},
        "objective": "diffusion_loss: v-prediction MSE on the ZeroSNR schedule, as the trainer's",
        "flops_convention": "model FLOPs: dense 6 x per-token matmul params x tokens (all weights, also frozen ones); "
                            "attention 3 x 4 x windows x W^2 x C per layer; TTT-MLP 3 x 2 directions x 14 D E per "
                            "token-head; recomputation and the optimizer step not counted",
        "params": params,
        "build_s": build_s,
        "config": config_to_dict(cfg),
        "results": rows,
    }
    save_json(args.out, result)
    print_table(result, cfg)
    print_yardstick(result, cfg)
    ranks.close()
    return 0


def _version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
