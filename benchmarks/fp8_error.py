"""What fp8 storage of the frozen weights costs in accuracy on the full-size model: the output of CogVideoX-5B + TTT
after all its blocks, with the frozen linear weights stored as e4m3 + per-channel scales (`model.frozen_weights =
"fp8"`, as the 24 GB configs run it), against the same model in bf16, both measured against an fp32 copy.

The model is built once (random initialisation, bf16, the `lora` adapter as in configs/cogvideox-5b/24gb-*.toml:
attention and MLP base weights frozen, TTT layers trained and therefore left in bf16), copied to fp32 for the
reference, then converted in place with `store_fp8`; every forward sees the same random latents and text features
at one mid-schedule timestep. The TTT scan is the PyTorch reference in all three, so that only the weight storage
differs. Random-init weights are not the pretrained ones: the error on the downloaded weights can differ (per-channel
scales make it depend little on the weights' size, tests/test_fp8_storage.py). Run from the repository root:

    PYTHONPATH=src python3 benchmarks/fp8_error.py --out benchmarks/results/fp8_error_h100.json
    PYTHONPATH=src python3 benchmarks/fp8_error.py --preset tiny --device cpu --height 64 --width 96 \
        --text-tokens 8 --out /tmp/fp8.json                                  # a CPU smoke run of the same code
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from tttvideo.config.loader import load_config
from tttvideo.layout import VideoLayout
from tttvideo.memory.profile.profiler import git_commit
from tttvideo.models import build_model
from tttvideo.models.fp8_storage import Fp8Linear, store_fp8
from tttvideo.results import save_json


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cogvideox-5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--duration", default="3s")
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=720)
    ap.add_argument("--text-tokens", type=int, default=0, help="0: the original's length")
    ap.add_argument("--timestep", type=int, default=500)
    ap.add_argument("--seeds", type=int, default=2, help="input draws")
    ap.add_argument("--commit", default=git_commit())
    ap.add_argument("--out", default="benchmarks/results/fp8_error.json")
    return ap.parse_args()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@torch.no_grad()
def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    cfg = load_config(None, [f"model.preset={args.preset}", 'model.pretrained_path=""', "model.dtype=bf16",
                             "model.adapter=lora", "ttt.backend=reference", f"layout.duration={args.duration}",
                             f"layout.height={args.height}", f"layout.width={args.width}",
                             f"layout.text_tokens={args.text_tokens}"])
    layout = VideoLayout.from_config(cfg.layout, cfg.ttt)
    torch.manual_seed(0)
    model = build_model(cfg, device).eval()
    spec = model.spec
    inputs = []
    for seed in range(args.seeds):
        g = torch.Generator(device=device).manual_seed(seed)
        latents = torch.randn(1, layout.latent_frames, spec.in_channels, layout.latent_height, layout.latent_width,
                              generator=g, device=device)
        text = torch.randn(1, layout.num_segments, layout.text_tokens, spec.text_embed_dim, generator=g, device=device)
        inputs.append((latents, text))
    t = torch.tensor([args.timestep], device=device)

    def outputs(m: torch.nn.Module, dtype: torch.dtype) -> list[torch.Tensor]:
        return [m(x.to(dtype), c.to(dtype), t, layout).float().cpu() for x, c in inputs]

    start = time.perf_counter()
    reference = copy.deepcopy(model).float()
    y32 = outputs(reference, torch.float32)
    del reference
    if device.type == "cuda":
        torch.cuda.empty_cache()
    y16 = outputs(model, torch.bfloat16)
    converted = store_fp8(model)
    y8 = outputs(model, torch.bfloat16)
    rows = [{"seed": s, "bf16_vs_fp32": relative(b, r), "fp8_vs_fp32": relative(f, r), "fp8_vs_bf16": relative(f, b)}
            for s, (r, b, f) in enumerate(zip(y32, y16, y8))]
    result = {
        "benchmark": "fp8_error",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "git_commit": args.commit,
        "preset": args.preset,
        "layout": layout.summary(),
        "timestep": args.timestep,
        "fp8_layers": converted,
        "fp8_linear_modules": sum(isinstance(m, Fp8Linear) for m in model.modules()),
        "rows": rows,
        "seconds": time.perf_counter() - start,
    }
    save_json(args.out, result)
    print(f"\n{result['device']}, {args.preset} + TTT-MLP ({spec.num_layers} blocks), {layout.total_tokens} tokens, "
          f"t = {args.timestep}, {converted} frozen linears in fp8; relative error of the output (L2)")
    print(f"{'seed':>4} {'bf16 vs fp32':>13} {'fp8 vs fp32':>12} {'fp8 vs bf16':>12}")
    for r in rows:
        print(f"{r['seed']:>4} {r['bf16_vs_fp32']:>13.4f} {r['fp8_vs_fp32']:>12.4f} {r['fp8_vs_bf16']:>12.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
