"""`tttv precompute`: mp4 clips + captions -> the latent cache (`tttvideo.data.cache`).

Phases, each resumable because every output file is written atomically and checked on the next run:

1. check: every clip in the captions file is probed (frame rate, resolution, exact frame count) and its caption
   count compared with its segments; clips without captions, missing or unreadable files and mismatches go into
   the report and are skipped, never silently used.
2. VAE: the backbone's VAE (a local diffusers folder: CogVideoX's AutoencoderKLCogVideoX, Wan's AutoencoderKLWan)
   encodes the clips in batches; the posterior mean and logvar are stored (Wan's already normalised per channel,
   (z - latents_mean) / latents_std, with scaling 1, so that the cache's sampling gives the latents Wan's pipeline
   works in). The VAE is then deleted before the text encoder is loaded, so the two never share
   the GPU.
3. T5 (`tttvideo.text.t5`, a local transformers folder) encodes one prompt per segment, with the scene tokens,
   padded to the layout's text length exactly as CogVideoX's pipeline does (padding="max_length", no attention
   mask into the encoder); for Wan, umT5 (`tttvideo.text.umt5`) as Wan's pipeline does (cleaned prompt, attention
   mask, zeros past the prompt).
4. manifest.jsonl and report.json are written (atomically) from what is on disk.

A latent file is reused when its metadata names the same source file (size, mtime) and VAE folder; a text file
when it holds the same prompt from the same encoder folder and text length. Anything else is recomputed.
"""

from __future__ import annotations

import gc
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors import safe_open

from tttvideo.data.cache import CacheEntry, atomic_write_text, save_latent, save_text, write_manifest
from tttvideo.data.captions import ClipCaptions, read_captions
from tttvideo.data.video import VideoInfo, VideoReadError, layout_problems, probe, read_frames
from tttvideo.device import resolve_device
from tttvideo.dtypes import torch_dtype
from tttvideo.errors import UserError
from tttvideo.layout import VideoLayout
from tttvideo.text.t5 import load_text_encoder, pipeline_component, t5_dtype
from tttvideo.text.umt5 import clean_prompt, load_umt5

VIDEO_SUFFIXES = (".mp4", ".mov", ".mkv", ".webm")


@dataclass
class Clip:
    captions: ClipCaptions
    path: Path
    id: str
    info: VideoInfo | None = None

    @property
    def latent_rel(self) -> str:
        return f"latents/{self.id}.safetensors"

    def text_rel(self, seg: int) -> str:
        return f"text/{self.id}-{seg:03d}.safetensors"

    def source_tag(self) -> str:
        st = self.path.stat()
        return f"{self.path.resolve()}|{st.st_size}|{st.st_mtime_ns}"


@dataclass
class Report:
    problems: list[dict[str, str]] = field(default_factory=list)
    warnings: list[dict[str, str]] = field(default_factory=list)
    encoded_latents: list[str] = field(default_factory=list)
    reused_latents: list[str] = field(default_factory=list)
    encoded_texts: int = 0
    reused_texts: int = 0
    samples: list[str] = field(default_factory=list)

    def problem(self, video: str, why: str) -> None:
        self.problems.append({"video": video, "problem": why})

    def to_dict(self) -> dict[str, Any]:
        return {
            "samples": len(self.samples),
            "skipped": len(self.problems),
            "latents_encoded": len(self.encoded_latents),
            "latents_reused": len(self.reused_latents),
            "texts_encoded": self.encoded_texts,
            "texts_reused": self.reused_texts,
            "problems": self.problems,
            "warnings": self.warnings,
            "sample_ids": self.samples,
        }


@dataclass
class PrecomputeOptions:
    videos: Path
    captions: Path
    out: Path
    vae_path: Path
    text_encoder_path: Path
    layout: VideoLayout
    batch_size: int = 1
    text_batch_size: int = 8
    cache_dtype: str = "bf16"
    device: str = "auto"
    vae_tiling: bool = False
    vae_kind: str = "cogvideox"  # the backbone's (`BackboneSpec.vae`): "cogvideox" or "wan"
    text_encoder_kind: str = "t5"  # the backbone's (`BackboneSpec.text_encoder`): "t5" or "umt5"


def clip_id(rel: str) -> str:
    """'sub/clip 01.mp4' -> 'sub__clip_01': a file name that keeps clips from different folders apart."""
    stem = rel.rsplit(".", 1)[0] if "." in Path(rel).name else rel
    return re.sub(r"[^A-Za-z0-9._-]+", "_", stem.replace("/", "__").replace("\\", "__"))



