"""The sampling forward's fused glue, each against what it replaced, in one process on one GPU, at the guided step's
shapes (batch 2: conditional and unconditional) of CogVideoX-5B, bf16, without gradients:

- one block's bidirectional TTT (`benchmarks/ttt_sample_minibatch.py`'s `measure`) with its glue compiled (the
  default: each gated residual add in one pass, `sequence.bidirectional.gated_add`) and with `ttt.compile_glue =
  false` (two addcmul and a concatenation); in both the scan output is gathered back to residual order and
  post-normalised in one pass by the Triton kernel (`ttt.triton_post_norm`);
- the block's MLP (3,072 -> 12,288 -> 3,072) with the GELU in the first product's cuBLASLt epilogue
  (`models.layers.linear_gelu`, the default without gradients on CUDA) and as its own kernel after the product,
  with the relative error between them;
- on CUDA, that post-norm alone (two calls a block) in the Triton kernel and as the torch.compile'd reference it
  replaced (`ttt.layer.post_norm_rows`), with the relative error between them;
- on CUDA, local attention's glue before SDPA (q/k norms, RoPE, the window gather) in its Triton kernel
  (`models.triton_window_gather`) and as the torch.compile'd reference it replaced (`models.attention.gather_windows`);
- on CUDA, the same kernel at Wan2.1-1.3B's self-attention (RoPE and the gather; 12 heads of 128, its 30 blocks)
  against the eager `gather_windows` Wan ran before it.

"step s" multiplies a block's time by the 42 blocks: the share of one guided step.

    PYTHONPATH=src python3 benchmarks/sampling_glue.py --out benchmarks/results/sampling_glue_h100.json

(PYTHONPATH=src is not needed with the package installed.) `--parts` times some of them (ttt, mlp, post_norm,
window_glue, wan_window_glue) and keeps the other rows already in the JSON, if of the same device; every row names
its commit. Prints a table last; writes JSON with device, torch and commit. Medians of CUDA-event timings
(benchmarks/ttt_kernel.py's `bench`); on the CPU a smoke run (wall clock, the epilogue is not taken there).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks this one reuses, run as a script or loaded
import ttt_sample_minibatch  # noqa: E402
from ttt_kernel import git_commit  # noqa: E402

from tttvideo.config.loader import load_config  # noqa: E402
from tttvideo.layout import VideoLayout  # noqa: E402
from tttvideo.models.layers import MLP  # noqa: E402
from tttvideo.results import save_json  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--durations", nargs="+", default=["3s", "63s"])
    ap.add_argument("--dim", type=int, default=3072)
    ap.add_argument("--heads", type=int, default=48)
    ap.add_argument("--layers", type=int, default=ttt_sample_minibatch.LAYERS_5B)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=720)
    ap.add_argument("--text-tokens", type=int, default=0, help="0: the original's length per duration")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS),
                    help="what to time (default: all); rows of the other parts already in --out are kept (of the "
                         "same device), each row naming its commit")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="benchmarks/results/sampling_glue.json")
    return ap.parse_args(argv)


def ttt_rows(args, duration: str, device: torch.device, dtype: torch.dtype) -> list[dict]:
    targs = ttt_sample_minibatch.parse_args(["--dim", str(args.dim), "--heads", str(args.heads),
                                             "--height", str(args.height), "--width", str(args.width),
                                             "--text-tokens", str(args.text_tokens), "--layers", str(args.layers),
                                             "--reps", str(args.reps), "--device", str(device)])
    mini_batch = load_config(None, []).ttt.sample_mini_batch()
    rows = []
    for variant, overrides in (("fused (compiled)", ()), ("eager", ("ttt.compile_glue=false",))):
        row = ttt_sample_minibatch.measure(targs, "mlp", duration, mini_batch, device, dtype, overrides)
        rows.append({"part": "bidirectional TTT", "variant": variant, **row})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def sample_layout(args, duration: str) -> VideoLayout:
    """The guided step's layout at `duration` (the default sampling mini-batch; the frame size and text length of
    the arguments)."""
    cfg = load_config(None, [f"layout.height={args.height}", f"layout.width={args.width}",
                             f"layout.text_tokens={args.text_tokens}"])
    return VideoLayout.from_config(cfg.layout, cfg.ttt, duration, phase="sample")


@torch.no_grad()
def mlp_rows(args, duration: str, device: torch.device, dtype: torch.dtype) -> list[dict]:
    layout = sample_layout(args, duration)
    torch.manual_seed(0)
    mlp = MLP(args.dim, 4 * args.dim).to(device, dtype)
    x = torch.randn(2, layout.total_tokens, args.dim, device=device, dtype=dtype)

    def two_ops():
        return mlp.fc2(F.gelu(mlp.fc1(x), approximate="tanh"))

    fused, plain = mlp(x).float(), two_ops().float()
    error = float((fused - plain).norm() / plain.norm())
    del fused, plain
    rows = []
    for variant, fn in (("GELU in the epilogue", lambda: mlp(x)), ("GELU apart", two_ops)):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        ms = ttt_sample_minibatch.timed(fn, device, args.reps)
        row = {"part": "MLP", "variant": variant, "duration": duration, "duration_s": layout.duration_s,
               "tokens": layout.total_tokens,
               "block_ms": ms, "step_s": ms * args.layers / 1e3, "rel_err_vs_apart": error}
        if device.type == "cuda":
            row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


@torch.no_grad()
def post_norm_rows_timed(args, duration: str, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """The TTT output's gather to residual order and post-norm alone: the Triton kernel (`triton_post_norm`, the
    default on CUDA) against the torch.compile'd reference (`post_norm_rows`, which the kernel replaced), on a scan
    output of the pass's shape; "block ms" is two calls (the block's forward and reverse pass)."""
    from tttvideo.ttt.layer import layout_tensors, post_norm_rows
    from tttvideo.ttt.triton_post_norm import post_norm_rows_forward

    layout = sample_layout(args, duration)
    head_dim = args.dim // args.heads
    (_, index), _, _, _ = layout_tensors(layout, head_dim, 10000.0, device)
    torch.manual_seed(0)
    scanned = torch.randn(2, args.heads, layout.total_tokens + layout.ttt_padding, head_dim, device=device,
                          dtype=dtype)
    weight, bias = 1 + 0.1 * torch.randn(args.dim, device=device), 0.1 * torch.randn(args.dim, device=device)
    compiled = torch.compile(post_norm_rows, dynamic=False)
    kernel_out = post_norm_rows_forward(scanned, index, weight.to(dtype), bias.to(dtype), 1e-6).float()
    ref = compiled(scanned, index, weight.to(dtype), bias.to(dtype), 1e-6).float()
    error = float((kernel_out - ref).norm() / ref.norm())
    del kernel_out, ref
    rows = []
    for variant, fn in (("Triton kernel", lambda: post_norm_rows_forward(scanned, index, weight.to(dtype),
                                                                          bias.to(dtype), 1e-6)),
                        ("compiled", lambda: compiled(scanned, index, weight.to(dtype), bias.to(dtype), 1e-6))):
        ms = 2 * ttt_sample_minibatch.timed(fn, device, args.reps)
        row = {"part": "TTT post-norm", "variant": variant, "duration": duration, "duration_s": layout.duration_s,
               "tokens": layout.total_tokens, "block_ms": ms, "step_s": ms * args.layers / 1e3,
               "rel_err_vs_compiled": error}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp32, a few rows of the first dim at a time (no fp32 copy of a 63-s window tensor)."""
    num = den = 0.0
    for i in range(0, a.shape[0], 4):
        x, y = a[i:i + 4].float(), b[i:i + 4].float()
        num += float((x - y).square().sum())
        den += float(y.square().sum())
    return (num / den) ** 0.5


