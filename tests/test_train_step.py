"""The optimizer step on the tiny model: it computes what a hand-written accumulate-clip-step loop computes, a
non-finite loss skips the update without losing its place in the data, and a profiler only watches."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401  (optimizers import it on first use; under tracemalloc that import alone takes ~10 s)

from tttvideo.config.loader import load_config
from tttvideo.diffusion import ZeroSNRSchedule
from tttvideo.layout import VideoLayout
from tttvideo.memory.profile.profiler import MemoryProfiler
from tttvideo.models import build_model
from tttvideo.train.loss import NoiseSource, diffusion_loss
from tttvideo.train.optim import build_optimizer
from tttvideo.train.step import BACKWARD, FORWARD, OPTIMIZER, build_train_step

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
TINY = ["model.preset=tiny", "layout.height=32", "layout.width=48", "layout.text_tokens=8", "train.precision=fp32",
        "ttt.backend=reference", "train.batch_size=2", "train.lr=1e-2", "train.lr_ssm=1e-2"]


def setup(*extra):
    cfg = load_config(None, [*TINY, *extra])
    layout = VideoLayout.from_config(cfg.layout, cfg.ttt)
    torch.manual_seed(0)
    model = build_model(cfg)
    model.train()
    spec = model.spec
    g = torch.Generator().manual_seed(1)
    batches = [{"latents": torch.randn(2, layout.latent_frames, spec.in_channels, layout.latent_height,
                                       layout.latent_width, generator=g),
                "text": torch.randn(2, layout.num_segments, layout.text_tokens, spec.text_embed_dim, generator=g)}
               for _ in range(4)]
    return cfg, layout, model, batches


def make_step(cfg, layout, model, grad_accum, profiler=None, scheduler=False):
    """The step as the trainer, the profiler and benchmarks/model_step.py assemble it."""
    return build_train_step(cfg, model, CPU, layout, NoiseSource(cfg.train.seed, CPU),
                            global_batch=cfg.train.batch_size * grad_accum, grad_accum=grad_accum,
                            scheduled=scheduler, profiler=profiler)


def test_the_assembly_applies_the_configs_memory_techniques():
    cfg, layout, model, _ = setup("checkpointing.offload_activations=true", "model.frozen_weights=fp8",
                                  "memory.stream_frozen_weights=true", "model.adapter=lora", "model.lora_rank=4")
    step = make_step(cfg, layout, model, grad_accum=1, scheduler=True)
    # offload around each micro-batch; streaming applied (a no-op off CUDA: nothing moved); the schedule built
    assert step.offload and step.prepared == {"fp8 weight streaming": 0} and step.scheduler is not None
    assert step.grad_clip == cfg.train.grad_clip and step.objective.global_batch == cfg.train.batch_size
    plain = make_step(*setup()[:3], grad_accum=1)
    assert not plain.offload and plain.prepared == {} and plain.scheduler is None
    cfg.model.frozen_weights = "dtype"
    from tttvideo.errors import ConfigError

    with pytest.raises(ConfigError, match="memory.stream_frozen_weights"):
        make_step(cfg, layout, model, grad_accum=1)


@pytest.mark.parametrize("clip", [0.05, 0.0])
def test_step_is_a_plain_accumulate_clip_and_step(clip):
    cfg, layout, model, batches = setup(f"train.grad_clip={clip}")
    ref = copy.deepcopy(model)
    step = make_step(cfg, layout, model, grad_accum=2)
    result = step(iter(batches), 0)

    # by hand: the mean loss over two micro-batches, strata 0-1 and 2-3 of 4, then clip (or measure) and AdamW
    params = [p for p in ref.parameters() if p.requires_grad]
    optimizer = build_optimizer(ref, cfg.train)
    noise, total = NoiseSource(cfg.train.seed, CPU), 0.0
    for micro, batch in enumerate(batches[:2]):
        loss, _ = diffusion_loss(ref, batch, ZeroSNRSchedule(), noise, layout, cfg.train.text_dropout, 2 * micro, 4,
                                 "fp32")
        total += loss.item() / 2
        (loss / 2).backward()
    if clip:
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
    else:
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
    optimizer.step()

    assert result.finite and result.loss == total and result.grad_norm == float(norm)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad), name
        assert torch.equal(a, b), name
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), setup()[2].parameters()))


def test_nonfinite_loss_skips_the_update_but_draws_every_batch():
    cfg, layout, model, batches = setup()
    step = make_step(cfg, layout, model, grad_accum=3, scheduler=True)
    real = step.objective
    step.objective = lambda m, batch, micro: real(m, batch, micro) * (math.nan if micro == 0 else 1.0)
    before = [p.detach().clone() for p in model.parameters()]
    drawn = iter(batches)
    result = step(drawn, 0)
    assert not result.finite and math.isnan(result.loss) and math.isnan(result.grad_norm)
    assert next(drawn) is batches[3]  # all three micro-batches of the step were taken
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())
    assert step.scheduler.last_epoch == 1  # the schedule moved on as after a finite step


def run_two_steps(profiler):
    cfg, layout, model, batches = setup()
    step = make_step(cfg, layout, model, grad_accum=2, profiler=profiler)
    losses = [step(iter(batches), i).loss for i in range(2)]
    return model, losses


def test_profiler_only_watches_and_a_disabled_one_does_nothing():
    plain, plain_losses = run_two_steps(None)

    off = MemoryProfiler.disabled()
    assert isinstance(off.phase(FORWARD, 0), contextlib.nullcontext)
    assert isinstance(off.component("x"), contextlib.nullcontext)
    quiet, quiet_losses = run_two_steps(off)
    assert off.events == [] and off.timeline == []

    on = MemoryProfiler(device="cpu")
    watched, watched_losses = run_two_steps(on)
    on.close()
    phases = [(e.name, e.step) for e in on.events if e.kind == "phase"]
    assert phases == [(FORWARD, 0), (BACKWARD, 0), (FORWARD, 0), (BACKWARD, 0), (OPTIMIZER, 0),
                      (FORWARD, 1), (BACKWARD, 1), (FORWARD, 1), (BACKWARD, 1), (OPTIMIZER, 1)]

    assert plain_losses == quiet_losses == watched_losses
    for (name, a), b, c in zip(plain.named_parameters(), quiet.parameters(), watched.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c), name


def test_model_step_benchmark_runs_the_step_on_cpu(tmp_path):
    """benchmarks/model_step.py (built with build_model, timed through TrainStep) as its docstring's CPU smoke run."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "model_step.json"
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    subprocess.run([sys.executable, str(root / "benchmarks" / "model_step.py"), "--preset", "tiny", "--device", "cpu",
                    "--dtype", "fp32", "--height", "32", "--width", "48", "--text-tokens", "8", "--durations", "3",
                    "--steps", "1", "--warmup", "0", "--optimizer-step", "--out", str(out)],
                   check=True, cwd=root, env=env, capture_output=True, text=True)
    result = json.loads(out.read_text())
    row = result["results"][0]
    assert result["optimizer_step"] and result["config"]["model"]["adapter"] == "qkvo"
    assert row["tokens"] > 0 and row["median_step_s"] > 0 and row["ttt_backend"] == "reference"