def _metadata(path: Path) -> dict[str, str] | None:
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception:  # a foreign or damaged file is recomputed
        return None


def free(model: Any) -> None:
    """Drop the last reference and give the memory back before the next encoder loads."""
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------- phase 1
def check_clips(opts: PrecomputeOptions, report: Report) -> list[Clip]:
    captions = read_captions(opts.captions)
    if not opts.videos.is_dir():
        raise UserError(f"videos folder {opts.videos} does not exist")
    listed = {c.video for c in captions.clips}
    for p in sorted(opts.videos.rglob("*")):
        rel = p.relative_to(opts.videos).as_posix()
        if p.suffix.lower() in VIDEO_SUFFIXES and rel not in listed:
            report.problem(rel, "no line in the captions file")
    lay = opts.layout
    clips, ids = [], {}
    for cap in captions.clips:
        clip = Clip(cap, opts.videos / cap.video, clip_id(cap.video))
        if clip.id in ids:
            report.problem(cap.video, f"its cache name {clip.id!r} collides with {ids[clip.id]!r}; rename one")
            continue
        if cap.problem:
            report.problem(cap.video, cap.problem)
            continue
        if not clip.path.is_file():
            report.problem(cap.video, "file not found in the videos folder")
            continue
        if len(cap.captions) != lay.num_segments:
            report.problem(cap.video, f"{len(cap.captions)} caption(s) for the {lay.num_segments} 3-s segment(s) of a "
                                      f"{lay.duration_s} s clip")
            continue
        try:
            clip.info = probe(clip.path)
        except VideoReadError as err:
            report.problem(cap.video, str(err))
            continue
        problems = layout_problems(clip.info, lay)
        if problems:
            report.problem(cap.video, "; ".join(problems))
            continue
        ids[clip.id] = cap.video
        clips.append(clip)
    return clips


# ---------------------------------------------------------------------------------------------------- phase 2
def load_vae(path: Path, device: torch.device, dtype: torch.dtype, tiling: bool, kind: str = "cogvideox"):
    import diffusers

    cls = getattr(diffusers, "AutoencoderKLWan" if kind == "wan" else "AutoencoderKLCogVideoX")
    folder = pipeline_component(path, "vae")
    if not (folder / "config.json").is_file():
        raise UserError(f"no VAE in {path}: expected a diffusers {cls.__name__} folder (config.json + weights) "
                        f"or a pipeline folder with vae/")
    vae = cls.from_pretrained(str(folder), torch_dtype=dtype, local_files_only=True)
    if tiling:
        vae.enable_tiling()
    return vae.to(device).eval(), folder


@torch.no_grad()
def encode_latents(opts: PrecomputeOptions, clips: list[Clip], report: Report,
                   progress: Callable[[int], None] | None = None) -> list[Clip]:
    """Encode clips whose latent file is missing or stale; returns the clips that have a latent afterwards."""
    device = resolve_device(opts.device, "data.device")
    vae_dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    todo, ready = [], []
    vae_tag = str(opts.vae_path.resolve())
    for clip in clips:
        meta = _metadata(opts.out / clip.latent_rel)
        if meta and meta.get("source") == clip.source_tag() and meta.get("encoder") == vae_tag:
            report.reused_latents.append(clip.id)
            ready.append(clip)
            if progress:
                progress(1)
        else:
            todo.append(clip)
    if not todo:
        return ready
    vae, folder = load_vae(opts.vae_path, device, vae_dtype, opts.vae_tiling, opts.vae_kind)
    wan = opts.vae_kind == "wan"
    scaling = 1.0 if wan else float(vae.config.scaling_factor)
    if wan:  # per-channel normalisation, folded into the stored posterior: ((mean - m) / s, logvar - 2 log s)
        shape = (-1, 1, 1, 1)
        norm_mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32, device=device).view(shape)
        norm_std = torch.tensor(vae.config.latents_std, dtype=torch.float32, device=device).view(shape)
    store = torch_dtype(opts.cache_dtype)
    for start in range(0, len(todo), opts.batch_size):
        batch, videos = [], []
        for clip in todo[start : start + opts.batch_size]:
            try:
                videos.append(read_frames(clip.path, clip.info))
                batch.append(clip)
            except VideoReadError as err:
                report.problem(clip.captions.video, str(err))
                if progress:
                    progress(1)
        if not batch:
            continue
        # uint8 [B, T, H, W, 3] -> [-1, 1] [B, 3, T, H, W], the VAE's input convention
        x = torch.from_numpy(np.stack(videos)).to(device).permute(0, 4, 1, 2, 3).to(vae_dtype) / 127.5 - 1.0
        dist = vae.encode(x).latent_dist
        for i, clip in enumerate(batch):
            mean, logvar = dist.mean[i], dist.logvar[i]
            if wan:
                mean = (mean.float() - norm_mean) / norm_std
                logvar = logvar.float() - 2 * norm_std.log()
            save_latent(opts.out / clip.latent_rel, mean.to(store).cpu(), logvar.to(store).cpu(),
                        scaling, extra={"source": clip.source_tag(), "encoder": vae_tag})
            report.encoded_latents.append(clip.id)
            ready.append(clip)
        if progress:
            progress(len(batch))
        del x, dist
    free(vae)
    order = {c.id: i for i, c in enumerate(clips)}
    return sorted(ready, key=lambda c: order[c.id])


