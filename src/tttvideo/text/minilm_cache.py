"""MiniLM's token features of each demo prompt, kept on disk between processes.

A fresh process spends 3-7 s of a laptop CPU importing transformers and loading MiniLM before it encodes a prompt:
most of what a demo `tttv sample`, or a short training launch of the test suite, does before its first step. A
prompt's features never change for the same weights, transformers and torch, so each is written once and read back
by later processes, which then never import transformers.

Where: `TTTV_CACHE_DIR`, else `$XDG_CACHE_HOME/tttvideo`, else `~/.cache/tttvideo`, in `demo-text-minilm/`;
`TTTV_CACHE_DIR=off` keeps nothing. One safetensors file per prompt, named by a hash of what made it (the weights'
SHA-256, the transformers and torch versions, the padded length, the prompt), holding the prompt's real token rows
(the padding rows are zeros and are not stored) and its token count. Written atomically; a file that cannot be read
back is recomputed; a folder that cannot be written leaves the encoder as fast as without a cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from importlib import metadata
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CACHE_ENV = "TTTV_CACHE_DIR"
FOLDER = "demo-text-minilm"


def cache_root() -> Path | None:
    """The user's tttvideo cache folder, or None when `TTTV_CACHE_DIR=off`."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen is not None:
        return None if chosen.strip().lower() in ("", "off", "0", "none") else Path(chosen).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tttvideo"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


class MiniLMFeatureCache:
    """get / put of one prompt's MiniLM rows [n, hidden] (n its real tokens, at most `max_length`) and token count."""

    def __init__(self, weights_sha256: str, max_length: int, root: Path | None = None):
        root = cache_root() if root is None else root
        self.folder = root / FOLDER if root is not None else None
        self.max_length = max_length
        # what the rows depend on: a change of any of these is another entry, never a stale one
        self._made_by = f"{weights_sha256}|transformers {_version('transformers')}|torch {torch.__version__}"

    def _key(self, prompt: str) -> str:
        return f"{self._made_by}|max_length {self.max_length}|{prompt}"

    def _path(self, key: str) -> Path:
        return self.folder / f"{hashlib.sha256(key.encode()).hexdigest()}.safetensors"

    def get(self, prompt: str) -> tuple[torch.Tensor, int] | None:
        if self.folder is None:
            return None
        key = self._key(prompt)
        path = self._path(key)
        if not path.is_file():
            return None
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                # a fresh allocation, as the encoder's rows are: the CPU's matrix product may take another path
                # for another memory alignment, and the features must be the same bits either way
                rows = f.get_tensor("rows").clone()
            count = int(meta["count"])
        except Exception as err:  # damaged (a crash mid-write before the rename cannot leave one, a full disk can)
            log.debug("demo text cache: %s unreadable (%s); encoding again", path, err)
            return None
        if meta.get("key") != key or rows.dim() != 2 or rows.shape[0] > self.max_length:
            return None
        return rows, count

    def put(self, prompt: str, rows: torch.Tensor, count: int) -> None:
        if self.folder is None:
            return
        from safetensors.torch import save_file

        key = self._key(prompt)
        path = self._path(key)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            save_file({"rows": rows.detach().float().contiguous()}, str(tmp), metadata={"key": key,
                                                                                      "count": str(count)})
            os.replace(tmp, path)
        except Exception as err:  # read-only, full (safetensors' own error type): the features are right, not kept
            log.debug("demo text cache: cannot write %s (%s)", path, err)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