def test_memory_techniques_benchmark_runs_each_variant_on_cpu(tmp_path):
    """benchmarks/memory_techniques.py as its docstring's CPU smoke run: each variant a row, under the allocator
    settings `tttv train` uses (it imports the model and step from model_step.py, so a renamed import shows here);
    a second run with --merge keeps the first run's rows of the variants it did not run."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "memory_techniques.json"
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)

    def run(*extra: str) -> dict:
        subprocess.run([sys.executable, str(root / "benchmarks" / "memory_techniques.py"), "--preset", "tiny",
                        "--device", "cpu", "--dtype", "fp32", "--height", "32", "--width", "48", "--text-tokens", "8",
                        "--duration", "3", "--out", str(out), *extra],
                       check=True, cwd=root, env=env, capture_output=True, text=True)
        return json.loads(out.read_text())

    result = run("--variants", "kept", "offloaded-block", "--commit", "first")
    assert [r["variant"] for r in result["results"]] == ["kept", "offloaded-block"]
    assert all(r["step_s"] > 0 for r in result["results"])
    assert result["results"][1]["unchecked_parts"] == ["attention", "forward_ttt", "reverse_ttt", "mlp"]
    assert result["alloc_conf"] == "expandable_segments:True"
    merged = run("--variants", "offloaded-attn", "--commit", "second", "--merge")["results"]
    assert [(r["variant"], r["git_commit"]) for r in merged] == [
        ("kept", "first"), ("offloaded-attn", "second"), ("offloaded-block", "first")]
