"""One denoising step of CogVideoX-5B + TTT-MLP (random init, bf16) at 3 s, 9 s and 63 s, with and without TTT.

    PYTHONPATH=src python3 benchmarks/sample.py --out benchmarks/results/sample_h200.json

(PYTHONPATH=src is not needed where the package is installed.)

What one "step" is: one classifier-free-guided prediction at batch 1 (`tttvideo.sample.guidance.GuidedPrediction`,
the step `tttv sample` runs), i.e. the conditional and the unconditional prediction and the guidance arithmetic. By
default both go through ONE forward at batch 2 (`sample.cfg_batched`); when that does not fit, two forwards at
batch 1 (the JSON says which, per measurement). The solver update is negligible and not included.

The time is split with CUDA events recorded by forward hooks around every block's attention module
(`LocalAttention`: q/k/v/out projections, q/k norms, RoPE, window gather, SDPA, overlap average) and TTT module
(`BidirectionalTTT`: both passes, projections, gates, interleave); "rest" is the step minus those two (adaLN, MLP,
embeddings, output head).

63 s (351,168 tokens) is measured over the first `--timed-blocks` blocks of the full 42-block model (all 42 blocks'
weights resident, so weights and per-block activations, hence the peak, are those of the full model): the step time
is embeddings + head + those blocks, plus the mean block time for each block not run. Every block has the same
shapes and weights sizes, so this is exact up to run-to-run noise; at 9 s the same extrapolation is also computed and
compared with the full measurement (`extrapolation_check`).

"TTT off" is the same model with every block's TTT module moved to the CPU and detached: the local-attention-only
baseline (`model.use_ttt=false`), with its own (smaller) weight memory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from tttvideo.config.loader import load_config
from tttvideo.config.schema import Config
from tttvideo.layout import VideoLayout
from tttvideo.memory.profile.profiler import git_commit
from tttvideo.models import build_model
from tttvideo.results import save_json
from tttvideo.sample.guidance import GuidedPrediction


class ModuleTimer:
    """Sums the time spent inside modules of two kinds, with CUDA events (or wall clock on CPU)."""

    def __init__(self, model, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: dict[str, list] = {"attention": [], "ttt": [], "block": []}
        self.handles = []
        for block in model.blocks:
            for kind, module in (("attention", block.attn), ("ttt", block.ttt), ("block", block)):
                if module is not None:
                    self._hook(kind, module)

    def _stamp(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _hook(self, kind: str, module) -> None:
        starts = []

        def pre(mod, args):
            starts.append(self._stamp())

        def post(mod, args, out):
            self.pending[kind].append((starts.pop(), self._stamp()))

        self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def collect(self) -> dict[str, float]:
        """Seconds per kind since the last collect (call after synchronizing)."""
        out = {}
        for kind, pairs in self.pending.items():
            if self.cuda:
                out[kind] = sum(a.elapsed_time(b) for a, b in pairs) / 1000
            else:
                out[kind] = sum(b - a for a, b in pairs)
            out[f"{kind}_calls"] = len(pairs)
            pairs.clear()
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def guided_step(model, layout, x, text, uncond, batched: bool):
    """One guided prediction at guidance 4 (the sampler's step), batch 2 or two passes of batch 1; an OOM is
    raised, not fallen back from, so that it is recorded."""
    return GuidedPrediction(model, layout, text, uncond, batched=batched, fall_back_on_oom=False)(x, 999, 4.0)


def step_inputs(spec, layout, device, dtype, seed: int):
    """Random latents and text features of one guided step (seeded on the CPU), and the empty negative prompt."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(1, layout.latent_frames, spec.in_channels, layout.latent_height, layout.latent_width,
                    generator=gen).to(device, dtype)
    text = torch.randn(1, layout.num_segments, layout.text_tokens, spec.text_embed_dim, generator=gen).to(device, dtype)
    return x, text, torch.zeros_like(text)


# what the caching allocator did that can stall a step: a retry frees cached blocks and synchronises the device;
# near a full card a block cached for one stream (ops.by_head_groups' side streams) is not reused by another
ALLOCATOR_COUNTS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free")


