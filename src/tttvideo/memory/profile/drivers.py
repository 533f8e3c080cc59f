"""What `tttv profile CONFIG --phase train|sample` runs under the profiler, and the report it leaves.

train: the trainer's own optimizer step, as `tttvideo.train.step.build_train_step` assembles it (the memory
techniques of the config applied, the fp8 weight streaming inside a component of its own) on the model of
`build_model(cfg)` (preset, dtype, adapter, checkpointing), the optimizer with the trainer's parameter groups,
random latents and text features standing in for the latent cache (training reads the cache; the text encoder and
the VAE are never on the GPU then): the diffusion objective (v-prediction MSE on ZeroSNR, under train.precision
autocast), backward through the gradient scaler, clipping and the optimizer step, each phase marked from inside the
step. One micro-batch per step: accumulation adds nothing to the peak, gradients persist across
micro-batches either way.

sample: one story as `tttv sample` runs it (`tttvideo.sample`): `load_model` (block offload if
configured), `denoise` (the configured solver and guidance, `--steps` steps), the transformer released, the VAE
decode (the identity decode when no VAE folder is configured).

`memory.max_gpu_gib` caps the CUDA allocator before either runs. Components are recorded as they load, every
transformer block through hooks, one phase per stage. Random inputs are enough: memory depends on shapes and dtypes,
not on values.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tttvideo.config.schema import Config, MemoryConfig
from tttvideo.errors import UserError
from tttvideo.memory.profile.profiler import MemoryProfiler, is_oom
from tttvideo.memory.profile.report import write_report

if TYPE_CHECKING:
    import torch

    from tttvideo.layout import VideoLayout
    from tttvideo.models.backbone import Backbone

PHASES = ("train", "sample")
# Exit status of a profile that ran out of memory; its report is complete and says where (the matrix reads it).
EXIT_OOM = 3


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _resolve_device(cfg: Config, device: str) -> torch.device:
    """--device wins; 'auto' falls back to the config's train.device, then to what is visible."""
    from tttvideo.device import resolve_device

    if device == "auto":
        device = cfg.train.device
    return resolve_device(device, "--device")


def _inputs(cfg: Config, model: Backbone, layout: VideoLayout, batch: int,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random latents [B, T, C, h, w] and text features [B, segments, tokens, dim] in the cache dtype."""
    import torch

    from tttvideo.dtypes import torch_dtype

    spec = model.spec
    dtype = torch_dtype(cfg.data.cache_dtype)
    latents = torch.randn(batch, layout.latent_frames, spec.in_channels, layout.latent_height, layout.latent_width,
                          device=device).to(dtype)
    text = torch.randn(batch, layout.num_segments, layout.text_tokens, spec.text_embed_dim, device=device).to(dtype)
    return latents, text


def _build(cfg: Config, prof: MemoryProfiler, device: torch.device, train: bool) -> Backbone:
    from tttvideo.memory.techniques import check_techniques
    from tttvideo.models import build_model

    if train:
        check_techniques(cfg, 1)  # the profiler runs one process
    with prof.component("transformer") as info:
        model = build_model(cfg, device=device)
        info["counted_bytes"] = _tensor_bytes(model.parameters()) + _tensor_bytes(model.buffers())
    trainable = [p for p in model.parameters() if p.requires_grad]
    prof.meta["parameters"] = {"total": sum(p.numel() for p in model.parameters()),
                               "trainable": sum(p.numel() for p in trainable) if train else 0}
    if not train:
        model.requires_grad_(False)
    return model


class _TrainPhases:
    """The step's phases as profiler phases, with marks around each forward and what the first step allocates for
    good recorded as components: the gradients (after its backward) and the optimizer state (inside its optimizer
    phase). `optimizer` is the step's, set once the step is assembled."""

    def __init__(self, prof: MemoryProfiler):
        self.prof = prof
        self.optimizer: torch.optim.Optimizer | None = None

    @contextlib.contextmanager
    def phase(self, name: str, step: int | None = None) -> Iterator[None]:
        from tttvideo.train.step import BACKWARD, FORWARD, OPTIMIZER

        if name == FORWARD:
            self.prof.mark(f"before forward {step}")
        with self.prof.phase(name, step=step):
            if name == OPTIMIZER and step == 0:
                with self.prof.component("optimizer state") as info:
                    yield
                    info["counted_bytes"] = self._optimizer_state_bytes()
            else:
                yield
        if name == FORWARD:
            self.prof.mark(f"after forward {step}")
        elif name == BACKWARD and step == 0:
            self.prof.add_component("gradients", _tensor_bytes(
                p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None))

    def _optimizer_state_bytes(self) -> int:
        import torch

        return _tensor_bytes(v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v))


def drive_train(cfg: Config, prof: MemoryProfiler, steps: int, device: torch.device) -> None:
    import torch

    from tttvideo.models.backbone import layout_of
    from tttvideo.train.loss import NoiseSource
    from tttvideo.train.step import build_train_step

    train = cfg.train
    layout = layout_of(cfg)
    torch.manual_seed(train.seed)
    model = _build(cfg, prof, device, train=True)
    batch_size = int(train.batch_size)
    phases = _TrainPhases(prof)
    train_step = build_train_step(cfg, model, device, layout, NoiseSource(train.seed, device),
                                  global_batch=batch_size, profiler=phases, around_prepare=prof.component)
    phases.optimizer = train_step.optimizer
    # The adapter's trainable parameters live inside the transformer's load; listed by count, not added again.
    prof.add_component(f"trainable parameters ({cfg.model.adapter}, inside transformer)",
                       _tensor_bytes(p for p in model.parameters() if p.requires_grad))
    model.train()
    prof.attach_block_hooks(list(model.blocks))
    with prof.component("inputs (cached latents + text features)"):
        latents, text = _inputs(cfg, model, layout, batch_size, device)
    batch = {"latents": latents, "text": text}
    for step in range(steps):
        done = train_step(iter((batch,)), step)
        prof.meta.setdefault("loss", []).append(done.loss)
        prof.end_step(f"training step {step + 1}/{steps}")
    train_step.optimizer.zero_grad(set_to_none=True)
    prof.mark("gradients released")