# ---------------------------------------------------------------------------------------------------- phase 3
@torch.no_grad()
def encode_texts(opts: PrecomputeOptions, clips: list[Clip], report: Report,
                 progress: Callable[[int], None] | None = None) -> None:
    device = resolve_device(opts.device, "data.device")
    length = opts.layout.text_tokens
    tag = f"{opts.text_encoder_path.resolve()}|{length}"
    todo: list[tuple[Clip, int, str]] = []
    for clip in clips:
        for seg, prompt in enumerate(clip.captions.prompts()):
            meta = _metadata(opts.out / clip.text_rel(seg))
            if meta and meta.get("caption") == prompt and meta.get("encoder") == tag:
                report.reused_texts += 1
                if progress:
                    progress(1)
            else:
                todo.append((clip, seg, prompt))
    if not todo:
        return
    umt5 = opts.text_encoder_kind == "umt5"
    load = load_umt5 if umt5 else load_text_encoder
    tokenizer, model = load(opts.text_encoder_path, device, t5_dtype(device))
    store = torch_dtype(opts.cache_dtype)
    for start in range(0, len(todo), opts.text_batch_size):
        batch = todo[start : start + opts.text_batch_size]
        prompts = [clean_prompt(p) if umt5 else p for _, _, p in batch]
        full = tokenizer(prompts, add_special_tokens=True)["input_ids"]
        tokens = tokenizer(prompts, padding="max_length", max_length=length, truncation=True,
                           add_special_tokens=True, return_tensors="pt")
        ids = tokens["input_ids"].to(device)
        if umt5:  # Wan's pipeline: the mask into the encoder, zeros past the prompt
            mask = tokens["attention_mask"].to(device)
            emb = model(ids, mask).last_hidden_state * mask[..., None].to(model.dtype)
        else:
            emb = model(ids)[0]
        for i, (clip, seg, prompt) in enumerate(batch):
            tokens = len(full[i])
            if tokens > length:
                report.warnings.append({"video": clip.captions.video,
                                        "warning": f"segment {seg}: prompt has {tokens} tokens, truncated to {length}"})
            save_text(opts.out / clip.text_rel(seg), emb[i].to(store).cpu(), prompt, min(tokens, length),
                      extra={"encoder": tag})
            report.encoded_texts += 1
        if progress:
            progress(len(batch))
        del emb
    free(model)


# ---------------------------------------------------------------------------------------------------- driver
def run_precompute(opts: PrecomputeOptions, console: Any = None) -> Report:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console()
    opts.out.mkdir(parents=True, exist_ok=True)
    report = Report()
    clips = check_clips(opts, report)
    console.print(f"precompute: {len(clips)} clip(s) fit the {opts.layout.duration_s} s {opts.layout.height}x"
                  f"{opts.layout.width} layout, {len(report.problems)} skipped")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        vae_task = bar.add_task("VAE latents", total=len(clips))
        clips = encode_latents(opts, clips, report, lambda n: bar.advance(vae_task, n))
        text_task = bar.add_task("T5 prompts", total=len(clips) * opts.layout.num_segments)
        encode_texts(opts, clips, report, lambda n: bar.advance(text_task, n))
    entries = [
        CacheEntry(id=c.id, latent=c.latent_rel, text=[c.text_rel(s) for s in range(len(c.captions.captions))],
                   captions=c.captions.captions, scene_start=c.captions.scene_start, scene_end=c.captions.scene_end,
                   source=c.captions.video)
        for c in clips
    ]
    report.samples = [e.id for e in entries]
    if entries:
        write_manifest(opts.out / "manifest.jsonl", entries)
    atomic_write_text(opts.out / "report.json", json.dumps(report.to_dict(), indent=2, ensure_ascii=False) + "\n")
    return report