def _window_glue_rows(part: str, duration: str, layout: VideoLayout, heads: int, head_dim: int, cos, sin,
                      index: torch.Tensor, norms, replaced: str, reference, layers: int, reps: int,
                      device: torch.device, dtype: torch.dtype) -> list[dict]:
    """The window-glue kernel against `reference` (what it replaced, named `replaced`) on q, k, v of the block's
    shapes at guided batch 2, strided views of one projection output as in the block; "block ms" is one call."""
    from tttvideo.models.triton_window_gather import window_gather

    n = index.shape[0]
    flat = index.reshape(-1)
    torch.manual_seed(0)
    q, k, v = torch.randn(2, layout.total_tokens, 3, heads, head_dim, device=device, dtype=dtype).unbind(2)
    kernel = lambda: window_gather(q, k, v, flat, n, cos, sin, *norms)  # noqa: E731
    slow = lambda: reference(q, k, v, flat if n > 1 else None, n, cos, sin, *norms)  # noqa: E731
    errors = [_rel_error(a, b) for a, b in zip(kernel(), slow())]
    rows = []
    for variant, fn in (("Triton kernel", kernel), (replaced, slow)):
        torch.cuda.empty_cache()
        ms = ttt_sample_minibatch.timed(fn, device, reps)
        row = {"part": part, "variant": variant, "duration": duration, "duration_s": layout.duration_s,
               "tokens": layout.total_tokens, "windows": n, "heads": heads, "head_dim": head_dim, "block_ms": ms,
               "step_s": ms * layers / 1e3, "rel_err_vs_replaced_qkv": errors}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


