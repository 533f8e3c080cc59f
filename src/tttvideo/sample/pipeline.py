"""`tttv sample` end to end: stories in, one mp4 per story out.

Phases, each component alone on the GPU (SPEC section 6: release each component as soon as it is done):

1. parse and validate every story (scene files, durations, token counts) before anything heavy is loaded;
2. text: encode every story's prompts and negative prompts, then delete the encoder;
3. denoise: load the transformer (optionally with block offload), run the solver for every story, keep the final
   latents on the CPU, then delete the transformer;
4. decode: load the VAE (or the identity decode of the demo), stream every story's frames into its mp4 and write
   the story beside it (`out.scenes.json`, readable again as a scenes file).

Determinism: the initial noise and every noise draw of the stochastic solver come from one CPU `torch.Generator`
seeded with `sample.seed`, per story, so the same seed gives the same latents on any device and a story gives the
same video whether it is sampled alone or with others.
"""

from __future__ import annotations

import copy
import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from tttvideo.diffusion import ZeroSNRSchedule
from tttvideo.errors import UserError
from tttvideo.layout import VideoLayout
from tttvideo.runs import is_full_checkpoint, resolve_checkpoint
from tttvideo.sample.scenes import Story, check_duration, check_token_counts, encode_story
from tttvideo.sample.solvers import GuidanceSchedule, guide, make_solver
from tttvideo.text.encoders import make_text_encoder
from tttvideo.sample.video import Mp4Writer, to_uint8_frames, write_scenes
from tttvideo.device import resolve_device

log = logging.getLogger(__name__)


@dataclass
class SampleResult:
    story: str
    video: Path
    scenes: Path
    frames: int
    duration_s: int
    denoise_s: float
    decode_s: float



def story_layout(cfg: Any, story: Story, duration: str | int | None = None) -> VideoLayout:
    """The layout of one story: its duration comes from its scene count (checked against `duration` if given)."""
    seconds = check_duration(story, duration)
    lay = cfg.layout
    return VideoLayout.create(duration=seconds, height=lay.height, width=lay.width, fps=lay.fps,
                              vae_spatial=lay.vae_spatial, vae_temporal=lay.vae_temporal, patch_size=lay.patch_size,
                              text_tokens=lay.text_tokens, mini_batch_size=cfg.ttt.mini_batch_size)


def output_paths(stories: list[Story], out: str | Path) -> list[Path]:
    """One story: `out` itself (or out/<name>.mp4 for a folder); several: out must be a folder."""
    out = Path(out)
    if out.suffix.lower() == ".mp4":
        if len(stories) > 1:
            raise UserError(f"the scenes hold {len(stories)} stories but --out {out} names one video; give a folder "
                            f"and each story is written to <folder>/<story name>.mp4")
        return [out]
    if out.suffix and not out.is_dir():
        raise UserError(f"--out {out} must end in .mp4 (one story) or name a folder")
    return [out / f"{s.name}.mp4" for s in stories]


# ---------------------------------------------------------------------------------------------------------- model
def load_model(cfg: Any, checkpoint: str | Path | None, device: torch.device, offload: bool = False):
    """The transformer of `cfg.model`, with the weights of `checkpoint` (a tttvideo model file, checkpoint folder
    or run folder) on top; with `offload` the blocks stay on the CPU (see `tttvideo.sample.offload`)."""
    from tttvideo.models import build_model, load_checkpoint

    cfg = copy.deepcopy(cfg)
    model_file = resolve_checkpoint(checkpoint) if checkpoint else None
    if model_file is not None:
        if is_full_checkpoint(model_file):
            cfg.model.pretrained_path = ""  # every weight comes from the checkpoint: skip loading the base model
    # adapters and activation checkpointing change nothing at inference but the parameter names a checkpoint
    # trained with them has; build exactly what was trained
    build_device = torch.device("cpu") if offload and device.type == "cuda" else device
    model = build_model(cfg, device=build_device)
    if model_file is not None:
        load_checkpoint(model, model_file)
    model.eval().requires_grad_(False)
    if offload and device.type == "cuda":
        from tttvideo.sample.offload import BlockOffloader

        for name, child in model.named_children():
            if name != "blocks":
                child.to(device)
        model._offloader = BlockOffloader(model.blocks, device, prefetch=cfg.sample.prefetch_blocks)
    elif offload:
        from tttvideo.sample.offload import BlockOffloader

        BlockOffloader(model.blocks, device)  # logs that offload is a no-op off CUDA
    return model


