"""Wan2.1-T2V-1.3B + TTT-MLP on an emulated 24 GB card: the project's own `tttv profile` on the stage configs of
configs/wan2.1-1.3b/ under `memory.max_gpu_gib`, each in its own process, with one table at the end.

    PYTHONPATH=src python3 benchmarks/fit_24gb_wan.py --out benchmarks/results/fit_24gb_wan_h100.json

Parts (each replaces its own key in --out):
- `train-profile`: two training steps (random weights: no download needed) of stage1-3s-24gb.toml,
  stage3-18s-24gb.toml and stage5-63s-24gb.toml under their 23 GiB cap: the peak per phase, seconds per step
  (the second step's, from the profiler's synchronised step marks), where it ran out of memory if it did.
- `sample`: two guided denoising steps of a 63-s video with sample-63s-24gb.toml (chunked inference, guidance in two
  passes, bf16) under its 12 GiB cap, and the same uncapped without chunked inference for comparison.

Every subprocess gets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True. A 24 GB card is emulated: the cap is torch's
per-process memory fraction, and the CUDA context (about 0.5-0.8 GiB) is outside it. A CPU rehearsal of the
script: --set model.preset=wan-tiny --set layout.height=32 --set layout.width=32 --set layout.text_tokens=16
--set train.device=cpu --set sample.device=cpu --set train.precision=fp32.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

try:  # python -m benchmarks.fit_24gb_wan, or a test
    from benchmarks import fit_24gb
except ImportError:  # python benchmarks/fit_24gb_wan.py: this script's folder is first on sys.path
    import fit_24gb

environment, gib, profile, use_environment = (fit_24gb.environment, fit_24gb.gib, fit_24gb.profile,
                                              fit_24gb.use_environment)

CONFIGS = fit_24gb.ROOT / "configs" / "wan2.1-1.3b"
# random weights, the demo text encoder and the identity decode: nothing to download (the memory is the transformer's)
NO_ENCODERS = ["sample.vae_path=", "sample.text_encoder_path=", "data.vae_path=", "data.text_encoder_path="]
TRAIN_CONFIGS = ("stage1-3s-24gb.toml", "stage3-18s-24gb.toml", "stage5-63s-24gb.toml")
SAMPLE_VARIANTS = [
    ("12 GiB: chunked, two passes, bf16 (sample-63s-24gb.toml)", []),
    ("uncapped, plain forward, two passes, bf16", ["memory.max_gpu_gib=0", "memory.chunked_inference=false"]),
]


def part_train_profile(args, work: Path) -> dict:
    rows = []
    for config in TRAIN_CONFIGS:
        print(f"train-profile: {config}", flush=True)
        row = profile(f"wan train {config}", CONFIGS / config, "train", 2, NO_ENCODERS, work, args.timeout)
        row["config"] = config
        rows.append(row)
    return {"runs": rows}


def part_sample(args, work: Path) -> dict:
    rows = []
    for name, overrides in SAMPLE_VARIANTS:
        print(f"sample: {name}", flush=True)
        row = profile(f"wan sample {name}", CONFIGS / "sample-63s-24gb.toml", "sample", 2, NO_ENCODERS + overrides,
                      work, args.timeout)
        row["variant"] = name
        rows.append(row)
    return {"variants": rows}


def print_table(data: dict) -> None:
    print("\n| part | setup | status | step s | peak alloc GiB | peak reserved GiB | note |")
    print("|---|---|---|---|---|---|---|")
    for key, label, rows in (("train_profile", "train", "runs"), ("sample", "sample 63 s", "variants")):
        for r in data.get(key, {}).get(rows, []):
            step = r.get("step_s") or []
            note = (r.get("oom") or {}).get("location") or r.get("error", "")
            if not note and r.get("phases"):
                note = ", ".join(f"{p['name']} {gib(p['peak_allocated'])}" for p in r["phases"])
            print(f"| {label} | {r.get('config') or r.get('variant')} | {r.get('status')} | "
                  f"{step[-1] if step else ''} | {gib(r.get('totals', {}).get('peak_allocated'))} | "
                  f"{gib(r.get('totals', {}).get('peak_reserved'))} | {note} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", nargs="+", default=["train-profile", "sample"], choices=("train-profile", "sample"))
    ap.add_argument("--timeout", type=float, default=1500, help="seconds per subprocess")
    ap.add_argument("--work", default="runs/fit_24gb_wan", help="folder for the profiler reports")
    ap.add_argument("--out", default="benchmarks/results/fit_24gb_wan.json")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    help="config override for every run (see the CPU rehearsal above)")
    args = ap.parse_args(argv)
    fit_24gb.EXTRA[:] = args.overrides
    use_environment()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.is_file() else {}
    data.update({"benchmark": "fit_24gb_wan", **environment()})
    for part in args.parts:
        key = part.replace("-", "_")
        data[key] = {"train-profile": part_train_profile, "sample": part_sample}[part](args, work)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1))  # after every part: a later failure keeps what was measured
    print_table(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
