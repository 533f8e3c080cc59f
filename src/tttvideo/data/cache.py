"""The latent cache: what training reads instead of videos and captions.

A cache is a folder with a JSONL manifest (one sample per line) and safetensors files:

    manifest.jsonl             {"id", "latent", "text": [one path per 3-s segment], "captions", "scene_start",
                                "scene_end", "source"}; paths relative to the manifest's folder
    latents/<id>.safetensors   "mean" and "logvar" of the VAE posterior, [C, T, h, w] (the VAE's own layout);
                               metadata "scaling_factor" (the VAE's latent scale, 0.7 for CogVideoX-5B)
    text/<id>-<seg>.safetensors "embedding" [text_tokens, text_dim] of one segment's prompt (scene tokens included);
                               metadata "caption", "tokens" (real tokens before padding)

Storing the posterior rather than one latent means every epoch sees a fresh latent sample, as the original does:
latent = (mean + exp(logvar / 2) * eps) * scaling_factor, with eps drawn from a generator seeded by (seed, data
position) so that a resumed run draws the very same latents. Samples come out in the transformer's layout
[T, C, h, w].

`LatentCache` checks every file against the layout when it opens the manifest (safetensors headers only, so it is
cheap), so a cache made for another duration, resolution or text length fails at start-up with one sentence naming
the file, not in the middle of a run. Every file is checked again when a sample is read: a file that cannot be read
any more, has another shape, or holds a NaN or an Inf (an +inf log-variance trains on silently with losses in the
hundreds) raises `DamagedSample` naming the file; `tttvideo.data.loader` puts another sample in its place and the
trainer counts it (`data.max_damaged_samples`).

The built-in demo set (a folder with `demo.json`) is synthetic: its advice is to delete the folder, which rebuilds
it, not to rerun `tttv precompute`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tttvideo.errors import UserError
from tttvideo.layout import VideoLayout

LATENT_FORMAT = "tttvideo-latent-v1"
TEXT_FORMAT = "tttvideo-text-v1"
MANIFEST_KEYS = ("id", "latent", "text", "captions", "scene_start", "scene_end", "source")


@dataclass
class CacheEntry:
    id: str
    latent: str
    text: list[str]
    captions: list[str] = field(default_factory=list)
    scene_start: list[bool] = field(default_factory=list)
    scene_end: list[bool] = field(default_factory=list)
    source: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)


# ------------------------------------------------------------------------------------------------ atomic writing
def atomic_save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path,
                            metadata: dict[str, str] | None = None) -> None:
    """Write to a temporary name in the same folder, then rename: a killed process never leaves half a file under
    the final name, which is what lets precompute resume by checking for the file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def atomic_write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_latent(path: str | Path, mean: torch.Tensor, logvar: torch.Tensor, scaling_factor: float,
                extra: dict[str, str] | None = None) -> None:
    """mean/logvar [C, T, h, w] of one clip; `extra` metadata (e.g. where it came from) is kept beside."""
    meta = {"format": LATENT_FORMAT, "scaling_factor": repr(float(scaling_factor)), **(extra or {})}
    atomic_save_safetensors({"mean": mean, "logvar": logvar}, path, meta)


def save_text(path: str | Path, embedding: torch.Tensor, caption: str, tokens: int,
              extra: dict[str, str] | None = None) -> None:
    """embedding [text_tokens, text_dim] of one segment's prompt."""
    meta = {"format": TEXT_FORMAT, "caption": caption, "tokens": str(int(tokens)), **(extra or {})}
    atomic_save_safetensors({"embedding": embedding}, path, meta)


def write_manifest(path: str | Path, entries: list[CacheEntry]) -> None:
    atomic_write_text(path, "".join(e.to_json() + "\n" for e in entries))


