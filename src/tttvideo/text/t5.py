"""T5 from a local folder: the text encoder of real data, for the training cache and for sampling alike.

A folder is a transformers T5EncoderModel folder, or a CogVideoX pipeline folder holding text_encoder/ and
tokenizer/. Prompts are padded to the layout's text length with padding="max_length" and no attention mask, as
CogVideoX's pipeline does, because a model only understands features made the way its training features were made.
The scene tokens `<start_scene>` / `<end_scene>` are plain text to the tokenizer (the original instead registered
them as new special tokens with freshly initialised embeddings).
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from tttvideo.errors import UserError


def pipeline_component(path: Path, name: str) -> Path:
    """A pipeline root (holding vae/, text_encoder/, tokenizer/) or the component folder itself."""
    return path / name if (path / name / "config.json").is_file() or (path / name).is_dir() else path


def load_text_encoder(path: Path, device: torch.device, dtype: torch.dtype):
    """(tokenizer, T5EncoderModel in eval mode on `device`) from a T5 or pipeline folder."""
    from transformers import AutoTokenizer, T5EncoderModel

    enc_folder = pipeline_component(path, "text_encoder")
    tok_folder = pipeline_component(path, "tokenizer")
    if not (enc_folder / "config.json").is_file():
        raise UserError(f"no T5 encoder in {path}: expected a transformers T5EncoderModel folder (config.json + "
                        f"weights) or a pipeline folder with text_encoder/ and tokenizer/")
    tokenizer = AutoTokenizer.from_pretrained(str(tok_folder), local_files_only=True)
    model = T5EncoderModel.from_pretrained(str(enc_folder), dtype=dtype, local_files_only=True)
    return tokenizer, model.to(device).eval()


def t5_dtype(device: torch.device) -> torch.dtype:
    # bf16 on the GPU as CogVideoX's pipeline runs T5; fp32 on the CPU, where bf16 matmuls are slow
    return torch.float32 if device.type == "cpu" else torch.bfloat16


class T5SceneEncoder:
    """Prompts -> [n, text_tokens, d_model] CPU float32 features; `release()` frees the model (and the GPU)."""

    def __init__(self, path: str | Path, text_tokens: int, device: torch.device):
        self.path = Path(path)
        if not self.path.exists():
            raise UserError(f"T5 folder {self.path} does not exist; give sample.text_encoder_path (or "
                            f"data.text_encoder_path) a local T5EncoderModel folder")
        self.text_tokens = text_tokens
        self.device = device
        self.tokenizer, self.model = load_text_encoder(self.path, device, t5_dtype(device))
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
