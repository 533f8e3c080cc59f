"""Prompt encoding for sampling: T5 from a local folder, or the demo encoder; the encoder leaves the GPU afterwards.

Both encoders follow the training cache's conventions exactly (`tttvideo.data.precompute` for T5,
`tttvideo.data.demo.DemoTextEncoder` for the demo), because a model only understands features made the way its
training features were made:

- T5: loaded with the precompute loader (a transformers T5EncoderModel folder or a pipeline folder with
  text_encoder/ and tokenizer/), prompts padded to the layout's text length with padding="max_length" and no
  attention mask, as CogVideoX's pipeline does; bf16 on the GPU, fp32 on the CPU. The scene tokens `<start_scene>` /
  `<end_scene>` are plain text to the tokenizer, as in the cache (the original instead registered them as new
  special tokens with freshly initialised embeddings).
- demo: the same `DemoTextEncoder` kind and seed as the demo cache.

A prompt longer than the layout's text length is an error here (the cache truncates with a warning, but a user
writing a story should know that the end of a scene is being dropped).

`encode_story` returns CPU float32 features; `release()` deletes the encoder and empties the CUDA cache, so the
denoising loop never shares the GPU with T5 (SPEC section 6).
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any

import torch

from tttvideo.errors import UserError
from tttvideo.sample.scenes import Story

log = logging.getLogger(__name__)


class T5SceneEncoder:
    def __init__(self, path: str | Path, text_tokens: int, device: torch.device):
        from tttvideo.data.precompute import load_text_encoder

        self.path = Path(path)
        if not self.path.exists():
            raise UserError(f"T5 folder {self.path} does not exist; give sample.text_encoder_path (or "
                            f"data.text_encoder_path) a local T5EncoderModel folder")
        self.text_tokens = text_tokens
        self.device = device
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        self.tokenizer, self.model = load_text_encoder(self.path, device, dtype)
        self.text_dim = int(self.model.config.d_model)

    def describe(self) -> str:
        return f"T5 from {self.path} on {self.device}"

    def token_counts(self, prompts: list[str]) -> list[int]:
        return [len(ids) for ids in self.tokenizer(prompts, add_special_tokens=True)["input_ids"]]

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> torch.Tensor:
        ids = self.tokenizer(prompts, padding="max_length", max_length=self.text_tokens, truncation=True,
                             add_special_tokens=True, return_tensors="pt")["input_ids"].to(self.device)
        return self.model(ids)[0].float().cpu()

    def release(self) -> None:
        self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


class DemoSceneEncoder:
    def __init__(self, text_tokens: int, text_dim: int, kind: str = "auto", seed: int = 0):
        from tttvideo.data.demo import DemoTextEncoder

        self.encoder = DemoTextEncoder(text_tokens, text_dim, kind=kind, seed=seed)
        self.text_tokens, self.text_dim = text_tokens, text_dim
        self._counts: dict[str, int] = {}

    def describe(self) -> str:
        return f"demo text encoder ({self.encoder.describe()})"

    def token_counts(self, prompts: list[str]) -> list[int]:
        missing = [p for p in dict.fromkeys(prompts) if p not in self._counts]
        if missing:
            _, counts = self.encoder.encode(missing)
            self._counts.update(zip(missing, counts))
        return [self._counts[p] for p in prompts]

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> torch.Tensor:
        feats, _ = self.encoder.encode(prompts)
        return feats.float().cpu()

    def release(self) -> None:
        self.encoder = None


def make_text_encoder(cfg: Any, text_tokens: int, text_dim: int, device: torch.device):
    """The T5 named by sample.text_encoder_path / data.text_encoder_path, else the demo encoder."""
    # transformers' per-load progress bars would interleave with ours and turn one-sentence errors into many lines
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = cfg.sample.text_encoder_path or cfg.data.text_encoder_path
    if not path:
        return DemoSceneEncoder(text_tokens, text_dim, kind=cfg.data.demo_text_encoder, seed=cfg.train.seed)
    enc_device = torch.device("cpu") if cfg.sample.text_encoder_device == "cpu" else device
    enc = T5SceneEncoder(path, text_tokens, enc_device)
    if enc.text_dim != text_dim:
        enc.release()
        raise UserError(f"the T5 in {path} gives {enc.text_dim}-d features but the model takes {text_dim}-d; "
                        f"use the text encoder the model was trained with")
    return enc


def check_token_counts(encoder, story: Story, text_tokens: int, duration_s: int) -> None:
    """One sentence naming the first scene whose prompt (scene tokens included) does not fit the text length."""
    prompts, negatives = story.prompts(), story.negative_prompts()
    for kind, texts in (("text", prompts), ("neg_text", negatives)):
        for i, n in enumerate(encoder.token_counts(texts)):
            if n > text_tokens:
                raise UserError(
                    f"{story.source}: scene {i} of story {story.name!r} has {n} tokens in its {kind} (scene tokens "
                    f"included) but the {duration_s} s layout takes {text_tokens} per scene; shorten it or raise "
                    f"layout.text_tokens"
                )


def encode_story(encoder, story: Story) -> tuple[torch.Tensor, torch.Tensor]:
    """(conditional, unconditional) features, each [segments, text_tokens, text_dim] float32 on the CPU."""
    prompts, negatives = story.prompts(), story.negative_prompts()
    feats = encoder.encode(prompts + negatives)
    n = len(prompts)
    return feats[:n], feats[n:]
