"""umT5 from a local folder: Wan2.1's text encoder, for the training cache and for sampling alike.

A folder is a transformers `UMT5EncoderModel` folder with its tokenizer beside it, or a Wan pipeline folder
(`Wan-AI/Wan2.1-T2V-1.3B-Diffusers`) holding text_encoder/ and tokenizer/. Features are made the way diffusers'
`WanPipeline` makes them: the prompt cleaned (HTML entities undone, whitespace collapsed; ftfy's fixes too when
ftfy is installed), tokenized to the layout's text length (Wan: 512) with truncation, encoded WITH the attention
mask, and every position past the prompt's own tokens set to zero. The model takes the zero-padded features
unmasked, so a different padding would be a different input.
"""

from __future__ import annotations

import gc
import html
import re
from pathlib import Path

import torch

from tttvideo.errors import UserError
from tttvideo.text.t5 import pipeline_component, t5_dtype


def clean_prompt(text: str) -> str:
    """diffusers' Wan prompt cleaning: ftfy (if installed), HTML entities undone twice, whitespace collapsed."""
    try:
        import ftfy

        text = ftfy.fix_text(text)
    except ImportError:
        pass
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


def load_umt5(path: Path, device: torch.device, dtype: torch.dtype):
    """(tokenizer, UMT5EncoderModel in eval mode on `device`) from a umT5 or Wan pipeline folder."""
    from transformers import AutoTokenizer, UMT5EncoderModel

    enc_folder = pipeline_component(path, "text_encoder")
    tok_folder = pipeline_component(path, "tokenizer")
    if not (enc_folder / "config.json").is_file():
        raise UserError(f"no umT5 encoder in {path}: expected a transformers UMT5EncoderModel folder (config.json + "
                        f"weights) or a Wan pipeline folder with text_encoder/ and tokenizer/")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tok_folder), local_files_only=True)
        model = UMT5EncoderModel.from_pretrained(str(enc_folder), dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load umT5 from {path}: {str(err).splitlines()[0]}") from None
    return tokenizer, model.to(device).eval()


class UMT5SceneEncoder:
    """Prompts -> [n, text_tokens, d_model] CPU float32 features, zero past each prompt's tokens; `release()` frees
    the model (and the GPU)."""

    def __init__(self, path: str | Path, text_tokens: int, device: torch.device):
        self.path = Path(path)
        if not self.path.exists():
            raise UserError(f"umT5 folder {self.path} does not exist; give sample.text_encoder_path (or "
                            f"data.text_encoder_path) a local UMT5EncoderModel folder or the Wan pipeline folder")
        self.text_tokens = text_tokens
        self.device = device
        self.tokenizer, self.model = load_umt5(self.path, device, t5_dtype(device))
        self.text_dim = int(self.model.config.d_model)

    def describe(self) -> str:
        return f"umT5 from {self.path} on {self.device}"

    def token_counts(self, prompts: list[str]) -> list[int]:
        prompts = [clean_prompt(p) for p in prompts]
        return [len(ids) for ids in self.tokenizer(prompts, add_special_tokens=True)["input_ids"]]

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> torch.Tensor:
        tokens = self.tokenizer([clean_prompt(p) for p in prompts], padding="max_length",
                                max_length=self.text_tokens, truncation=True, add_special_tokens=True,
                                return_attention_mask=True, return_tensors="pt")
        mask = tokens["attention_mask"].to(self.device)
        features = self.model(tokens["input_ids"].to(self.device), mask).last_hidden_state.float()
        return (features * mask[..., None].to(features.dtype)).cpu()

    def release(self) -> None:
        self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