def warn_beyond_training(model_file: Path, stories: list[Story], layouts: list[VideoLayout]) -> None:
    """Say so when a story is longer than any video the checkpoint was trained on: TTT carries state across the
    whole video, and lengths it never saw in training are untested."""
    from tttvideo.models.weights import trained_duration

    trained = trained_duration(model_file)
    if trained is None:
        return
    for story, layout in zip(stories, layouts):
        if layout.duration_s > trained:
            log.warning("story %r is %d s long, but %s was trained on videos of at most %d s; expect the quality of "
                        "the later segments to suffer (train a longer stage, e.g. configs/cogvideox-5b/)",
                        story.name, layout.duration_s, model_file, trained)


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


# ---------------------------------------------------------------------------------------------------------- denoise
@torch.no_grad()
def denoise(model: torch.nn.Module, layout: VideoLayout, cond: torch.Tensor, uncond: torch.Tensor, sample_cfg: Any,
            device: torch.device, on_step: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """The solver loop for one story. cond/uncond: [segments, text_tokens, text_dim]. Returns the clean latents
    [1, T, C, h, w] float32 on the CPU."""
    spec = model.spec
    gen = torch.Generator(device="cpu").manual_seed(int(sample_cfg.seed))
    shape = (1, layout.latent_frames, spec.in_channels, layout.latent_height, layout.latent_width)
    x = torch.randn(shape, generator=gen, dtype=torch.float32).to(device)
    solver = make_solver(sample_cfg.solver, ZeroSNRSchedule(), sample_cfg.steps)
    scales = GuidanceSchedule(sample_cfg.cfg_schedule, sample_cfg.cfg, sample_cfg.cfg_start,
                              sample_cfg.cfg_ramp_exp).scales(len(solver.timesteps))
    dtype = model_dtype(model)
    cond = cond[None].to(device=device, dtype=dtype)
    uncond = uncond[None].to(device=device, dtype=dtype)
    both = torch.cat([uncond, cond])
    batched = sample_cfg.cfg_batched
    last = len(solver.timesteps) - 1
    for i, t in enumerate(solver.timesteps):
        scale = scales[i]
        v = None
        if scale == 1.0:  # guidance 1 is the conditional prediction alone: skip the unconditional pass
            v = model(x, cond, t, layout).float()
        elif batched:
            try:
                v_u, v_c = model(torch.cat([x, x]), both, t, layout).float().chunk(2)
                v = guide(v_u, v_c, scale)
            except torch.OutOfMemoryError:
                # batch 2 does not fit (CogVideoX-5B + TTT at 63 s on 80 GB): the same guidance in two passes, which
                # halves the activations, for the rest of this video
                batched = False
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                log.warning("guidance at batch 2 ran out of memory; continuing with two passes of batch 1 "
                            "(set sample.cfg_batched = false to start that way)")
        if v is None:
            v_u = model(x, uncond, t, layout).float()
            v = guide(v_u, model(x, cond, t, layout).float(), scale)
        noise = torch.randn(shape, generator=gen, dtype=torch.float32) if solver.stochastic and i < last else None
        x = solver.step(i, x, v, noise)
        if on_step is not None:
            on_step(i, len(solver.timesteps))
    return x.cpu()


# ---------------------------------------------------------------------------------------------------------- decode
def write_video(decoder: Any, latents: torch.Tensor, path: Path, fps: int) -> int:
    """Stream the decoded frames of [1, T, C, h, w] latents into `path`; returns the number of frames."""
    with Mp4Writer(path, fps=fps) as writer:
        for chunk in decoder.frames(latents):  # [1, 3, n, H, W]
            writer.append(to_uint8_frames(chunk[0].permute(1, 0, 2, 3)))
        return writer.frames_written


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------- driver
def sample_stories(cfg: Any, stories: list[Story], out: str | Path, checkpoint: str | Path | None = None,
                   duration: str | int | None = None, model: torch.nn.Module | None = None, console: Any = None,
                   progress: bool = True) -> list[SampleResult]:
    """Sample every story into its mp4. Pass a loaded `model` (the trainer's end-of-run video) or a `checkpoint`."""
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    from tttvideo.models.presets import get_preset
    from tttvideo.sample.decode import make_decoder

    console = console or Console()
    # a model handed in (the trainer's end-of-run video) is sampled where it lives
    device = next(model.parameters()).device if model is not None else resolve_device(cfg.sample.device, "sample.device")
    paths = output_paths(stories, out)
    layouts = [story_layout(cfg, s, duration) for s in stories]
    if model is None and checkpoint:
        # a wrong path fails now, not after the text encoder has run
        warn_beyond_training(resolve_checkpoint(checkpoint, cfg), stories, layouts)
    spec = model.spec if model is not None else get_preset(cfg.model.preset)

    # ---- 1-2. validate and encode text, then drop the encoder
    encoders: dict[int, Any] = {}
    texts = []
    for story, layout in zip(stories, layouts):
        enc = encoders.get(layout.text_tokens)
        if enc is None:
            enc = encoders[layout.text_tokens] = make_text_encoder(cfg, layout.text_tokens, spec.text_embed_dim,
                                                                   device)
        check_token_counts(enc, story, layout.text_tokens, layout.duration_s)
    for story, layout in zip(stories, layouts):
        texts.append(encode_story(encoders[layout.text_tokens], story))
    described = next(iter(encoders.values())).describe()
    for enc in encoders.values():
        enc.release()
    encoders.clear()
    free_memory()
    console.print(f"text: {described}; {len(stories)} story(ies) encoded, encoder released")

    # ---- 3. denoise
    own_model = model is None
    if own_model:
        model = load_model(cfg, checkpoint, device, offload=cfg.sample.offload_blocks)
    was_training = model.training
    model.eval()
    run_device = device
    latents, denoise_s = [], []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, console=console, disable=not progress, transient=False) as bar:
        for story, layout, (cond, uncond) in zip(stories, layouts, texts):
            task = bar.add_task(f"{story.name} ({layout.duration_s} s)", total=cfg.sample.steps)
            t0 = time.perf_counter()
            latents.append(denoise(model, layout, cond, uncond, cfg.sample, run_device,
                                   on_step=lambda i, n, task=task: bar.update(task, completed=i + 1, total=n)))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            denoise_s.append(time.perf_counter() - t0)
    model.train(was_training)
    if own_model:
        offloader = getattr(model, "_offloader", None)
        if offloader is not None:
            offloader.close()
        del model
        free_memory()

    # ---- 4. decode and write
    vae_path = cfg.sample.vae_path or cfg.data.vae_path
    vae_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    decoder = make_decoder(vae_path, device, vae_dtype, cfg.sample.vae_tiling, cfg.layout.vae_spatial,
                           cfg.layout.vae_temporal)
    results = []
    for story, layout, lat, path, d_s in zip(stories, layouts, latents, paths, denoise_s):
        t0 = time.perf_counter()
        frames = write_video(decoder, lat, path, layout.fps)
        sampling = {"checkpoint": str(checkpoint) if checkpoint else None, "seed": cfg.sample.seed,
                    "steps": cfg.sample.steps, "solver": cfg.sample.solver, "cfg": cfg.sample.cfg,
                    "cfg_schedule": cfg.sample.cfg_schedule, "cfg_start": cfg.sample.cfg_start,
                    "duration_s": layout.duration_s, "frames": frames, "fps": layout.fps,
                    "height": layout.height, "width": layout.width, "text_tokens": layout.text_tokens}
        scenes = write_scenes(path, story.to_json(sampling))
        results.append(SampleResult(story.name, path, scenes, frames, layout.duration_s, d_s,
                                    time.perf_counter() - t0))
    del decoder
    free_memory()
    return results
