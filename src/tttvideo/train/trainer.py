"""`tttv train`: the training loop of one stage (SPEC section 4).

One optimizer step = `grad_accum` micro-batches of `batch_size` samples on each GPU; the loss of each micro-batch is
divided by `grad_accum` so the accumulated gradient is the mean over the effective batch. Then: a non-finite check
(stop, naming the last good checkpoint, or skip with a counter), gradient clipping, AdamW, the LR schedule.

Exact resume: model, optimizer, scheduler, scaler, every RNG and the step are restored from the newest checkpoint,
and the data order is a pure function of (seed, data position) (`tttvideo.data.loader`), so a resumed run computes
bit for bit what the uninterrupted run would have (on the same hardware and software).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tttvideo.config.loader import config_to_dict, dump_toml, layout_from_config
from tttvideo.data.cache import LatentCache
from tttvideo.data.loader import make_loader, to_device
from tttvideo.diffusion import ZeroSNRSchedule
from tttvideo.errors import ConfigError, UserError
from tttvideo.train import checkpoint as ckpt
from tttvideo.train.loss import NoiseSource, diffusion_loss
from tttvideo.train.monitor import TrainMonitor, memory_gib
from tttvideo.train.optim import build_optimizer, build_scheduler
from tttvideo.device import resolve_device


class TrainingDiverged(UserError):
    """The loss became NaN or Inf."""


@dataclass
class TrainResult:
    output_dir: Path
    steps_done: int
    first_loss: float
    last_loss: float
    checkpoints: list[Path] = field(default_factory=list)
    nonfinite_skips: int = 0
    seconds: float = 0.0
    video: Path | None = None



def batch_plan(train: Any, world_size: int) -> tuple[int, int]:
    """(grad_accum, global_batch) from batch_size, grad_accum and global_batch, checking that they agree."""
    per_step = train.batch_size * world_size
    if train.grad_accum == 0 and train.global_batch == 0:
        return 1, per_step
    if train.grad_accum == 0:
        if train.global_batch % per_step:
            raise ConfigError(
                f"train.global_batch {train.global_batch} is not a multiple of train.batch_size {train.batch_size} x "
                f"{world_size} GPU(s) = {per_step}; change one of them or set train.grad_accum"
            )
        return train.global_batch // per_step, train.global_batch
    if train.global_batch and train.global_batch != per_step * train.grad_accum:
        raise ConfigError(
            f"train.global_batch {train.global_batch} != batch_size {train.batch_size} x grad_accum "
            f"{train.grad_accum} x {world_size} GPU(s) = {per_step * train.grad_accum}; set grad_accum = 0 to derive it"
        )
    return train.grad_accum, per_step * train.grad_accum


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def open_dataset(cfg: Any, layout: Any, spec: Any, output_dir: Path, console: Any) -> LatentCache:
    manifest = cfg.data.manifest
    if not manifest:
        from tttvideo.data.demo import build_demo_cache

        demo_dir = Path(cfg.data.demo_dir) if cfg.data.demo_dir else output_dir / "data"
        manifest = build_demo_cache(demo_dir, layout, spec.in_channels, spec.text_embed_dim, cfg.data.demo_videos,
                                    seed=cfg.train.seed, text_encoder=cfg.data.demo_text_encoder, console=console)
    return LatentCache(manifest, layout, spec.in_channels, spec.text_embed_dim)


class Trainer:
    def __init__(self, cfg: Any, resume: bool = False, console: Any = None, quiet: bool = False):
        from rich.console import Console

        self.cfg = cfg
        self.train = cfg.train
        self.console = console or Console()
        self.quiet = quiet
        self.output_dir = Path(self.train.output_dir)
        self.device = resolve_device(self.train.device, "train.device")
        if self.train.precision == "fp16" and self.device.type == "cpu":
            raise ConfigError("train.precision 'fp16' needs a GPU (the gradient scaler is CUDA only); use 'bf16' or "
                              "'fp32' on CPU")
        if self.train.cpu_threads:
            torch.set_num_threads(self.train.cpu_threads)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 or cfg.parallel.data_parallel_shard > 1 or cfg.parallel.tensor_parallel > 1:
            raise UserError(
                f"tttv train runs in one process on one device; multi-GPU training (torchrun with WORLD_SIZE={world}, "
                f"parallel.data_parallel_shard={cfg.parallel.data_parallel_shard}, parallel.tensor_parallel="
                f"{cfg.parallel.tensor_parallel}) is not implemented yet: use one GPU with gradient accumulation "
                f"(configs/cogvideox-5b/*-1gpu.toml)"
            )
        self.world_size, self.rank = 1, 0
        self.grad_accum, self.global_batch = batch_plan(self.train, self.world_size)
        self.layout = layout_from_config(cfg)
        self.resume_from = self._checkpoint_to_resume(resume)

    # ------------------------------------------------------------------ setup
    def _checkpoint_to_resume(self, resume: bool) -> Path | None:
        latest = ckpt.latest_checkpoint(self.output_dir)
        if resume:
            if latest is None:
                self.console.print(f"--resume: no checkpoint in {ckpt.checkpoint_root(self.output_dir)}; starting at "
                                   f"step 0")
            return latest
        if latest is not None and self.train.overwrite:
            # only what a run writes; the demo set under output_dir/data is kept (it is reused when it matches)
            for name in ("checkpoints", "tensorboard", "samples", "metrics.jsonl"):
                path = self.output_dir / name
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            self.console.print(f"train.overwrite: removed the earlier run in {self.output_dir}")
            return None
        if latest is not None:
            raise UserError(
                f"{self.output_dir} already holds checkpoints (newest {latest.name}); pass --resume to continue that "
                f"run, set train.output_dir to a new folder, or set train.overwrite = true to start over"
            )
        return None

    def _build(self) -> None:
        from tttvideo.models import build_model, load_checkpoint

        seed_everything(self.train.seed)
        self.model = build_model(self.cfg, device=self.device)
        if self.train.init_from and self.resume_from is None:
            path = ckpt.resolve_init_from(self.train.init_from)
            load_checkpoint(self.model, path)
            self.console.print(f"initialised from {path}")
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.model, self.train)
        self.scheduler = build_scheduler(self.optimizer, self.train)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.train.precision == "fp16")
        self.schedule = ZeroSNRSchedule()
        self.noise = NoiseSource(self.train.seed, self.device)
        self.dataset = open_dataset(self.cfg, self.layout, self.model.spec, self.output_dir, self.console)
        self.step = 0
        self.nonfinite_skips = 0
        self.first_losses: list[float] = []
        self.last_good: Path | None = None
        if self.resume_from is not None:
            self._restore(self.resume_from)

    def _state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "data_position": self.step * self.global_batch,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": ckpt.rng_state(),
            "noise": self.noise.state(),
            "nonfinite_skips": self.nonfinite_skips,
            "first_losses": self.first_losses,
            "global_batch": self.global_batch,
        }

    def _restore(self, folder: Path) -> None:
        from tttvideo.models import load_checkpoint

        load_checkpoint(self.model, folder / ckpt.MODEL_FILE)
        state = ckpt.load_state(folder)
        if state["global_batch"] != self.global_batch:
            raise UserError(
                f"{folder} was trained with a global batch of {state['global_batch']}, this config has "
                f"{self.global_batch}; resuming would change the data order, keep the batch settings of the run"
            )
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        ckpt.set_rng_state(state["rng"])
        self.noise.load_state(state["noise"])
        self.step = state["step"]
        self.nonfinite_skips = state["nonfinite_skips"]
        self.first_losses = list(state["first_losses"])
        self.last_good = folder
        _truncate_metrics(self.output_dir / "metrics.jsonl", self.step)
        self.console.print(f"resumed from {folder} at step {self.step} (data position {state['data_position']})")

    def _save(self) -> Path:
        path = ckpt.save_training_checkpoint(self.output_dir, self.step, self.model, self._state(),
                                             dump_toml(self.cfg), self.train.keep_checkpoints)
        self.last_good = path
        return path

    # ------------------------------------------------------------------ loop
    def run(self) -> TrainResult:
        t_start = time.perf_counter()
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.toml").write_text(dump_toml(self.cfg), encoding="utf-8")
        self._build()
        total = self.train.steps
        result = TrainResult(self.output_dir, self.step, math.nan, math.nan)
        if self.step >= total:
            self.console.print(f"nothing to do: the run is at step {self.step} of {total}")
            return result
        loader = make_loader(self.dataset, self.train.seed, self.step, self.train.batch_size, self.grad_accum,
                             self.rank, self.world_size, self.cfg.data.num_workers,
                             pin_memory=self.device.type == "cuda")
        batches = iter(loader)
        tokens_per_step = self.global_batch * self.layout.total_tokens
        log_window: list[float] = []
        last_loss = math.nan
        monitor = TrainMonitor(self.output_dir, self.train, total, self.step, self.console,
                               config_to_dict(self.cfg), show=not self.quiet)
        with monitor:
            while self.step < total:
                t0 = time.perf_counter()
                lr_used = self.optimizer.param_groups[0]["lr"], _group_lr(self.optimizer, "ssm")
                loss, finite = self._optimizer_step(batches)
                if not finite:
                    self._handle_nonfinite(loss, monitor)
                self.step += 1
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                dt = time.perf_counter() - t0
                if finite:
                    last_loss = loss
                    log_window.append(loss)
                    if len(self.first_losses) < self.train.log_every:
                        self.first_losses.append(loss)
                monitor.step(self.step, {
                    "loss": loss if finite else float("nan"),
                    "lr": lr_used[0],
                    "lr_ssm": lr_used[1],
                    "grad_norm": self._last_grad_norm,
                    "step_time": dt,
                    "tokens_per_s": tokens_per_step / dt,
                    "memory_gib": memory_gib(self.device),
                })
                if self.step % self.train.checkpoint_every == 0 or self.step == total:
                    path = self._save()
                    result.checkpoints.append(path)
                    monitor.note(f"checkpoint {path}")
                if self.train.validate_every and self.step % self.train.validate_every == 0 and self.step < total:
                    video = self._sample_video(f"step-{self.step:06d}", monitor)
                    monitor.note(f"validation video {video}")
        if self.train.sample_at_end or self.train.validate_every:
            result.video = self._sample_video(f"step-{self.step:06d}", None)
        result.steps_done = self.step
        result.nonfinite_skips = self.nonfinite_skips
        result.first_loss = float(np.mean(self.first_losses)) if self.first_losses else math.nan
        tail = log_window[-self.train.log_every:]
        result.last_loss = float(np.mean(tail)) if tail else last_loss
        result.seconds = time.perf_counter() - t_start
        return result

    def _sample_video(self, tag: str, monitor: TrainMonitor | None) -> Path:
        """One video from the current weights with the captions (and scene cuts) of the data set's first sample:
        a prompt the model has trained on, so the video shows what it learned."""
        from tttvideo.sample.pipeline import sample_stories
        from tttvideo.sample.scenes import Scene, Story

        entry = self.dataset.entries[0]
        scenes = [Scene(text=c, requires_scene_transition=bool(i > 0 and start))
                  for i, (c, start) in enumerate(zip(entry.captions, entry.scene_start))]
        if len(scenes) != self.layout.num_segments:
            raise UserError(f"sample {entry.id!r} of {self.dataset.manifest} has no captions in the manifest; "
                            f"validation videos need them (set train.sample_at_end = false)")
        story = Story(name=tag, source=str(self.dataset.manifest), scenes=scenes)
        out = self.output_dir / "samples" / f"{tag}.mp4"
        if monitor is not None:  # the sampler draws its own bar; ours pauses meanwhile
            monitor.progress.stop()
        try:
            result = sample_stories(self.cfg, [story], out, model=self.model, console=self.console,
                                    progress=not self.quiet)[0]
        finally:
            if monitor is not None:
                monitor.progress.start()
        return result.video

    def _optimizer_step(self, batches: Any) -> tuple[float, bool]:
        """Accumulate grad_accum micro-batches and step; returns (mean loss, finite)."""
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        finite = True
        for micro in range(self.grad_accum):
            batch = to_device(next(batches), self.device)
            first = (micro * self.world_size + self.rank) * self.train.batch_size
            loss, _ = diffusion_loss(self.model, batch, self.schedule, self.noise, self.layout,
                                     self.train.text_dropout, first, self.global_batch, self.train.precision)
            value = loss.item()
            if not math.isfinite(value):
                finite = False
                total = value
                # the remaining micro-batches are still drawn so the data position and RNG streams stay aligned
                for _ in range(micro + 1, self.grad_accum):
                    next(batches)
                break
            total += value / self.grad_accum
            self.scaler.scale(loss / self.grad_accum).backward()
        self._last_grad_norm = float("nan")
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            with warnings.catch_warnings():  # a skipped step still advances the schedule; torch warns about that
                warnings.simplefilter("ignore", UserWarning)
                self.scheduler.step()
            return total, False
        self.scaler.unscale_(self.optimizer)
        if self.train.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.train.grad_clip)
        else:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.params if p.grad is not None]))
        self._last_grad_norm = float(norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        return total, True

    def _handle_nonfinite(self, loss: float, monitor: TrainMonitor) -> None:
        step = self.step + 1
        where = (f"the last good checkpoint is {self.last_good}" if self.last_good is not None
                 else "no checkpoint was written yet")
        if self.train.on_nonfinite == "skip" and self.nonfinite_skips < self.train.max_nonfinite_skips:
            self.nonfinite_skips += 1
            monitor.note(f"[yellow]step {step}: loss is {loss}; step skipped ({self.nonfinite_skips} of at most "
                         f"{self.train.max_nonfinite_skips})")
            return
        extra = (f" after {self.nonfinite_skips} skipped step(s) (train.max_nonfinite_skips)"
                 if self.train.on_nonfinite == "skip" else "")
        raise TrainingDiverged(
            f"loss is {loss} at step {step}{extra}; {where} (resume from it with --resume, perhaps with a lower "
            f"train.lr / train.lr_ssm or train.precision = 'fp32', or set train.on_nonfinite = 'skip')"
        )


def _group_lr(optimizer: torch.optim.Optimizer, kind: str) -> float:
    for g in optimizer.param_groups:
        if g.get("name", "").startswith(kind):
            return g["lr"]
    return 0.0


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines past the resumed step (written after the checkpoint by the interrupted process)."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
            if line.strip() and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(keep), encoding="utf-8")
