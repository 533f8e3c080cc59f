"""`tttv train`: the training loop of one stage.

One optimizer step (`tttvideo.train.step.TrainStep`) = `grad_accum` micro-batches of `batch_size` samples on each
GPU; the loss of each micro-batch is divided by `grad_accum` so the accumulated gradient is the mean over the
effective batch. Then: a non-finite check, gradient clipping, AdamW, the LR schedule. A non-finite loss stops the
run naming the last good checkpoint and the step's samples, or skips the step with a counter (`train.on_nonfinite`).
A cache file found damaged when it is read (unreadable, NaN / Inf) is passed over for another sample
(`tttvideo.data.loader`) with one warning naming it; past `data.max_damaged_samples` such files the run saves and
stops with one sentence.

Exact resume: model, optimizer, scheduler, scaler, every RNG and the step are restored from the newest checkpoint,
and the data order is a pure function of (seed, data position) (`tttvideo.data.loader`), so a resumed run computes
bit for bit what the uninterrupted run would have (on the same hardware and software).

Memory: `memory.max_gpu_gib` caps the CUDA allocator (`tttvideo.memory.guard.cap`), the step is assembled with the
config's memory techniques (`tttvideo.train.step.build_train_step`), and a CUDA out-of-memory error in a step stops
the run with one sentence (`tttvideo.memory.guard.oom`): the phase and block it hit, the newest checkpoint, and the
switches that would make room.

Run safety: the run folder is locked for the whole run (`tttvideo.locks`), an earlier run in it is resumed, kept or
deleted only as `train.if_exists` (or --resume / --new / --overwrite) says, damaged checkpoints are passed over
(`checkpoint.newest_intact_checkpoint`), SIGINT / SIGTERM finish the step and save before stopping, and
metrics.jsonl and TensorBoard hold each step once, whatever was logged after the checkpoint a run resumes from.

Under torchrun (WORLD_SIZE > 1, `tttvideo.train.distributed`): the model is sharded with FSDP2 and runs with the
sequence parallelism of `[parallel]`, each data-parallel rank reads its own samples and draws the noise one process
would draw for them, so the losses equal a one-process run's at the same global batch; rank 0 holds the run
folder's lock, prints, and writes the logs; checkpoints go through torch.distributed.checkpoint
(`tttvideo.train.dcp`) and resume on another number of processes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tttvideo.config.batch import batch_plan
from tttvideo.config.loader import config_to_dict, dump_toml
from tttvideo.config.schema import Config, TrainConfig
from tttvideo.data.loader import DamagedFiles, make_loader
from tttvideo.errors import ConfigError, UserError
from tttvideo.memory.guard.cap import apply_memory_cap
from tttvideo.memory.guard.oom import OomWatch, train_oom_error
from tttvideo import runs
from tttvideo.train import checkpoint as ckpt
from tttvideo.train import runfolder
from tttvideo.train.stop import StopSignals, TrainingStopped, uninterrupted
from tttvideo.train.loss import NoiseSource, TimestepDensity
from tttvideo.train.ema import WeightAverage
from tttvideo.train.dcp import (check_trained_parameters, holds_model_state, is_sharded_checkpoint,
                                load_sharded_checkpoint, load_whole_optimizer_state, save_sharded_checkpoint)
from tttvideo.memory.guard.disk import checkpoint_disk
from tttvideo.memory.techniques import FP8_STREAMING, ModelBytes, check_techniques
from tttvideo.parallel.launch import launch_world_size
from tttvideo.train.distributed import SharedError, TrainRanks, rank_device
from tttvideo.train.monitor import SilentMonitor, TrainMonitor, host_gib, memory_gib, reserved_gib, truncate_metrics
from tttvideo.train.optim import group_lr, is_ssm_group, schedule_change
from tttvideo.train.step import build_train_step, synchronize
from tttvideo.device import resolve_device
from tttvideo.dtypes import torch_dtype
from tttvideo.models.backbone import get_preset, layout_of


log = logging.getLogger(__name__)
CHANGES_SHOWN = 8  # settings changed since the checkpoint, named when a run resumes

class TrainingDiverged(SharedError):
    """The loss became NaN or Inf. Under torchrun every rank raises it after the same step (they agree whether a
    loss is finite), so rank 0 alone prints it."""


class DamagedData(SharedError):
    """More cache files were found damaged mid-run than data.max_damaged_samples allows; the run saved and stopped.
    Under torchrun the ranks agree on it after the same step."""


@dataclass
class TrainResult:
    output_dir: Path
    steps_done: int
    first_loss: float
    last_loss: float
    # steps in each of the two means above: log_every, fewer on a run too short for two windows that do not overlap
    loss_window: int = 0
    checkpoints: list[Path] = field(default_factory=list)
    nonfinite_skips: int = 0
    seconds: float = 0.0
    video: Path | None = None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    def __init__(self, cfg: Config, resume: bool = False, console: Any = None, quiet: bool = False,
                 if_exists: str | None = None, trust_checkpoint: bool = False):
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
        check_techniques(cfg, launch_world_size())
        # under torchrun: the process group, the mesh, this rank's GPU; with one process nothing changes
        self.device = rank_device(self.device)
        apply_memory_cap(cfg.memory, self.device)
        self.ranks = TrainRanks.start(cfg, get_preset(cfg.model.preset).num_attention_heads, self.device)
        if not self.ranks.is_main:  # rank 0 alone speaks and writes logs
            self.console, self.quiet = Console(quiet=True), True
        # the global batch is data-parallel ranks wide: the ranks of a sequence-parallel group share their samples
        self.grad_accum, self.global_batch = batch_plan(self.train, self.ranks.dp_size)
        self.layout = layout_of(cfg)
        # what to do with an earlier run in output_dir: --resume (resume=True) or train.if_exists
        self.if_exists = if_exists or ("resume" if resume else self.train.if_exists)
        if self.if_exists not in runfolder.IF_EXISTS:
            raise ConfigError(f"if_exists {self.if_exists!r}: expected one of {', '.join(runfolder.IF_EXISTS)}")
        # run() takes the run folder's lock and decides again under it
        self.ranks.on_main(lambda: runfolder.check_before_work(cfg, self.output_dir, self.if_exists))
        # under torchrun every rank runs the sampler (an FSDP-sharded model's forward gathers from all); rank 0 writes
        self.videos = bool(self.train.sample_at_end or self.train.validate_every)
        if self.videos:
            from tttvideo.outputs import check_mp4_writer

            check_mp4_writer("train.sample_at_end / train.validate_every (set them to false and 0 to train without "
                             "videos)")
        self.resume_from: Path | None = None
        # --trust-checkpoint: a checkpoint file that only the full unpickler reads may be read (docs/security.md)
        self.trust_checkpoint = trust_checkpoint

    # ------------------------------------------------------------------ setup
    def _build(self, stack: contextlib.ExitStack | None = None) -> None:
        from tttvideo.models import build_model, load_checkpoint
        from tttvideo.models.weights import trained_duration

        seed_everything(self.train.seed)
        self.model = build_model(self.cfg, device=self.device)
        # the longest video these weights have trained on, kept in every checkpoint (the sampler warns past it)
        self.trained_duration_s = self.layout.duration_s
        if self.train.init_from and self.resume_from is None:
            path = ckpt.resolve_init_from(self.train.init_from)
            runs.load_trained(self.model, path, has_base=bool(self.cfg.model.pretrained_path))
            ema_file = runs.ema_file_beside(path)
            if ema_file is not None:  # the previous stage's averaged weights are the ones it would sample with
                load_checkpoint(self.model, ema_file)
            self.trained_duration_s = max(self.trained_duration_s, trained_duration(path) or 0)
            self.console.print(f"initialised from {path}" + (f" with its EMA weights ({ema_file.name})"
                                                             if ema_file is not None else ""))
        if (self.resume_from is not None and is_sharded_checkpoint(self.resume_from)
                and not holds_model_state(self.resume_from, self.trust_checkpoint)):
            # a sharded checkpoint keeps the model's parameters once, whole, in its model file: read before FSDP
            # shards the model; dcp/ holds the optimizer's shards and the buffers (fp8 codes) the file leaves out
            load_checkpoint(self.model, self.resume_from / ckpt.MODEL_FILE)
        elif self.resume_from is not None and self.ranks.distributed:
            # a one-process checkpoint resumed by several: its model file read before FSDP shards the model (a
            # partial file, fp8 frozen weights, gets its frozen layers from where the run started), the optimizer's
            # whole state into the shards in `_restore`
            runs.load_trained(self.model, self.resume_from / ckpt.MODEL_FILE,
                              has_base=bool(self.cfg.model.pretrained_path))
        self.model.train()
        self.ranks.shard(self.model, None if self.train.precision == "fp32" else torch_dtype(self.train.precision))
        self.noise = NoiseSource(self.train.seed, self.device, TimestepDensity.from_config(self.train))
        self.oom_watch = self.ranks.phases(OomWatch(self.model))  # under torchrun the watch sees the phases too
        self.train_step = build_train_step(self.cfg, self.model, self.device, self.layout, self.noise,
                                           global_batch=self.global_batch, grad_accum=self.grad_accum,
                                           ranks=self.ranks, scheduled=True, profiler=self.oom_watch)
        self.optimizer, self.scheduler = self.train_step.optimizer, self.train_step.scheduler
        self.scaler = self.train_step.scaler
        # the average of the weights the optimizer updates, from those the run starts with
        self.ema = WeightAverage(self.model, self.train.ema_decay) if self.train.ema_decay > 0 else None
        moved = self.train_step.prepared.get(FP8_STREAMING.name, 0)
        if moved:
            self.console.print(f"frozen fp8 weights streamed from pinned host memory: {moved / 2**30:.2f} GiB off "
                               f"the GPU")
        self._open_dataset(stack)
        self.step = 0
        self.nonfinite_skips = 0
        self.damaged = DamagedFiles(self.dataset, self.cfg.data.max_damaged_samples)
        self.first_losses: list[float] = []
        self.last_good: Path | None = None
        while self.resume_from is not None:
            try:
                self._restore(self.resume_from)
                break
            except UserError:
                raise
            except Exception as err:
                # the manifest vouches for a checkpoint's files, so a load error there is a bug to report; one
                # written before manifests were (headers checked only) may be damaged deeper: use an older one
                if runs.read_manifest(self.resume_from) is not None:
                    raise
                log.warning("checkpoint %s cannot be loaded (%s: %s); trying the one before it", self.resume_from,
                            type(err).__name__, err)
                bad = self.resume_from
                newer = tuple(p for _, p in runs.step_folders(self.output_dir) if p.name >= bad.name)
                self.resume_from = runs.newest_intact_checkpoint(
                    self.output_dir, exclude=newer, advice="start over with --overwrite or beside it with --new")
                if self.resume_from is None:
                    raise UserError(f"{self.output_dir} has no loadable checkpoint ({bad.name}: {type(err).__name__}: "
                                    f"{err}); start over with --overwrite or beside it with --new") from None

    def _open_dataset(self, stack: contextlib.ExitStack | None) -> None:
        """Rank 0 first (it may build the demo set), then the others, which only read it."""
        def open_here() -> None:
            self.dataset = runfolder.open_dataset(self.cfg, self.layout, self.model.spec, self.output_dir,
                                                  self.console, stack)

        self.ranks.on_main(open_here)
        if not self.ranks.is_main:
            open_here()

    def _state(self) -> dict[str, Any]:
        state = {
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
        if self.ema is not None:
            state["ema"] = self.ema.state()
        if self.ranks.distributed:  # the sharded optimizer state goes into dcp/
            del state["optimizer"]
        return state

    def _restore(self, folder: Path) -> None:
        from tttvideo.models.weights import trained_duration

        peaks = [group["initial_lr"] for group in self.optimizer.param_groups]  # this config's; loading replaces them
        sharded = is_sharded_checkpoint(folder)
        saved_config = runs.saved_config(folder)  # what the run was trained with, to compare this config with
        saved_optimizer = _saved_optimizer(saved_config)
        converts = saved_optimizer not in (None, self.train.optimizer)
        if converts and sharded:
            raise (SharedError if self.ranks.distributed else UserError)(
                f"{folder} holds the state of train.optimizer = '{saved_optimizer}' in shards, this config has "
                f"'{self.train.optimizer}': resume it with train.optimizer = '{saved_optimizer}', or start a new "
                f"stage from it with train.init_from = '{folder}' (the optimizer state starts fresh)")
        if sharded:
            load_sharded_checkpoint(folder, self.model, self.optimizer, trust=self.trust_checkpoint)
        elif not self.ranks.distributed:  # a partial file (fp8 frozen weights) gets its frozen layers from the base
            runs.load_trained(self.model, folder / ckpt.MODEL_FILE, has_base=bool(self.cfg.model.pretrained_path))
        self.trained_duration_s = max(self.layout.duration_s, trained_duration(folder / ckpt.MODEL_FILE) or 0)

        kept: dict[str, Any] = {}  # rank 0's whole optimizer state of a one-process checkpoint, not sent

        def read_state() -> dict[str, Any]:
            state = ckpt.load_state(folder, trust=self.trust_checkpoint)
            if self.ranks.distributed and "optimizer" in state:  # the other ranks read it themselves below
                kept["optimizer"] = state.pop("optimizer")
            return state

        # rank 0 alone reads it (an earlier version's state.pt is converted in place) and gives it to every rank
        state = self.ranks.on_main(read_state)
        if "imported" in state:  # tttv convert's: weights only
            raise UserError(f"{folder} was imported by tttv convert and holds no training state to resume; start "
                            f"a new run from it with train.init_from = '{folder.parent.parent}'")
        if state["global_batch"] != self.global_batch:
            raise UserError(
                f"{folder} was trained with a global batch of {state['global_batch']}, this config has "
                f"{self.global_batch}; resuming would change the data order, keep the batch settings of the run"
            )
        if "optimizer" in state and not converts:  # a sharded checkpoint's is in dcp/
            check_trained_parameters(folder, [len(g["params"]) for g in state["optimizer"]["param_groups"]],
                                     [len(g["params"]) for g in self.optimizer.param_groups])
            self.optimizer.load_state_dict(state["optimizer"])
        elif not sharded:  # several processes share it out, or another optimizer's state is converted
            whole = (state.get("optimizer") or kept.get("optimizer")
                     or ckpt.load_state(folder, trust=self.trust_checkpoint)["optimizer"])
            load_whole_optimizer_state(folder, self.model, self.optimizer, whole)
            if converts:
                self.console.print(f"the optimizer state of train.optimizer = '{saved_optimizer}' in {folder} "
                                   f"continues as '{self.train.optimizer}''s (its moments converted)")
        self.scheduler.load_state_dict(state["scheduler"])
        self._keep_configured_peaks(folder, peaks)
        self.scaler.load_state_dict(state["scaler"])
        ckpt.set_rng_state(state["rng"])
        self.noise.load_state(state["noise"])
        self.step = state["step"]
        self.nonfinite_skips = state["nonfinite_skips"]
        self.first_losses = list(state["first_losses"])
        self.last_good = folder
        if self.ema is not None:
            self._restore_ema(folder, state)
        self.console.print(f"resumed from {folder} at step {self.step} (data position {state['data_position']})")
        if self.ranks.is_main:
            changes = ckpt.config_changes(saved_config, config_to_dict(self.cfg))
            if changes:
                shown = "; ".join(changes[:CHANGES_SHOWN]) + (f"; and {len(changes) - CHANGES_SHOWN} more"
                                                              if len(changes) > CHANGES_SHOWN else "")
                self.console.print(f"settings other than the run's: {shown}")
            _warn_changed_schedule(folder, saved_config, self.train, self.step)

    def _keep_configured_peaks(self, folder: Path, peaks: list[float]) -> None:
        """This config's learning-rate peaks (train.lr, train.lr_ssm) for the resumed schedule: the checkpoint's
        optimizer groups and scheduler carry the peaks its run was started with, which replaced a changed train.lr
        without a word. One warning naming the change."""
        saved = list(self.scheduler.base_lrs)
        if saved == peaks:
            return
        step = self.scheduler.last_epoch
        self.scheduler.base_lrs = list(peaks)
        for group, peak, multiplier in zip(self.optimizer.param_groups, peaks, self.scheduler.lr_lambdas):
            group["initial_lr"], group["lr"] = peak, peak * multiplier(step)
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        if self.ranks.is_main:
            changes = sorted({f"{'train.lr_ssm' if is_ssm_group(g) else 'train.lr'} {old:g} -> {new:g}"
                              for g, old, new in zip(self.optimizer.param_groups, saved, peaks) if old != new})
            log.warning("%s was trained with other learning-rate peaks (%s): from step %d on the rates follow this "
                        "config's schedule", folder, ", ".join(changes), step + 1)

    def _restore_ema(self, folder: Path, state: dict[str, Any]) -> None:
        ema_file = folder / ckpt.EMA_FILE
        if "ema" in state and ema_file.is_file():
            try:
                self.ema.load(ema_file, state["ema"])
            except UserError as err:  # every rank reads the same file: rank 0 says it
                raise (SharedError(str(err)) if self.ranks.distributed else err) from None
            if state["ema"]["decay"] != self.ema.decay:
                log.warning("train.ema_decay is %g but %s averaged with %g; the average continues at %g",
                            self.ema.decay, folder, state["ema"]["decay"], self.ema.decay)
            return
        # EMA switched on for a run that trained without it: the average starts from the resumed weights
        log.warning("%s holds no EMA weights (train.ema_decay was 0); the average starts from its weights",
                    folder)
        self.ema = WeightAverage(self.model, self.train.ema_decay)

    @uninterrupted  # a second SIGTERM / SIGINT waits for the save to end
    def _save(self) -> Path:
        meta = {"data_position": self.step * self.global_batch, "global_batch": self.global_batch,
                "tttvideo": _version(), "torch": torch.__version__}
        if self.ranks.distributed:
            meta["processes"] = self.ranks.world_size
            self.last_good = save_sharded_checkpoint(
                self.output_dir, self.step, self.model, self.optimizer, self._state(), dump_toml(self.cfg),
                self.train.keep_checkpoints, meta, self.trained_duration_s, self.ranks, ema=self.ema)
            return self.last_good
        path = ckpt.save_training_checkpoint(self.output_dir, self.step, self.model, self._state(),
                                             dump_toml(self.cfg), self.train.keep_checkpoints, meta,
                                             trained_duration_s=self.trained_duration_s, ema=self.ema)
        self.last_good = path
        return path

    # ------------------------------------------------------------------ loop
    def run(self) -> TrainResult:
        """Lock the run folder, act on an earlier run there (train.if_exists), train, and let the folder go."""
        with contextlib.ExitStack() as stack:
            if self.train.cpu_threads:  # for this run: a notebook's or a test's process gets its own count back
                stack.callback(torch.set_num_threads, torch.get_num_threads())
                torch.set_num_threads(self.train.cpu_threads)
            # rank 0 holds the lock and decides; the others wait for its decision
            folder, self.resume_from = self.ranks.on_main(
                lambda: runfolder.claim(self.output_dir, self.if_exists, stack, self.console))
            if folder != self.output_dir:  # if_exists = 'new' moved beside it
                self.output_dir = folder
                self.train.output_dir = str(folder)  # the config saved with the run says where it is
            result = self._run(stack)
        self.ranks.close()
        return result

    def _run(self, stack: contextlib.ExitStack) -> TrainResult:
        t_start = time.perf_counter()
        if self.ranks.is_main:
            (self.output_dir / "config.toml").write_text(dump_toml(self.cfg), encoding="utf-8")
        self._build(stack)
        # the log holds what the checkpoint holds: the lines of steps after it (written by a run that was killed
        # before its next checkpoint, or all of them at step 0) go; TensorBoard drops them by its purge_step
        if self.ranks.is_main:
            truncate_metrics(self.output_dir / "metrics.jsonl", self.step)
        total = self.train.steps
        self.first_step = self.step  # an out-of-memory error here is one `tttv train --auto-fit` re-plans
        result = TrainResult(self.output_dir, self.step, math.nan, math.nan)
        if self.step >= total:
            self.console.print(f"nothing to do: the run is at step {self.step} of {total}")
            return result
        # what its checkpoints take on the disk (`memory.guard.disk`): said now if the disk cannot hold them
        self.disk = checkpoint_disk(ModelBytes.of(self.model), self.cfg, self.ranks.world_size)
        self.ranks.on_main(lambda: ckpt.warn_if_short(self.output_dir, self.disk))
        loader = make_loader(self.dataset, self.train.seed, self.step, self.train.batch_size, self.grad_accum,
                             self.ranks.dp_rank, self.ranks.dp_size, self.cfg.data.num_workers,
                             pin_memory=self.device.type == "cuda")
        batches = self.damaged.watch(iter(loader))
        tokens_per_step = self.global_batch * self.layout.total_tokens
        log_window: list[float] = []
        last_loss = math.nan
        monitor = (TrainMonitor(self.output_dir, self.train, total, self.step, self.console,
                                config_to_dict(self.cfg), show=not self.quiet)
                   if self.ranks.is_main else SilentMonitor())
        with monitor, StopSignals() as stop:
            while self.step < total:
                t0 = time.perf_counter()
                lr_used = self.optimizer.param_groups[0]["lr"], group_lr(self.optimizer, ssm=True)
                self.damaged.read.clear()  # the samples of this step, named if its loss is not finite
                try:
                    done = self.train_step(batches, self.step)
                except torch.cuda.OutOfMemoryError as err:
                    raise train_oom_error(err, self.cfg, self.model, self.oom_watch, self.last_good) from None
                loss, finite = done.loss, done.finite
                t_ema = time.perf_counter()
                if not finite:
                    self._handle_nonfinite(loss, monitor)
                elif self.ema is not None:  # a skipped step left the weights as they were
                    self.ema.update()
                self.step += 1
                synchronize(self.device)
                t_end = time.perf_counter()
                dt = t_end - t0
                if finite:
                    last_loss = loss
                    log_window.append(loss)
                    if len(self.first_losses) < self.train.log_every:
                        self.first_losses.append(loss)
                # under torchrun, the largest of any rank's (rank 0 alone writes the metrics)
                peak, reserved, host = self.ranks.largest_floats([memory_gib(self.device), reserved_gib(self.device),
                                                                  host_gib()])
                monitor.step(self.step, {
                    "loss": loss if finite else float("nan"),
                    "lr": lr_used[0],
                    "lr_ssm": lr_used[1],
                    "grad_norm": done.grad_norm,
                    "step_time": dt,
                    # where it went beside the model's forward and backward (the rest of step_time)
                    "data_s": done.data_s,
                    "optimizer_s": done.optimizer_s,
                    "ema_s": t_end - t_ema if finite and self.ema is not None else 0.0,
                    "tokens_per_s": tokens_per_step / dt,
                    "memory_gib": peak,
                    "memory_reserved_gib": reserved,
                    "host_gib": host,
                })
                saved = self.step % self.train.checkpoint_every == 0 or self.step == total
                if saved:
                    t_save = time.perf_counter()
                    self.ranks.on_main(lambda: ckpt.make_room_for(self.output_dir, self.disk.each))
                    path = self._save()
                    result.checkpoints.append(path)
                    monitor.note(f"checkpoint {path} ({time.perf_counter() - t_save:.1f} s)")
                # too many damaged cache files on any rank: all save this step and stop
                if self.ranks.largest(int(self.damaged.too_many)):
                    path = result.checkpoints[-1] if saved else self._save()
                    raise DamagedData(self.damaged.stop_message(path, self.step, total))
                # a signal to any rank stops them all after the same step (the save is a collective)
                signum = self.ranks.largest(stop.signum or 0) or None  # the identity with one process
                if signum is not None:  # SIGINT / SIGTERM: this step is done; save it and stop
                    if saved:
                        path = result.checkpoints[-1]
                    else:
                        path = self._save()
                        monitor.note(f"checkpoint {path}")
                    raise TrainingStopped(signum, self.step, total, path, self.output_dir)
                every = self.train.validate_every
                if self.videos and every and self.step % every == 0 and self.step < total:
                    video = self._sample_video(f"step-{self.step:06d}", monitor)
                    if video is not None:
                        monitor.note(f"validation video {video}")
        if self.videos:
            result.video = self._sample_video(f"step-{self.step:06d}", None)
        result.steps_done = self.step
        result.nonfinite_skips = self.nonfinite_skips
        # the two windows must not share steps, or a short run compares a loss with itself
        window = min(len(self.first_losses), len(log_window) or 1, self.train.log_every, max(1, self.step // 2))
        result.loss_window = window
        result.first_loss = float(np.mean(self.first_losses[:window])) if self.first_losses else math.nan
        tail = log_window[-window:]
        result.last_loss = float(np.mean(tail)) if tail else last_loss
        result.seconds = time.perf_counter() - t_start
        return result

    def _sample_video(self, tag: str, monitor: TrainMonitor | SilentMonitor | None) -> Path | None:
        """One video from the current weights with the captions (and scene cuts) of the data set's first sample:
        a prompt the model has trained on, so the video shows what it learned. Under torchrun every rank runs the
        sampler on the whole sequence (the forward of an FSDP-sharded model gathers each block's weights from all
        of them) and rank 0 alone decodes and writes: its path there, None on the others."""
        from tttvideo.parallel.watchdog import active_watch
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
        # the sampler draws its own bar; ours pauses meanwhile (a rank other than 0 has none: SilentMonitor)
        bar = monitor.progress if isinstance(monitor, TrainMonitor) else None
        if bar is not None:
            bar.stop()
        averaged = self.ema is not None and self.cfg.sample.use_ema
        watch = active_watch()
        try:
            # not bounded: a long video takes minutes, and the ranks that do not decode wait for rank 0 after it
            with (self.ema.swapped_in() if averaged else contextlib.nullcontext(),
                  watch.phase("sampling a video", bounded=False) if watch else contextlib.nullcontext()):
                results = sample_stories(self.cfg, [story], out, model=self.model, console=self.console,
                                         progress=not self.quiet, writes=self.ranks.is_main)
                self.ranks.barrier()
        finally:
            if bar is not None:
                bar.start()
        return results[0].video if results else None

    def _handle_nonfinite(self, loss: float, monitor: TrainMonitor | SilentMonitor) -> None:
        step = self.step + 1
        rank = f" on rank {self.ranks.rank}" if self.ranks.distributed else ""
        samples = f"; the step read sample(s){rank} {self.damaged.samples_read()}" if self.damaged.read else ""
        if self.train.on_nonfinite == "skip" and self.nonfinite_skips < self.train.max_nonfinite_skips:
            self.nonfinite_skips += 1
            monitor.note(f"[yellow]step {step}: loss is {loss}; step skipped ({self.nonfinite_skips} of at most "
                         f"{self.train.max_nonfinite_skips}){samples}")
            return
        change = "a lower train.lr / train.lr_ssm or train.precision = 'fp32'"
        if self.train.on_nonfinite == "skip":
            extra = f" after {self.nonfinite_skips} skipped step(s) (train.max_nonfinite_skips)"
            change += ", or a larger train.max_nonfinite_skips"
        else:
            extra = ""
            change += ", or train.on_nonfinite = 'skip'"
        if self.last_good is not None:
            where = (f"the last good checkpoint is {self.last_good} (resume from it with --resume, perhaps with "
                     f"{change})")
        else:
            where = f"no checkpoint was written yet: start the run over with --overwrite, perhaps with {change}"
        raise TrainingDiverged(f"loss is {loss} at step {step}{extra}; {where}{samples}")


def _train_table(saved: dict[str, Any]) -> dict[str, Any]:
    """The [train] table of a checkpoint's saved config (`runs.saved_config`); empty when it has none."""
    table = saved.get("train")
    return table if isinstance(table, dict) else {}


def _saved_optimizer(saved: dict[str, Any]) -> str | None:
    """The train.optimizer of a checkpoint's saved config (the default when it does not say), or None without
    one."""
    table = _train_table(saved)
    return str(table.get("optimizer", TrainConfig().optimizer)) if table else None


def _warn_changed_schedule(folder: Path, saved: dict[str, Any], train: TrainConfig, step: int) -> None:
    """One warning when train.steps differs from the steps the checkpoint's run was scheduled for (`saved`, its
    config): resuming is allowed (training a run for longer is common), but the learning rates jump to the new
    schedule's."""
    try:
        before = int(_train_table(saved)["steps"])
    except (ValueError, KeyError, TypeError):
        return  # no readable config beside the checkpoint: nothing to compare with
    change = schedule_change(before, train, step)
    if change:
        log.warning("train.steps is %d but %s was trained on a schedule of %d steps: %s", train.steps, folder, before,
                    change)


def _version() -> str:
    from tttvideo import __version__

    return __version__