def drive_sample(cfg: Config, prof: MemoryProfiler, steps: int, device: torch.device) -> None:
    """As `tttv sample` runs one story, minus the text encoder (the sampler releases it before the transformer
    loads, so it never adds to this peak): transformer (with block offload if configured), the solver loop, the
    transformer released, then the VAE decode."""
    import copy
    import gc

    import torch

    from tttvideo.models.backbone import layout_of
    from tttvideo.sample.guidance import denoise
    from tttvideo.sample.model import load_model
    from tttvideo.sample.pipeline import make_story_decoder

    cfg = copy.deepcopy(cfg)
    cfg.sample.steps = steps
    layout = layout_of(cfg, phase="sample")
    torch.manual_seed(cfg.sample.seed)
    with prof.component("transformer") as info:
        loaded = load_model(cfg, None, device, offload=cfg.sample.offload_blocks)
        model = loaded.model
        info["counted_bytes"] = _tensor_bytes(model.parameters()) + _tensor_bytes(model.buffers())
    prof.meta["parameters"] = {"total": sum(p.numel() for p in model.parameters()), "trainable": 0}
    prof.attach_block_hooks(list(model.blocks), backward=False)
    spec = model.spec
    with prof.component("text features (cond + uncond)"):
        cond = torch.randn(layout.num_segments, layout.text_tokens, spec.text_embed_dim)
        uncond = torch.zeros_like(cond)
    with prof.phase("denoise"):
        latents = denoise(model, layout, cond, uncond, cfg.sample, device,
                          on_step=lambda i, n: prof.end_step(f"denoise step {i + 1}/{n}"))
    prof.detach_hooks()
    with prof.component("transformer released"):
        loaded.close()
        del model, loaded
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    vae_path = cfg.sample.vae_path or cfg.data.vae_path
    with prof.component("VAE" if vae_path else "VAE (identity decode: no sample.vae_path)"):
        decoder = make_story_decoder(cfg, device)
    with prof.phase("VAE decode"):
        frames = 0
        for chunk in decoder.frames(latents):
            frames += int(chunk.shape[2])
            del chunk
    prof.meta["decoded_frames"] = frames


DRIVERS: dict[str, Callable[[Config, MemoryProfiler, int, torch.device], None]] = {"train": drive_train,
                                                                                 "sample": drive_sample}


def profile(cfg: Config, phase: str, steps: int, out_dir: str | Path, *, device: str = "auto", snapshot: bool = False,
            trace: bool = False, meta: dict[str, Any] | None = None) -> tuple[dict[str, Any], int]:
    """Run one driver under a fresh profiler and write the report folder. Returns (summary dict, exit status):
    0 ok, EXIT_OOM when the pipeline ran out of memory (the report then says where). Other errors propagate after
    the partial report is written."""
    from tttvideo.config.loader import config_to_dict

    if phase not in DRIVERS:
        raise UserError(f"unknown profile phase {phase!r}; use one of {', '.join(PHASES)}")
    dev = _resolve_device(cfg, device)
    return run_profiled(lambda prof, d: DRIVERS[phase](cfg, prof, steps, d), dev, cfg.memory, steps, out_dir,
                        meta={"phase": phase, "steps": steps, **(meta or {}), "resolved": config_to_dict(cfg)},
                        snapshot=snapshot, trace=trace)


def run_profiled(drive: Callable[[MemoryProfiler, torch.device], None], dev: torch.device, memory: MemoryConfig,
                 steps: int, out_dir: str | Path, *, meta: dict[str, Any], snapshot: bool,
                 trace: bool) -> tuple[dict[str, Any], int]:
    """`drive(profiler, device)` under a fresh profiler (the memory cap applied first, an OOM a finished report)."""
    import json

    if steps < 1:
        raise UserError(f"--steps must be at least 1, got {steps}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_grad_enabled(True)
    import torch._dynamo  # noqa: F401  (optimizers import it lazily; keep that import out of the measured phases)

    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    from tttvideo.memory.guard.cap import apply_memory_cap
    from tttvideo.memory.profile.trace import traced

    apply_memory_cap(memory, dev)  # before anything is allocated: the run sees the card it rehearses
    prof = MemoryProfiler(device=str(dev) if dev.type == "cuda" else "cpu", meta=meta)
    if snapshot and not prof.start_snapshot():
        print("profile: --snapshot needs CUDA (torch's allocator history); skipped on CPU", file=sys.stderr)
    tracer = traced(dev, out, steps, prof) if trace else contextlib.nullcontext()
    status, code, error = "ok", 0, None
    try:
        with tracer:
            drive(prof, dev)
    except BaseException as exc:  # noqa: BLE001 - re-raised below unless it is an OOM
        if is_oom(exc):
            prof.record_oom(exc)
            status, code = "oom", EXIT_OOM
        else:
            status, error = "error", exc
            prof.meta["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        prof.close()
        prof.dump_snapshot(out / "snapshot.pickle")
    rec = prof.recording()
    write_report(rec, out, status=status)
    summary = json.loads((out / "summary.json").read_text())
    if error is not None:
        raise error
    return summary, code
