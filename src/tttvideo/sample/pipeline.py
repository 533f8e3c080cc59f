"""`tttv sample` end to end: stories in, one mp4 per story out (or the frames, for the Python API).

Phases; the text encoder is alone on the GPU and released before the transformer loads; the decoder joins the
transformer once the first story is denoised (its activations freed), so that each story is written as soon as it
is done:

1. `story_layouts`: parse and validate every story (scene files, durations) before anything heavy is loaded;
2. `encode_stories`: encode every story's prompts and negative prompts (token counts checked first), then release
   the encoder;
3. `denoise_stories`: the solver for every story with the transformer (`tttvideo.sample.model.load_model`,
   optionally with block offload); the final latents go to the CPU;
4. `StoryWriter`: as soon as a story is denoised, the VAE (or the identity decode of the demo) streams its frames
   into its mp4 and the story is written beside it (`out.scenes.json`, readable again as a scenes file), each file
   atomically. The decoder is loaded when the first story is done and stays until the last one is written, beside
   the transformer (whose denoising activations are freed first); then both are released.

Nothing already sampled is lost: a crash, a kill or a full disk costs at most the story in flight. A file that
cannot be written (a full disk) is one sentence naming it and the stories already written, which are kept.

Determinism: see `tttvideo.sample.guidance.denoise` (one CPU generator per story, seeded with `sample.seed`, or
the story's own `Story.seed`).

Under torchrun (`tttv sample` with a `SampleRanks`, `tttvideo.sample.distributed`) every rank runs phases 1-3 for
its story group's stories with the whole model, its sequence-parallel group and its half of the guidance; the first
rank of each story group alone decodes and writes them, and every rank returns all the results.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from tttvideo.config.schema import Config
from tttvideo.data.video import scenes_path
from tttvideo.device import resolve_device
from tttvideo.errors import UserError
from tttvideo.layout import VideoLayout
from tttvideo.memory.guard.oom import DenoiseWatch
from tttvideo.outputs import atomic_target, write_failure
from tttvideo.runs import resolve_checkpoint
from tttvideo.sample.guidance import denoise
from tttvideo.sample.model import load_model, warn_beyond_training
from tttvideo.sample.scenes import Story, check_duration, check_token_counts, encode_story, output_paths
from tttvideo.sample.video import Mp4Writer, to_uint8_frames, write_scenes
from tttvideo.text.encoders import make_text_encoder

if TYPE_CHECKING:
    from tttvideo.sample.distributed import SampleRanks


@dataclass
class SampleResult:
    story: str
    video: Path
    scenes: Path
    frames: int
    duration_s: int
    denoise_s: float
    decode_s: float
    latents: Path | None = None  # with sample.save_latents


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------- phases
def story_layouts(cfg: Config, stories: list[Story], duration: str | int | None = None) -> list[VideoLayout]:
    """Each story's layout, with the sampling TTT mini-batch: its duration is its scene count's (checked against
    `duration` when given)."""
    from tttvideo.models.backbone import layout_of

    return [layout_of(cfg, check_duration(s, duration), phase="sample") for s in stories]


def encode_stories(cfg: Config, stories: list[Story], layouts: list[VideoLayout], text_dim: int,
                   device: torch.device) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], str]:
    """(cond, uncond) text features per story and a description of the encoder, which is released before
    returning. Every story's token counts are checked before the first is encoded."""
    encoders: dict[int, Any] = {}
    for story, layout in zip(stories, layouts):
        enc = encoders.get(layout.text_tokens)
        if enc is None:
            enc = encoders[layout.text_tokens] = make_text_encoder(cfg, layout.text_tokens, text_dim, device)
        check_token_counts(enc, story, layout.text_tokens, layout.duration_s)
    texts = [encode_story(encoders[layout.text_tokens], story) for story, layout in zip(stories, layouts)]
    described = next(iter(encoders.values())).describe()
    for enc in encoders.values():
        enc.release()
    encoders.clear()
    free_memory()
    return texts, described