def allocator_counts(device) -> dict[str, int]:
    """The caching allocator's counters of ALLOCATOR_COUNTS so far ({} off CUDA)."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTS}


@torch.no_grad()
def measure(model, layout, device, dtype, blocks: int | None, repeats: int, batched: bool | None) -> dict:
    """Time one guided step (mean of `repeats` after one warm-up), optionally over the first `blocks` blocks."""
    x, text, uncond = step_inputs(model.spec, layout, device, dtype, seed=0)
    n_layers = len(model.blocks)
    saved_units = model.block_units
    k = n_layers if blocks is None else min(blocks, n_layers)
    model.block_units = [(i, i + 1, False) for i in range(k)]
    timer = ModuleTimer(model, device)
    modes = [True, False] if batched is None else [batched]
    result = None
    try:
        for mode in modes:
            try:
                guided_step(model, layout, x, text, uncond, mode)  # warm-up: kernels, autotuning, allocator
                sync(device)
                timer.collect()
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                before = allocator_counts(device)
                totals, parts = [], []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    guided_step(model, layout, x, text, uncond, mode)
                    sync(device)
                    totals.append(time.perf_counter() - t0)
                    parts.append(timer.collect())
                result = {"cfg": "batch 2" if mode else "two passes of batch 1", "measured_s": sum(totals) / repeats}
                for key in ("attention", "ttt", "block"):
                    result[f"{key}_measured_s"] = sum(p[key] for p in parts) / repeats
                if device.type == "cuda":
                    result["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                    result["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
                    after = allocator_counts(device)
                    result["allocator_per_step"] = {k: (after[k] - before[k]) / repeats for k in after}
                break
            except torch.cuda.OutOfMemoryError:
                result = {"cfg": "batch 2" if mode else "two passes of batch 1", "oom": True}
                timer.collect()
                torch.cuda.empty_cache()
        if result is None or result.get("oom"):
            return result or {"oom": True}
        # extrapolate to the full depth: the blocks not run cost what the timed ones did on average
        missing = n_layers - k
        per_block = {key: result[f"{key}_measured_s"] / k for key in ("attention", "ttt", "block")}
        result["blocks_timed"] = k
        result["blocks_total"] = n_layers
        # blocks not run cost the mean of the timed blocks (CUDA events around each block); embeddings, head and
        # the guidance arithmetic were measured as they are
        result["step_s"] = result["measured_s"] + missing * per_block["block"]
        result["attention_s"] = per_block["attention"] * n_layers
        result["ttt_s"] = per_block["ttt"] * n_layers
        result["rest_s"] = result["step_s"] - result["attention_s"] - result["ttt_s"]
        return result
    finally:
        timer.close()
        model.block_units = saved_units


def detach_ttt(model):
    """Local attention only: TTT modules off the blocks (kept on the CPU to put back)."""
    saved = []
    for block in model.blocks:
        saved.append(block.ttt)
        if block.ttt is not None:
            block.ttt.to("cpu")
        block.ttt = None
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return saved


def attach_ttt(model, saved, device):
    for block, ttt in zip(model.blocks, saved):
        block.ttt = ttt.to(device) if ttt is not None else None


@torch.no_grad()
def offload_check(model, args, cfg, device, dtype) -> dict:
    """Blocks offloaded to pinned host memory with side-stream prefetch: the guided step must give the same output
    as the resident model; reports its time and peak memory next to the resident run."""
    from tttvideo.sample.offload import BlockOffloader

    layout = VideoLayout.from_config(cfg.layout, cfg.ttt, args.offload_check, phase="sample")
    x, text, uncond = step_inputs(model.spec, layout, device, dtype, seed=1)
    resident = guided_step(model, layout, x, text, uncond, True).float().cpu()
    off = BlockOffloader(model.blocks, device, prefetch=cfg.sample.prefetch_blocks)
    try:
        torch.cuda.empty_cache() if device.type == "cuda" else None
        guided_step(model, layout, x, text, uncond, True)  # warm-up
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t = time.perf_counter()
        out = guided_step(model, layout, x, text, uncond, True).float().cpu()
        sync(device)
        result = {"duration_s": layout.duration_s, "step_s": time.perf_counter() - t,
                  "max_abs_diff_vs_resident": float((out - resident).abs().max()),
                  "prefetch_blocks": off.prefetch, "block_loads": off.loads}
        if device.type == "cuda":
            result["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        return result
    finally:
        off.close()
        for block in model.blocks:  # back onto the device for anything that follows
            block.to(device)




def environment(device: torch.device) -> dict:
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "python": platform.python_version(), "git_commit": git_commit(),
           "git_dirty": os.environ.get("GIT_DIRTY", "")}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="cogvideox-5b")
    ap.add_argument("--durations", nargs="+", default=["3s", "9s", "63s"])
    ap.add_argument("--full-until", type=int, default=9, help="seconds up to which all blocks run")
    ap.add_argument("--timed-blocks", type=int, default=3, help="blocks run beyond --full-until")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=720)
    ap.add_argument("--text-tokens", type=int, default=0, help="0 = the original's per-duration length")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--cfg", default="auto", choices=("auto", "batch2", "two-pass"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override (ttt.*, ...)")
    ap.add_argument("--out", default="benchmarks/results/sample.json")
    ap.add_argument("--budget-s", type=float, default=0, help="skip measurements once this much time has passed")
    ap.add_argument("--offload-check", default="3s", help="duration at which block offload is checked against the "
                                                          "resident model (same output, time, peak); '' = skip")
    return ap.parse_args(argv)


def benchmark_config(args: argparse.Namespace) -> Config:
    """The model the sampler would build: preset and dtype from the flags, random weights; no scan checkpointing
    (inference has no backward pass to save for)."""
    return load_config(None, [f'model.preset="{args.preset}"', f'model.dtype="{args.dtype}"',
                              f"layout.height={args.height}", f"layout.width={args.width}",
                              f"layout.text_tokens={args.text_tokens}", "ttt.scan_checkpoint_group_size=0",
                              *args.overrides])


class Report:
    """The JSON result, rewritten after every measurement (and copied to $OUT on the device machine)."""

    def __init__(self, path: Path, data: dict):
        self.path, self.data = path, data
        path.parent.mkdir(parents=True, exist_ok=True)

    def save(self) -> None:
        save_json(self.path, self.data)


def measure_duration(model, layout: VideoLayout, args, device, dtype, use_ttt: bool, batched: bool | None) -> dict:
    """One (duration, TTT on/off) measurement; at --full-until also the extrapolation check."""
    full = layout.duration_s <= args.full_until
    blocks = None if full else args.timed_blocks
    saved = None if use_ttt else detach_ttt(model)
    try:
        r = measure(model, layout, device, dtype, blocks, args.repeats, batched)
        if full and layout.duration_s == args.full_until:
            # how far the k-block extrapolation used at longer durations is from the full measurement
            part = measure(model, layout, device, dtype, args.timed_blocks, args.repeats, batched)
            if "step_s" in part and "step_s" in r:
                r["extrapolation_check"] = {"blocks": args.timed_blocks, "estimated_step_s": part["step_s"],
                                            "error_pct": 100 * (part["step_s"] / r["step_s"] - 1)}
    except Exception as err:  # a kernel that fails to build must not cost the other measurements
        r = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:500]}
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    finally:
        if saved is not None:
            attach_ttt(model, saved, device)
    r.update(duration_s=layout.duration_s, tokens=layout.total_tokens, text_tokens=layout.text_tokens,
             use_ttt=use_ttt)
    return r


def print_table(report: dict) -> None:
    print(f"\n{'duration':>8} {'TTT':>4} {'tokens':>8} {'cfg':>22} {'step s':>8} {'attn s':>8} {'ttt s':>8} "
          f"{'rest s':>8} {'peak GiB':>9} {'blocks':>7}")
    for r in report["runs"]:
        if "step_s" not in r:
            why = r.get("skipped") or r.get("error") or "OOM"
            print(f"{r['duration_s']:>7}s {'on' if r['use_ttt'] else 'off':>4} {r['tokens']:>8} {why}")
            continue
        print(f"{r['duration_s']:>7}s {'on' if r['use_ttt'] else 'off':>4} {r['tokens']:>8} {r['cfg']:>22} "
              f"{r['step_s']:>8.2f} {r['attention_s']:>8.2f} {r['ttt_s']:>8.2f} {r['rest_s']:>8.2f} "
              f"{r.get('peak_allocated_gib', 0):>9.1f} {r['blocks_timed']:>3}/{r['blocks_total']}")
    for k, v in report.get("ratio_ttt_over_local", {}).items():
        print(f"step time with TTT / without at {k}: {v:.2f}x")


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cfg = benchmark_config(args)
    batched = {"auto": None, "batch2": True, "two-pass": False}[args.cfg]
    report = Report(Path(args.out), {
        "benchmark": "sample: one guided denoising step (cond + uncond) at batch 1", "env": environment(device),
        "preset": args.preset, "dtype": args.dtype,
        "ttt": {"kind": cfg.ttt.kind, "mini_batch_size": cfg.ttt.sample_mini_batch(), "backend": cfg.ttt.backend},
        "runs": []})
    data = report.data

    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = build_model(cfg, device=device).eval().requires_grad_(False)
    sync(device)
    data["init_s"] = time.perf_counter() - t0
    data["params_b"] = sum(p.numel() for p in model.parameters()) / 1e9
    data["weights_gib"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    print(f"{args.preset}: {data['params_b']:.2f} B parameters, {data['weights_gib']:.1f} GiB, "
          f"init {data['init_s']:.1f} s on {data['env']['device']}", flush=True)
    report.save()

    def out_of_time() -> bool:
        return bool(args.budget_s) and time.perf_counter() - t0 > args.budget_s

    for duration in args.durations:
        layout = VideoLayout.from_config(cfg.layout, cfg.ttt, duration, phase="sample")
        for use_ttt in (True, False):
            if out_of_time():
                r = {"duration_s": layout.duration_s, "use_ttt": use_ttt, "tokens": layout.total_tokens,
                     "skipped": f"time budget of {args.budget_s:.0f} s spent"}
            else:
                r = measure_duration(model, layout, args, device, dtype, use_ttt, batched)
                print(json.dumps(r), flush=True)
            data["runs"].append(r)
            report.save()
        on, off = (next(x for x in data["runs"] if x["duration_s"] == layout.duration_s and x["use_ttt"] == ttt)
                   for ttt in (True, False))
        if "step_s" in on and "step_s" in off:
            data.setdefault("ratio_ttt_over_local", {})[f"{layout.duration_s}s"] = on["step_s"] / off["step_s"]
            report.save()

    if args.offload_check and not out_of_time():
        try:
            data["offload"] = offload_check(model, args, cfg, device, dtype)
        except Exception as err:
            data["offload"] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
        report.save()
        print(json.dumps(data["offload"]), flush=True)
    print_table(data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
