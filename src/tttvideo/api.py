"""The Python API: train from a config object, sample videos from a run folder or a diffusers CogVideoX folder.

    import tttvideo

    result = tttvideo.train("configs/demo.toml", overrides=["train.steps=20"])
    pipe = tttvideo.VideoPipeline.from_run(result.output_dir)
    video = pipe(["a red circle moves left on a blue background", "a green square moves up on a black background"])
    video.frames      # uint8 array [frames, height, width, 3]
    video.save("story.mp4")

Both go through the same code as `tttv train` and `tttv sample`: the trainer, the run-folder lock and resume rules,
the text encoder / transformer / VAE phases of the sampler. Errors are `tttvideo.errors.UserError` subclasses with
one sentence that says what to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tttvideo.config.loader import load_config, with_overrides
from tttvideo.config.schema import Config
from tttvideo.errors import ConfigError, UserError
from tttvideo.sample.model import LoadedModel, load_model
from tttvideo.sample.scenes import Story, story_from_scenes

if TYPE_CHECKING:
    from tttvideo.models.backbone import BackboneConfig
    from tttvideo.train.trainer import TrainResult


def as_config(config: Config | str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """A Config from a Config (copied, then overridden), a TOML path, or None (the defaults)."""
    if isinstance(config, Config):
        return with_overrides(config, overrides)
    if config is not None and not isinstance(config, (str, Path)):
        raise ConfigError(f"config must be a tttvideo Config, a TOML path or None, got {type(config).__name__}")
    return load_config(config, overrides)


def train(config: Config | str | Path, *, overrides: Sequence[str] = (), if_exists: str | None = None,
          quiet: bool = False, trust_checkpoint: bool = False) -> TrainResult:
    """Train one stage as `tttv train` does and return its `TrainResult` (output folder, steps, first/last loss,
    checkpoints, end-of-run video). `if_exists` ("refuse", "resume", "new", "overwrite") says what happens to an
    earlier run in train.output_dir, as the CLI's flags do; `quiet` hides the progress bar; `trust_checkpoint` is
    --trust-checkpoint (docs/security.md)."""
    from tttvideo.train.trainer import Trainer

    cfg = as_config(config, overrides)
    return Trainer(cfg, quiet=quiet, if_exists=if_exists, trust_checkpoint=trust_checkpoint).run()


@dataclass
class Video:
    """A sampled video: `frames` uint8 [frames, height, width, 3] at `fps`, and the scenes it was made from."""

    frames: np.ndarray
    fps: int
    story: Story
    sampling: dict[str, Any] = field(default_factory=dict)

    def tensor(self) -> torch.Tensor:
        """The frames as a float tensor [frames, 3, height, width] in [0, 1]."""
        return torch.from_numpy(self.frames).permute(0, 3, 1, 2).float().div(255)

    def save(self, path: str | Path) -> Path:
        """Write the mp4 and its scenes file beside it (`<name>.scenes.json`, readable by `tttv sample --scenes`)."""
        from tttvideo.outputs import check_writable_file
        from tttvideo.sample.video import Mp4Writer, write_scenes

        path = Path(path)
        if path.suffix.lower() != ".mp4":
            raise UserError(f"{path}: a video is saved as .mp4")
        check_writable_file(path, "the video path")
        with Mp4Writer(path, fps=self.fps) as writer:
            writer.append(self.frames)
        write_scenes(path, self.story.to_json(self.sampling))
        return path


class VideoPipeline:
    """Generates videos from scenes with a trained model, in the phases `tttv sample` runs: the text encoder (loaded
    and released on every call), the transformer (loaded on the first call and kept until `close()`), the VAE.

    Build it with `from_run` (a folder or model file `tttv train` wrote) or `from_pretrained` (a diffusers
    CogVideoX folder: its transformer with freshly initialised TTT layers, and its VAE and T5 when present)."""

    def __init__(self, config: Config, checkpoint: str | Path | None = None, device: str | None = None):
        from tttvideo.device import resolve_device

        self.config = config
        self.checkpoint = Path(checkpoint) if checkpoint else None
        if device is not None:
            config.sample.device = device
        self.device = resolve_device(config.sample.device, "sample.device")
        self._loaded: LoadedModel | None = None

    @classmethod
    def from_run(cls, path: str | Path, *, overrides: Sequence[str] = (), device: str | None = None) -> "VideoPipeline":
        """A run folder (its newest intact checkpoint), a checkpoint folder or a model file, with the config it was
        trained with (config.toml there) and `overrides` on top."""
        from tttvideo.runs import config_for_checkpoint, resolve_checkpoint

        if not Path(path).exists():
            raise UserError(f"{path} does not exist; give a run folder, checkpoint folder or model file written by "
                            f"tttv train")
        config = load_config(config_for_checkpoint(path), overrides)
        resolve_checkpoint(path, config)  # a damaged or foreign model fails here, before anything loads
        return cls(config, path, device)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, config: Config | str | Path | None = None,
                        overrides: Sequence[str] = (), device: str | None = None) -> "VideoPipeline":
        """A diffusers CogVideoX folder: the pipeline folder (transformer/, vae/, text_encoder/, tokenizer/) or the
        transformer folder alone. The TTT layers are new (randomly initialised, gates at ttt.gate_init)."""
        folder = Path(path)
        if not folder.is_dir():
            raise UserError(f"{path} is not a folder; give a diffusers CogVideoX folder (with transformer/, vae/, "
                            f"text_encoder/) or its transformer folder")
        cfg = as_config(config)
        cfg.model.pretrained_path = str(folder)
        if (folder / "vae").is_dir() and not cfg.sample.vae_path:
            cfg.sample.vae_path = str(folder)
        if (folder / "text_encoder").is_dir() and not cfg.sample.text_encoder_path:
            cfg.sample.text_encoder_path = str(folder)
        return cls(with_overrides(cfg, overrides), None, device)

    def __call__(self, scenes: Story | Sequence[str | dict] | str, *, steps: int | None = None,
                 seed: int | None = None, guidance: float | None = None, progress: bool = False) -> Video:
        """One video: a scene per 3 seconds. `scenes` is a list of scene texts or scene objects ({"text",
        "requires_scene_transition", "neg_text"}) or a Story; steps, seed and guidance override the config's
        sample.steps, sample.seed and sample.cfg."""
        from tttvideo.sample.pipeline import (decode_frames, denoise_stories, encode_stories, free_memory,
                                              make_story_decoder, sampling_record, story_layouts)

        story = scenes if isinstance(scenes, Story) else story_from_scenes(scenes)
        cfg = with_overrides(self.config, [f"sample.{key}={value}" for key, value in
                                           (("steps", steps), ("seed", seed), ("cfg", guidance)) if value is not None])
        [layout] = story_layouts(cfg, [story])
        [text], _ = encode_stories(cfg, [story], [layout], self.spec.text_embed_dim, self.device)
        [latents], _ = denoise_stories(self.model, [story], [layout], [text], cfg, self.device, progress=progress)
        decoder = make_story_decoder(cfg, self.device)
        frames = decode_frames(decoder, latents)
        del decoder
        free_memory()
        record = sampling_record(cfg, self.checkpoint, layout, len(frames))
        return Video(frames, layout.fps, story, record)

    @property
    def spec(self) -> BackboneConfig:
        """The backbone's sizes (the config's model.preset)."""
        from tttvideo.models.backbone import get_preset

        return get_preset(self.config.model.preset)

    @property
    def model(self) -> torch.nn.Module:
        """The transformer, loaded on first use."""
        if self._loaded is None:
            self._loaded = load_model(self.config, self.checkpoint, self.device,
                                      offload=self.config.sample.offload_blocks)
        return self._loaded.model

    def close(self) -> None:
        """Release the transformer (and its block offloader)."""
        if self._loaded is not None:
            self._loaded.close()
            self._loaded = None
            from tttvideo.sample.pipeline import free_memory

            free_memory()

    def __enter__(self) -> "VideoPipeline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