def denoise_stories(model: torch.nn.Module, stories: list[Story], layouts: list[VideoLayout],
                    texts: list[tuple[torch.Tensor, torch.Tensor]], cfg: Config, device: torch.device,
                    console: Any = None, progress: bool = True, ranks: SampleRanks | None = None,
                    on_story: Callable[[int, torch.Tensor, float], None] | None = None,
                    ) -> tuple[list[torch.Tensor | None], list[float]]:
    """Clean latents [1, T, C, h, w] (CPU) and the denoising seconds of every story, with a progress bar per story.
    The model is put in eval mode for the loop and given back in the mode it came in. `ranks`: this rank's
    sequence-parallel group and guidance half under torchrun. `on_story(i, latents, seconds)` is called as soon as
    story i is done (to write it); its latents are then not kept (None in the list)."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    was_training = model.training
    model.eval()
    latents, seconds = [], []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    try:
        with Progress(*columns, console=console, disable=not progress, transient=False) as bar:
            for story, layout, (cond, uncond) in zip(stories, layouts, texts):
                task = bar.add_task(f"{story.name} ({layout.duration_s} s)", total=cfg.sample.steps)
                t0 = time.perf_counter()
                sample_cfg = cfg.sample if story.seed is None else replace(cfg.sample, seed=story.seed)
                with DenoiseWatch(cfg, model, story.name) as watch:  # a CUDA OOM: one sentence naming the step
                    done = denoise(model, layout, cond, uncond, sample_cfg, device, on_step=watch.on_step(
                        lambda i, n, task=task: bar.update(task, completed=i + 1, total=n)),
                        sp=ranks.sequence if ranks else None, split=ranks.split if ranks else None)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                seconds.append(time.perf_counter() - t0)
                if on_story is None:
                    latents.append(done)
                else:
                    latents.append(None)
                    on_story(len(seconds) - 1, done, seconds[-1])
    finally:
        model.train(was_training)
    return latents, seconds


def make_story_decoder(cfg: Config, device: torch.device):
    """The VAE of sample.vae_path (or data.vae_path), or the identity decode when neither is set (the demo)."""
    from tttvideo.models.backbone import backbone_of
    from tttvideo.sample.decode import make_decoder

    vae_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return make_decoder(cfg.sample.vae_path or cfg.data.vae_path, device, vae_dtype, cfg.sample.vae_tiling,
                        cfg.layout.vae_spatial, cfg.layout.vae_temporal, backbone_of(cfg.model.preset).vae)


def write_video(decoder: Any, latents: torch.Tensor, path: Path, fps: int) -> int:
    """Stream the decoded frames of [1, T, C, h, w] latents into `path`; returns the number of frames."""
    with Mp4Writer(path, fps=fps) as writer:
        for chunk in decoder.frames(latents):  # [1, 3, n, H, W]
            writer.append(to_uint8_frames(chunk[0].permute(1, 0, 2, 3)))
        return writer.frames_written


def decode_frames(decoder: Any, latents: torch.Tensor) -> np.ndarray:
    """The decoded frames of [1, T, C, h, w] latents as uint8 [frames, height, width, 3]."""
    return np.concatenate([to_uint8_frames(chunk[0].permute(1, 0, 2, 3)) for chunk in decoder.frames(latents)])


def sampling_record(cfg: Config, checkpoint: str | Path | None, layout: VideoLayout, frames: int,
                    seed: int | None = None) -> dict[str, Any]:
    """How a video was made, stored in its scenes.json; `seed`: the story's own, when it has one."""
    s = cfg.sample
    return {"checkpoint": str(checkpoint) if checkpoint else None, "seed": s.seed if seed is None else seed,
            "steps": s.steps,
            "solver": s.solver, "cfg": s.cfg, "cfg_schedule": s.cfg_schedule, "cfg_start": s.cfg_start,
            "duration_s": layout.duration_s, "frames": frames, "fps": layout.fps, "height": layout.height,
            "width": layout.width, "text_tokens": layout.text_tokens}


class StoryWriter:
    """Writes one story at a time, as soon as it is denoised: its mp4 (unless sample.write_video is false), its
    scenes.json and, with sample.save_latents, its latents, each atomically. The decoder is made on the first story
    and released by `close()`. A file that cannot be written is one sentence naming it and what was written before."""

    def __init__(self, cfg: Config, checkpoint: str | Path | None, device: torch.device, total: int):
        self.cfg, self.checkpoint, self.device, self.total = cfg, checkpoint, device, total
        self.decoder: Any = None
        self.results: list[SampleResult] = []

    def write(self, story: Story, layout: VideoLayout, latents: torch.Tensor, path: Path,
              denoise_s: float) -> SampleResult:
        t0 = time.perf_counter()
        if self.decoder is None and self.cfg.sample.write_video:
            if self.device.type == "cuda":
                free_memory()  # the denoising activations' cached blocks go before the VAE comes
            self.decoder = make_story_decoder(self.cfg, self.device)
        target = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # the mp4 writer makes it; without one, here
            frames = (write_video(self.decoder, latents, path, layout.fps) if self.cfg.sample.write_video
                      else layout.num_frames)
            target = scenes_path(path)
            scenes = write_scenes(path, story.to_json(sampling_record(self.cfg, self.checkpoint, layout, frames,
                                                                      story.seed)))
            target = path.with_suffix(".latents.safetensors")
            saved = save_latents(latents, path) if self.cfg.sample.save_latents else None
        except OSError as err:  # a full disk, a folder gone: ffmpeg, json and safetensors all end here
            raise UserError(self._failure(target, err, story)) from None
        result = SampleResult(story.name, path, scenes, frames, layout.duration_s, denoise_s,
                              time.perf_counter() - t0, saved)
        self.results.append(result)
        return result

    def _failure(self, target: Path, err: OSError, story: Story) -> str:
        done = [r.video if self.cfg.sample.write_video else r.scenes for r in self.results]
        if not done:
            kept = "no story was written before it"
        elif len(done) == 1:
            kept = f"the story written before it is kept ({done[0]})"
        else:
            kept = f"the {len(done)} stories written before it are kept ({done[0]} ... {done[-1]})"
        return (f"cannot write {target} ({write_failure(target, err)}); {kept}; story {story.name!r} "
                f"({len(done) + 1} of {self.total}) and any after it are not written: make room and sample them "
                f"again")

    def close(self) -> None:
        """Let the decoder go (the caller frees the memory)."""
        self.decoder = None


