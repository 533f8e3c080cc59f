"""The trainer's videos under torchrun on two GPUs (skipped with fewer): the tiny demo model trained 4 steps in one
process, with FSDP over two GPUs, and with sp = 2 (a validation video at step 2 besides the end-of-run one); the
launches end with the one-process run's losses, and their step-4 videos show its frames. The CPU version, with gloo,
is tests/test_parallel_train.py::test_sp_and_fsdp_on_two_processes_match_one.

Run: `pytest tests/gpu/test_parallel_videos_gpu.py`, or `python tests/gpu/test_parallel_videos_gpu.py` (prints the
figures). These launches, run by a script of the same commands on two H200s (torch 2.11, commit b20c621): losses
within 4e-8 relative of one process; the FSDP video 6 / 255 at most from its video (mean 0.02), the sp = 2 one
equal to it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

try:
    import pytest
except ImportError:  # the device image may lack pytest: the module also runs as a script
    pytest = None

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = [
    "train.device=cuda", "sample.device=cuda", "layout.duration=3s", "layout.height=32", "layout.width=32",
    "data.demo_videos=3", "data.demo_text_encoder=table", "train.tensorboard=false", "train.batch_size=1",
    "train.grad_accum=0", "train.global_batch=2", "train.steps=4", "train.checkpoint_every=2", "train.log_every=1",
    "train.warmup_steps=1", "sample.steps=2", "train.sample_at_end=true",
]
LOSS_RTOL = 1e-5
# fp32 on CUDA: FSDP's reduce-scatter sums the gradient in another order than one process, so the weights (and the
# video sampled from them) may differ in the last bits; a pixel of the 8-bit video moves by a few levels at most
MAX_PIXEL_DIFF = 12
MEAN_PIXEL_DIFF = 0.5


def train(tmp: Path, name: str, ranks: int, *extra: str) -> Path:
    sets = [x for s in (*SETTINGS, f"data.demo_dir={tmp / 'data'}", f"train.output_dir={tmp / name}", *extra)
            for x in ("--set", s)]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    cmd = [*(launcher if ranks > 1 else [sys.executable]), "-m", "tttvideo", "train",
           str(ROOT / "configs" / "demo.toml"), *sets]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, f"{name}: exit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return tmp / name


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def check_videos(tmp: Path) -> list[str]:
    from tttvideo.data.video import read_frames

    one = train(tmp, "one", 1)
    fsdp = train(tmp, "fsdp", 2, "parallel.dp_shard=2")
    sp = train(tmp, "sp", 2, "parallel.sp=2", "parallel.dp_shard=1", "train.validate_every=2")
    assert [v.name for v in sorted((sp / "samples").glob("*.mp4"))] == ["step-000002.mp4", "step-000004.mp4"]
    reference = read_frames(one / "samples" / "step-000004.mp4").astype(np.int16)
    said = []
    for run in (fsdp, sp):
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses(run), losses(one), strict=True))
        assert worst <= LOSS_RTOL, (run.name, losses(run), losses(one))
        frames = read_frames(run / "samples" / "step-000004.mp4").astype(np.int16)
        assert frames.shape == reference.shape
        diff = np.abs(frames - reference)
        assert diff.max() <= MAX_PIXEL_DIFF and diff.mean() <= MEAN_PIXEL_DIFF, (run.name, diff.max(), diff.mean())
        said.append(f"{run.name}: losses within {worst:.2g} relative of one process; step-4 video "
                    f"{int(diff.max())} / 255 at most from it (mean {diff.mean():.3g})")
    return said


if pytest is not None:
    def test_videos_of_fsdp_and_sp_runs_on_two_gpus_show_the_one_process_frames(tmp_path):
        if torch.cuda.device_count() < 2:
            pytest.skip("needs two CUDA devices")
        check_videos(tmp_path)


if __name__ == "__main__":  # PYTHONPATH=src python tests/gpu/test_parallel_videos_gpu.py
    with tempfile.TemporaryDirectory() as d:
        print(torch.cuda.get_device_name(), torch.__version__)
        print("\n".join(check_videos(Path(d))))
