"""The trainer on CUDA (skipped without it): bf16 autocast with the noise generator on the GPU, pinned-memory
loading, resume from a checkpoint on the GPU, and fp16 with the gradient scaler. The tiny model, the demo set with
the table text encoder (the device image has no MiniLM package).

Run: `pytest tests/gpu/test_train_gpu.py`, or `python tests/gpu/test_train_gpu.py` (prints what it checked).
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

import torch

try:
    import pytest
except ImportError:  # the device image may lack pytest: the module also runs as a script
    pytest = None

ROOT = Path(__file__).resolve().parents[2]
BASE = [
    "layout.duration=6s", "data.demo_videos=3", "data.demo_text_encoder=table", "train.batch_size=1",
    "train.grad_accum=2", "train.device=cuda", "train.checkpoint_every=3", "train.keep_checkpoints=5",
    "train.log_every=1", "train.sample_at_end=false", "train.warmup_steps=1", "ttt.backend=reference",
]


def _config(tmp: Path, name: str, *extra: str):
    from tttvideo.config.loader import load_config

    return load_config(ROOT / "configs/demo.toml", BASE + [f"train.output_dir={tmp / name}",
                                                            f"data.demo_dir={tmp / 'data'}", *extra])


def check_bf16_resume(tmp: Path) -> str:
    from safetensors.torch import load_file

    from tttvideo.train.trainer import Trainer

    full = Trainer(_config(tmp, "full", "train.steps=6", "train.precision=bf16"), quiet=True).run()
    assert full.steps_done == 6 and math.isfinite(full.last_loss)
    metrics = [json.loads(x) for x in (tmp / "full/metrics.jsonl").read_text().splitlines()]
    assert all(m["memory_gib"] > 0 for m in metrics)
    # a run that stopped after its step-3 checkpoint: copy it and resume
    (tmp / "part/checkpoints").mkdir(parents=True)
    shutil.copytree(tmp / "full/checkpoints/step-000003", tmp / "part/checkpoints/step-000003")
    Trainer(_config(tmp, "part", "train.steps=6", "train.precision=bf16"), resume=True, quiet=True).run()
    a = load_file(str(tmp / "full/checkpoints/step-000006/model.safetensors"))
    b = load_file(str(tmp / "part/checkpoints/step-000006/model.safetensors"))
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    bitwise = all(torch.equal(a[k], b[k]) for k in a)
    # GPU kernels may reduce in a different order from run to run (atomics in attention backward), so on CUDA the
    # resumed run is required to match closely, not bitwise; CPU resume is bitwise (tests/test_train_resume.py)
    assert worst < 1e-3, f"resumed run differs by {worst}"
    return f"bf16 6 steps + resume from step 3: bitwise={bitwise}, max |diff| {worst:.3g}, losses " \
           f"{[round(m['loss'], 4) for m in metrics]}"


def check_fp16_scaler(tmp: Path) -> str:
    from tttvideo.train.trainer import Trainer

    trainer = Trainer(_config(tmp, "fp16", "train.steps=4", "train.precision=fp16"), quiet=True)
    result = trainer.run()
    assert result.steps_done == 4 and math.isfinite(result.last_loss)
    from tttvideo.train.checkpoint import load_state

    state = load_state(tmp / "fp16/checkpoints/step-000004")
    assert state["scaler"]["scale"] > 0
    return f"fp16 + GradScaler 4 steps: last loss {result.last_loss:.4f}, scale {state['scaler']['scale']:g}"


def _skip_without_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


if pytest is not None:
    def test_bf16_resume_on_cuda(tmp_path):
        _skip_without_cuda()
        check_bf16_resume(tmp_path)

    def test_fp16_scaler_on_cuda(tmp_path):
        _skip_without_cuda()
        check_fp16_scaler(tmp_path)


if __name__ == "__main__":  # PYTHONPATH=src python -m tests.gpu.test_train_gpu, or with the package installed
    with tempfile.TemporaryDirectory() as d:
        print(torch.cuda.get_device_name(), torch.__version__)
        print(check_bf16_resume(Path(d)))
        print(check_fp16_scaler(Path(d)))