def save_latents(latents: torch.Tensor, video: Path) -> Path:
    """Write the final latents [1, T, C, h, w] (float32) beside `video` as <stem>.latents.safetensors, key
    "latents": the exact output of the solver, which the mp4 only holds decoded and 8-bit."""
    from safetensors.torch import save_file

    path = video.with_suffix(".latents.safetensors")
    with atomic_target(path) as tmp:
        save_file({"latents": latents.float().contiguous()}, str(tmp))
    return path


# ---------------------------------------------------------------------------------------------------------- driver
def sample_stories(cfg: Config, stories: list[Story], out: str | Path, checkpoint: str | Path | None = None,
                   duration: str | int | None = None, model: torch.nn.Module | None = None, console: Any = None,
                   progress: bool = True, ranks: SampleRanks | None = None, writes: bool = True) -> list[SampleResult]:
    """Sample every story into its mp4. Pass a loaded `model` (the trainer's end-of-run video; it is sampled where
    it lives and kept) or a `checkpoint` (loaded after the text phase and released before decoding). `writes`
    False (with a `model`): denoise without decoding or writing anything, as the ranks of an FSDP-sharded model
    other than the one that writes do (each forward gathers the weights from all of them). `ranks`
    (`tttv sample` under torchrun, with a `checkpoint`): this rank samples its story group's share of the stories,
    and every rank returns the results of all of them (a UserError on any rank is raised on all as one
    SharedError, so that none waits for a rank that stopped)."""
    from rich.console import Console

    console = console or Console()
    if ranks is None:
        return _sample_share(cfg, stories, out, checkpoint, duration, model, console, progress, writes=writes)
    return ranks.gather(lambda: _sample_share(cfg, stories, out, checkpoint, duration, None, console, progress, ranks))


def _sample_share(cfg: Config, stories: list[Story], out: str | Path, checkpoint: str | Path | None,
                  duration: str | int | None, model: torch.nn.Module | None, console: Any, progress: bool,
                  ranks: SampleRanks | None = None, writes: bool = True) -> list[SampleResult]:
    """The results this rank writes: every story with one process, its story group's share (or none, on a rank
    that does not write) under torchrun."""
    from tttvideo.models.backbone import get_preset

    if model is not None:
        device = next(model.parameters()).device
    else:
        device = ranks.device if ranks is not None else resolve_device(cfg.sample.device, "sample.device")
    if not (cfg.sample.write_video or cfg.sample.save_latents):
        raise UserError("sample.write_video = false and sample.save_latents = false would keep nothing of the "
                        "sampled videos: set sample.save_latents = true (latents only) or sample.write_video = true")
    paths = output_paths(stories, out)
    layouts = story_layouts(cfg, stories, duration)
    if model is None and checkpoint:
        # a wrong path fails now, not after the text encoder has run
        warn_beyond_training(resolve_checkpoint(checkpoint, cfg), stories, layouts)
    spec = model.spec if model is not None else get_preset(cfg.model.preset)
    if ranks is not None:  # every story is checked above; this rank's group samples its share
        stories, layouts, paths = ranks.mine(stories), ranks.mine(layouts), ranks.mine(paths)
        if not stories:
            return []

    texts, described = encode_stories(cfg, stories, layouts, spec.text_embed_dim, device)
    console.print(f"text: {described}; {len(stories)} story(ies) encoded, encoder released")

    writes = ranks.writes if ranks is not None else writes
    writer = StoryWriter(cfg, checkpoint, device, len(stories)) if writes else None

    def write(i: int, latents: torch.Tensor, seconds: float) -> None:
        if writer is not None:  # under torchrun only the first rank of a story group writes
            writer.write(stories[i], layouts[i], latents, paths[i], seconds)

    try:
        if model is not None:
            denoise_stories(model, stories, layouts, texts, cfg, device, console, progress, on_story=write)
        else:
            with load_model(cfg, checkpoint, device, offload=cfg.sample.offload_blocks) as loaded:
                denoise_stories(loaded.model, stories, layouts, texts, cfg, device, console, progress, ranks,
                                on_story=write)
            del loaded
    finally:
        if writer is not None:
            writer.close()
        free_memory()
    return writer.results if writer is not None else []
