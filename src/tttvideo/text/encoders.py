"""The text encoder a sampler uses: the one the model's backbone names (T5 for CogVideoX, umT5 for Wan) from the
folder the config gives, else the demo encoder, with the conventions of the training cache they stand for
(`tttvideo.text.t5`, `tttvideo.text.umt5`, `tttvideo.text.demo`).

Every encoder returns CPU float32 features, and `release()` frees it, so the denoising loop never shares the GPU
with T5.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from tttvideo.config.schema import Config
from tttvideo.errors import UserError
from tttvideo.models.backbone import backbone_of
from tttvideo.text.demo import DemoSceneEncoder
from tttvideo.text.t5 import T5SceneEncoder
from tttvideo.text.umt5 import UMT5SceneEncoder


class TextEncoder(Protocol):
    text_tokens: int
    text_dim: int

    def describe(self) -> str: ...

    def token_counts(self, prompts: list[str]) -> list[int]:
        """Tokens of each prompt before padding or truncation."""
        ...

    def encode(self, prompts: list[str]) -> torch.Tensor:
        """[n, text_tokens, text_dim] float32 on the CPU."""
        ...

    def release(self) -> None: ...


# the text encoders a backbone can name (`BackboneSpec.text_encoder`): kind -> (folder, text_tokens, device) -> encoder
TEXT_ENCODERS: dict[str, Callable[[str, int, torch.device], TextEncoder]] = {"t5": T5SceneEncoder,
                                                                              "umt5": UMT5SceneEncoder}


def make_text_encoder(cfg: Config, text_tokens: int, text_dim: int, device: torch.device) -> TextEncoder:
    """The text encoder of the model's backbone (T5 for CogVideoX, umT5 for Wan) from sample.text_encoder_path /
    data.text_encoder_path, else the demo encoder."""
    path = cfg.sample.text_encoder_path or cfg.data.text_encoder_path
    if not path:
        return DemoSceneEncoder(text_tokens, text_dim, kind=cfg.data.demo_text_encoder, seed=cfg.train.seed)
    # transformers' per-load progress bars would interleave with ours and turn one-sentence errors into many lines
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    backbone = backbone_of(cfg.model.preset)
    if backbone.text_encoder not in TEXT_ENCODERS:
        raise UserError(f"a text encoder folder is set ({path}), but the {backbone.name!r} backbone of model.preset "
                        f"{cfg.model.preset!r} names none tttvideo can load; leave sample.text_encoder_path and "
                        f"data.text_encoder_path empty for the demo encoder")
    enc_device = torch.device("cpu") if cfg.sample.text_encoder_device == "cpu" else device
    enc = TEXT_ENCODERS[backbone.text_encoder](path, text_tokens, enc_device)
    if enc.text_dim != text_dim:
        enc.release()
        raise UserError(f"the {backbone.text_encoder} in {path} gives {enc.text_dim}-d features but the model takes "
                        f"{text_dim}-d; use the text encoder the model was trained with")
    return enc