# ------------------------------------------------------------------------------------------------ reading
def read_manifest(path: str | Path) -> list[CacheEntry]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"manifest {path} does not exist; make a cache with `tttv precompute` or leave data.manifest "
                        f"empty for the built-in demo set")
    entries = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"manifest {path} line {lineno} is not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise UserError(f"manifest {path} line {lineno} must be a JSON object, got {type(row).__name__}")
            missing = [k for k in ("id", "latent", "text") if k not in row]
            unknown = sorted(set(row) - set(MANIFEST_KEYS))
            if missing or unknown:
                what = f"lacks {', '.join(missing)}" if missing else f"has unknown key {unknown[0]!r}"
                raise UserError(f"manifest {path} line {lineno} {what}; a sample takes {', '.join(MANIFEST_KEYS)}")
            if not isinstance(row["text"], list) or not all(isinstance(t, str) for t in row["text"]):
                raise UserError(f"manifest {path} line {lineno}: \"text\" must be a list of file paths, one per "
                                f"segment")
            entries.append(CacheEntry(**row))
    if not entries:
        raise UserError(f"manifest {path} lists no samples")
    return entries


DEMO_STAMP = "demo.json"  # the file tttvideo.data.demo writes in a demo set's folder


def rebuild_advice(root: Path, damaged: str = "it") -> str:
    """How to get intact files back: the demo set rebuilds itself; a real cache is precomputed again once the
    `damaged` files ("it", "them"; "" for files that are missing) are deleted (precompute recomputes missing files)."""
    if (root / DEMO_STAMP).is_file():
        return (f"the built-in demo set is synthetic: delete the folder {root} (data.demo_dir) and run again to "
                f"rebuild it")
    return f"{f'delete {damaged} and ' if damaged else ''}rerun `tttv precompute` (it recomputes missing files)"


class DamagedSample(Exception):
    """A cache file that passed the start-up check cannot be used when its sample is read: `path` and `why`."""

    def __init__(self, path: Path, why: str):
        self.path, self.why = Path(path), why
        super().__init__(f"{path}: {why}")