@torch.no_grad()
def window_glue_timed(args, duration: str, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Local attention's glue before SDPA alone (q/k norms, RoPE, the window gather of q, k, v): the Triton kernel
    (`models.triton_window_gather`, the default without gradients on CUDA) against the torch.compile'd reference
    (`models.attention.gather_windows`, which it replaced)."""
    from tttvideo.models.attention import gather_windows, window_tensors

    layout = sample_layout(args, duration)
    D = args.dim // args.heads
    index, cos, sin, _ = window_tensors(layout, D, 10000.0, device)
    torch.manual_seed(1)
    norms = [(1 + 0.1 * torch.randn(D, device=device, dtype=dtype), 0.1 * torch.randn(D, device=device, dtype=dtype),
              1e-6) for _ in range(2)]
    return _window_glue_rows("attention window glue", duration, layout, args.heads, D, cos, sin, index, norms,
                             "compiled", torch.compile(gather_windows, dynamic=False), args.layers, args.reps,
                             device, dtype)


@torch.no_grad()
def wan_window_glue_timed(args, duration: str, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """The same kernel in Wan2.1-1.3B's windowed self-attention (12 heads of 128 at Wan's 480 x 832, RoPE only, 30
    blocks) against the eager `gather_windows` Wan ran before."""
    from tttvideo.models.attention import gather_windows
    from tttvideo.models.wan.attention import window_rope, window_table
    from tttvideo.models.wan.layout import wan_layout
    from tttvideo.models.wan.spec import get_wan_preset

    spec = get_wan_preset("wan2.1-t2v-1.3b")
    layout = wan_layout(duration)
    D = spec.attention_head_dim
    cos, sin = window_rope(layout, D, spec.rope_theta, device)
    return _window_glue_rows("Wan window glue", duration, layout, spec.num_attention_heads, D, cos, sin,
                             window_table(layout, device), (None, None), "eager", gather_windows, spec.num_layers,
                             args.reps, device, dtype)


# --parts: name -> (the function timing it, whether it needs CUDA)
PARTS = {"ttt": (ttt_rows, False), "mlp": (mlp_rows, False), "post_norm": (post_norm_rows_timed, True),
         "window_glue": (window_glue_timed, True), "wan_window_glue": (wan_window_glue_timed, True)}


def print_table(result: dict) -> None:
    print(f"\nsampling glue, guided batch 2, {result['dim']} wide, {result['dtype']}, on {result['device']}, "
          f"commit {result['git_commit']}")
    print(f"{'part':<22} {'variant':<22} {'duration':>8} {'block ms':>9} {'step s':>7} {'x vs 2nd':>8} commit")
    rows = result["rows"]
    for r in rows:
        if "block_ms" not in r:
            print(f"{r['part']:<22} {r['variant']:<22} {r['duration']:>8} {r.get('error')}")
            continue
        other = [b for b in rows if b["part"] == r["part"] and b["duration"] == r["duration"] and "block_ms" in b]
        ratio = f"{r['block_ms'] / other[-1]['block_ms']:.3f}" if len(other) == 2 else "-"
        print(f"{r['part']:<22} {r['variant']:<22} {r['duration']:>8} {r['block_ms']:>9.2f} {r['step_s']:>7.2f} "
              f"{ratio:>8} {str(r.get('git_commit', ''))[:7]}")


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    commit = git_commit() or "unknown (no .git on the device copy)"
    result = {"benchmark": "sampling_glue", "device": torch.cuda.get_device_name(device) if device.type == "cuda"
              else platform.processor() or "cpu", "torch": torch.__version__, "python": platform.python_version(),
              "git_commit": commit, "dim": args.dim, "heads": args.heads, "layers": args.layers,
              "dtype": str(dtype).split(".")[-1], "rows": []}
    for duration in args.durations:
        for part in args.parts:
            if PARTS[part][1] and device.type != "cuda":
                continue
            result["rows"] += [{**row, "git_commit": commit}
                               for row in PARTS[part][0](args, duration, device, dtype)]
    out = Path(args.out)
    if out.exists():  # keep the rows of what this run did not time, if they are of this device
        earlier = json.loads(out.read_text())
        if earlier.get("device") == result["device"]:
            timed = {(r["part"], r["duration"]) for r in result["rows"]}
            kept = [r for r in earlier.get("rows", []) if (r["part"], r["duration"]) not in timed]
            for r in kept:
                r.setdefault("git_commit", earlier.get("git_commit"))
            result["rows"] = kept + result["rows"]
    save_json(out, result)
    print_table(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
