"""Reading another system's checkpoint without running code from it.

safetensors files are read directly (a JSON header and raw tensor bytes). A .pt/.pth/.bin file is read only with
`torch.load(weights_only=True)`, which unpickles tensors and plain containers and refuses anything else. A
torch.distributed.checkpoint (DCP) folder keeps its index in `.metadata`, a pickle that may run code when read, so
it is read only when the user vouches for it (`trust`); its tensor files are then read into tensors we allocate.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import torch

from tttvideo.errors import UserError
from tttvideo.runs import TRUST_FLAG

TORCH_SUFFIXES = (".pt", ".pth", ".bin")
DCP_METADATA = ".metadata"


class Checkpoint:
    """The tensors of a checkpoint by stored name: `shapes` without reading them, `read` the ones asked for."""

    def __init__(self, path: Path, shapes: dict[str, tuple[int, ...]],
                 read: Callable[[list[str]], dict[str, torch.Tensor]]):
        self.path, self.shapes, self._read = path, shapes, read

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        return self._read(keys)


def open_checkpoint(path: str | Path, trust: bool = False) -> Checkpoint:
    """A checkpoint file or folder: a DCP folder (only with `trust`), one or more .safetensors files, or one
    .pt/.pth/.bin state dict."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"checkpoint {path} does not exist")
    if path.is_dir() and (path / DCP_METADATA).is_file():
        return _dcp(path, trust)
    if path.is_dir():
        safetensors = sorted(path.glob("*.safetensors"))
        if safetensors:
            return _safetensors(path, safetensors)
        pickled = sorted(p for p in path.iterdir() if p.suffix in TORCH_SUFFIXES)
        if len(pickled) == 1:
            return _torch_file(pickled[0])
        raise UserError(f"{path} holds no {DCP_METADATA} (a torch.distributed.checkpoint folder), no .safetensors "
                        f"file and {'several' if pickled else 'no'} .pt/.pth/.bin files; point at the checkpoint "
                        f"folder or at one weights file")
    if path.suffix == ".safetensors":
        return _safetensors(path, [path])
    if path.suffix in TORCH_SUFFIXES:
        return _torch_file(path)
    raise UserError(f"{path} is not a checkpoint this command reads: give a torch.distributed.checkpoint folder, a "
                    f".safetensors file or a .pt/.pth/.bin state dict")


def _safetensors(path: Path, files: list[Path]) -> Checkpoint:
    from safetensors import safe_open

    where: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for k in f.keys():
                    where[k], shapes[k] = file, tuple(f.get_slice(k).get_shape())
        except Exception as err:  # safetensors has its own error types for damaged headers and short files
            raise UserError(f"{file} is not a readable safetensors file ({err})") from None

    def read(keys: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for file in sorted({where[k] for k in keys}):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                out.update({k: f.get_tensor(k) for k in keys if where[k] == file})
        return out

    return Checkpoint(path, shapes, read)


def _torch_file(path: Path) -> Checkpoint:
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"{path} holds more than tensors and plain containers, and this command never unpickles "
                        f"other objects (they can run code; torch.load with weights_only refused: {first}); save "
                        f"its model state dict as safetensors or point at its torch.distributed.checkpoint folder"
                        ) from None
    except (RuntimeError, OSError, EOFError) as err:
        raise UserError(f"{path} is not a readable torch file ({err})") from None
    tensors = _flatten(loaded, path)
    return Checkpoint(path, {k: tuple(t.shape) for k, t in tensors.items()},
                      lambda keys: {k: tensors[k] for k in keys})


def _flatten(obj: object, path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Nested dicts of tensors ({"model": {...}}) -> {"model.name": tensor}; other leaves are left out."""
    if isinstance(obj, torch.Tensor):
        return {prefix[:-1]: obj}
    if not isinstance(obj, dict):
        return {}
    out: dict[str, torch.Tensor] = {}
    for k, v in obj.items():
        out.update(_flatten(v, path, f"{prefix}{k}."))
    return out


def _dcp(path: Path, trust: bool) -> Checkpoint:
    if not trust:
        raise UserError(f"{path} is a torch.distributed.checkpoint folder, whose {DCP_METADATA} file is a Python "
                        f"pickle that can run code when it is read; pass {TRUST_FLAG} if you trust where it came "
                        f"from")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(path))
    try:
        metadata = reader.read_metadata()
    except Exception as err:  # whatever unpickling a damaged index raises
        raise UserError(f"{path / DCP_METADATA} cannot be read ({type(err).__name__}: {err})") from None
    stored = {k: m for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}

    def read(keys: list[str]) -> dict[str, torch.Tensor]:
        out = {k: torch.empty(tuple(stored[k].size), dtype=stored[k].properties.dtype) for k in keys}
        dcp.load(out, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
        return out

    return Checkpoint(path, {k: tuple(m.size) for k, m in stored.items()}, read)