def _header(path: Path, keys: tuple[str, ...], root: Path) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Shapes of `keys` and the metadata of a safetensors file of the cache in `root`, reading only its header."""
    if not path.is_file():
        raise UserError(f"cache file {path} does not exist (listed in the manifest); "
                        f"{rebuild_advice(root, damaged='')}")
    try:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            missing = [k for k in keys if k not in names]
            if missing:
                raise UserError(f"cache file {path} has no tensor {missing[0]!r}; it was not written by tttv "
                                f"precompute")
            return {k: list(f.get_slice(k).get_shape()) for k in keys}, dict(f.metadata() or {})
    except UserError:
        raise
    except Exception as err:  # safetensors raises its own error types for truncated / foreign files
        raise UserError(f"cache file {path} is not a readable safetensors file ({err}); "
                        f"{rebuild_advice(root)}") from None


def read_checked(path: Path, keys: tuple[str, ...], shapes: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """The tensors `keys` of a cache file as float32, each of the shape in `shapes` and finite; DamagedSample
    naming the file otherwise."""
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k).float() for k in keys}
    except Exception as err:  # deleted, cut short, overwritten: safetensors' own error types, OSError, KeyError
        raise DamagedSample(path, f"cannot be read ({type(err).__name__}: {err})") from None
    for key, t in tensors.items():
        if list(t.shape) != shapes[key]:
            raise DamagedSample(path, f"{key} has shape {list(t.shape)}, not {shapes[key]} as at start-up")
        finite = torch.isfinite(t)
        if not bool(finite.all()):
            bad = t[~finite]
            raise DamagedSample(path, f"{key} holds {int(bad.isnan().sum())} NaN and {int(bad.isinf().sum())} Inf "
                                      f"value(s)")
    return tensors


def position_seed(seed: int, position: int) -> int:
    """A 63-bit seed for the latent draw of one data position; independent streams for neighbouring positions."""
    return int(np.random.SeedSequence([seed, position]).generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


class LatentCache(torch.utils.data.Dataset):
    """Samples of a cache, checked against `layout`; `sample(i, seed)` draws one latent from the posterior.

    latent_channels / text_dim: what the model expects (16 / 4096 for CogVideoX-5B).
    """

    def __init__(self, manifest: str | Path, layout: VideoLayout, latent_channels: int, text_dim: int):
        self.manifest = Path(manifest)
        self.root = self.manifest.parent
        self.layout = layout
        self.advice = rebuild_advice(self.root)
        self.entries = read_manifest(self.manifest)
        self.latent_shape = [latent_channels, layout.latent_frames, layout.latent_height, layout.latent_width]
        self.text_shape = [layout.text_tokens, text_dim]
        self.scaling = [self._check(e, latent_channels, text_dim) for e in self.entries]

    def __len__(self) -> int:
        return len(self.entries)

    def path(self, rel: str) -> Path:
        p = Path(rel)
        return p if p.is_absolute() else self.root / p

    def _check(self, entry: CacheEntry, channels: int, text_dim: int) -> float:
        lay = self.layout
        latent = self.path(entry.latent)
        shapes, meta = _header(latent, ("mean", "logvar"), self.root)
        want = [channels, lay.latent_frames, lay.latent_height, lay.latent_width]
        for key in ("mean", "logvar"):
            if shapes[key] != want:
                raise UserError(
                    f"latent file {latent} holds {key} of shape {shapes[key]} but the {lay.duration_s} s "
                    f"{lay.height}x{lay.width} layout needs [channels, latent frames, h, w] = {want}; precompute the "
                    f"cache with the same layout (duration, resolution) and VAE as the training config"
                )
        try:
            scaling = float(meta.get("scaling_factor", "1.0"))
        except ValueError:
            raise UserError(f"latent file {latent} has a scaling_factor that is not a number: "
                            f"{meta['scaling_factor']!r}") from None
        if len(entry.text) != lay.num_segments:
            raise UserError(
                f"sample {entry.id!r} in {self.manifest} has {len(entry.text)} text embedding file(s) but the "
                f"{lay.duration_s} s layout has {lay.num_segments} segment(s); precompute clips of {lay.num_frames} "
                f"frames with one caption per 3-s segment"
            )
        for rel in entry.text:
            text = self.path(rel)
            tshape = _header(text, ("embedding",), self.root)[0]["embedding"]
            if tshape != [lay.text_tokens, text_dim]:
                raise UserError(
                    f"text embedding file {text} has shape {tshape} but the {lay.duration_s} s layout needs "
                    f"[text tokens per segment, text dim] = [{lay.text_tokens}, {text_dim}]; precompute with "
                    f"layout.text_tokens = {lay.text_tokens} and the model's text encoder"
                )
        return scaling

    def sample(self, index: int, seed: int) -> dict[str, torch.Tensor]:
        """latents [T, C, h, w] (float32, one draw from the posterior, scaled) and text [segments, L, D]. A file
        that cannot be read, changed shape or holds NaN / Inf raises DamagedSample naming it."""
        entry = self.entries[index]
        shapes = {"mean": self.latent_shape, "logvar": self.latent_shape}
        posterior = read_checked(self.path(entry.latent), ("mean", "logvar"), shapes)
        mean, logvar = posterior["mean"], posterior["logvar"]
        gen = torch.Generator().manual_seed(seed)
        eps = torch.randn(mean.shape, generator=gen, dtype=torch.float32)
        # clamp as diffusers' DiagonalGaussianDistribution does, so a cache of either origin samples the same way
        std = torch.exp(0.5 * logvar.clamp(-30.0, 20.0))
        latent = (mean + std * eps) * self.scaling[index]
        text = []
        for rel in entry.text:
            text.append(read_checked(self.path(rel), ("embedding",), {"embedding": self.text_shape})["embedding"])
        return {"latents": latent.permute(1, 0, 2, 3).contiguous(), "text": torch.stack(text)}

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.sample(index, seed=index)

