"""Weights every backbone shares: random initialisation on the meta device, and our own safetensors checkpoints in
and out (the backbone's config in the metadata, fp8 frozen weights quantised as they load). Outside checkpoints
(diffusers folders) are each backbone's own (`BackboneSpec.from_pretrained`, e.g. `models/cogvideox/weights.py`).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch
from torch import nn

from tttvideo.config.schema import TTTConfig
from tttvideo.dtypes import torch_dtype
from tttvideo.errors import UserError
from tttvideo.models.fp8_storage import Fp8Linear, quantize_rows

if TYPE_CHECKING:
    from tttvideo.models.backbone import Backbone

CHECKPOINT_FORMAT = "tttvideo-model-1"


def init_model(spec: Any, ttt: TTTConfig | None = None, use_ttt: bool = True, dtype: torch.dtype | str = torch.float32,
               device: torch.device | str = "cpu", sequence_layer: str = "ttt") -> Backbone:
    """A randomly initialised model of a preset config (`spec`, any registered backbone's) built directly on
    `device` in `dtype` (meta first, so no CPU copy of 5B). On the meta device itself: the skeleton with every shape
    and dtype and no data (the memory planner counts it)."""
    from tttvideo.models.backbone import backbone_of

    dtype = torch_dtype(dtype)
    build = backbone_of(spec).build
    with torch.device("meta"):
        model = build(spec, ttt, use_ttt, sequence_layer)
    if torch.device(device).type == "meta":
        return model.to(dtype)
    materialize(model, torch.device(device), dtype)
    return model


def _reset_units(module: nn.Module) -> Iterator[nn.Module]:
    """Modules whose reset_parameters initialises their whole subtree (Linear, LayerNorm, Conv2d, the TTT layer)."""
    if callable(getattr(module, "reset_parameters", None)):
        yield module
        return
    if any(True for _ in module.parameters(recurse=False)):
        raise TypeError(f"{type(module).__name__} owns parameters but has no reset_parameters")
    for child in module.children():
        yield from _reset_units(child)


# a diffusers model folder: config.json and one safetensors file, or shards named by an index
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a diffusers model folder (every shard its index names, or its one file)."""
    index = folder / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise UserError(f"{folder}: the shard index names {', '.join(absent)}, which is not there (incomplete "
                            f"download?)")
        return files
    if (folder / WEIGHTS_NAME).is_file():
        return [folder / WEIGHTS_NAME]
    files = sorted(folder.glob("*.safetensors"))
    if len(files) == 1:
        return files
    raise UserError(f"{folder}: found {len(files)} .safetensors files and no {INDEX_NAME}; expected one file or an "
                    f"index")


def find_diffusers_folder(path: str | Path, download: str, layout: str) -> Path:
    """The folder holding a diffusers transformer's config.json and weights: `path` itself or its `transformer/`
    subfolder. `download` names what model.pretrained_path should point at, `layout` whose folder layout is meant,
    for the errors."""
    path = Path(path).expanduser()
    for folder in (path, path / "transformer"):
        has_weights = (folder / INDEX_NAME).is_file() or any(folder.glob("*.safetensors"))
        if (folder / CONFIG_NAME).is_file() and has_weights:
            return folder
    if not path.exists():
        raise UserError(f"model folder {path} does not exist; point model.pretrained_path at a {download} download")
    raise UserError(f"{path} is not a diffusers transformer folder: expected config.json and "
                    f"diffusion_pytorch_model*.safetensors in it or in its transformer/ subfolder (the layout of "
                    f"{layout})")


def load_mapped_weights(model: nn.Module, folder: Path, name_map: dict[str, str], expected: dict[str, torch.Tensor],
                        device: torch.device, dtype: torch.dtype, label: str,
                        ignored: tuple[str, ...] = ()) -> None:
    """Assign the tensors of a diffusers folder's safetensors files to `model` (built on the meta device), renamed by
    `name_map` (theirs -> ours), each checked against `expected` (ours -> the meta parameter); keys containing one
    of `ignored` are skipped. Missing, unexpected and wrongly shaped tensors are one UserError naming them; the
    parameters not in `expected` (the TTT layers) stay on meta for `materialize`."""
    from safetensors import safe_open

    loaded: set[str] = set()
    unexpected: list[str] = []
    wrong_shape: list[str] = []
    for file in weight_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                ours = name_map.get(key)
                if ours is None or ours not in expected:
                    if not any(part in key for part in ignored):
                        unexpected.append(key)
                    continue
                shape = tuple(f.get_slice(key).get_shape())
                if shape != tuple(expected[ours].shape):
                    wrong_shape.append(f"{key} {list(shape)} (model has {list(expected[ours].shape)})")
                    continue
                assign_tensor(model, ours, f.get_tensor(key).to(device=device, dtype=dtype))
                loaded.add(ours)
    inverse = {o: d for d, o in name_map.items()}
    problems = [f"{what} {_names(v)}" for what, v in
                (("missing", [inverse.get(n, n) for n in expected if n not in loaded]), ("unexpected", unexpected),
                 ("wrong shape", wrong_shape)) if v]
    if problems:
        raise UserError(f"{folder} does not fit the {label!r} model: {'; '.join(problems)}")


@torch.no_grad()
def save_mapped_folder(model: nn.Module, folder: str | Path, name_map: dict[str, str], config: dict[str, Any],
                       shard_bytes: int = 5 * 2**30) -> Path:
    """Write `model`'s parameters that `name_map` (diffusers name -> ours) names as a diffusers model folder:
    config.json (`config`), safetensors shards of at most `shard_bytes` and their index, what a download holds.
    Benchmarks make full-size random-weight folders with it, to run the loading path without the real weights; the
    TTT layers are not part of that layout. Written under a temporary name and renamed, so the folder appears
    whole."""
    from safetensors.torch import save_file

    folder = Path(folder)
    if has_fp8_layers(model):  # the folder would silently lack those layers, and loading it would fail much later
        raise ValueError("the model stores frozen weights as fp8 codes, which the diffusers layout cannot hold: build "
                         "it with model.frozen_weights = 'dtype' to write it")
    tmp = folder.with_name(folder.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    inverse = {o: d for d, o in name_map.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in model.state_dict().items():
        if name not in inverse:  # TTT parameters, buffers
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][inverse[name]] = tensor.detach().to("cpu").contiguous()
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(tmp / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
    total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
    (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2))
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)
    return folder


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Allocate and initialise every parameter still on the meta device, one reset unit at a time (fp32 init, then
    cast), so the peak is the model in `dtype` plus one unit in fp32."""
    for unit in _reset_units(model):
        if not any(p.is_meta for p in unit.parameters()):
            continue
        if not all(p.is_meta for p in unit.parameters()):
            raise RuntimeError(f"{type(unit).__name__} is partly loaded; cannot initialise it alone")
        unit.to_empty(device=device)
        unit.float()
        unit.reset_parameters()
        unit.to(dtype)
    left = [n for n, p in model.named_parameters() if p.is_meta] + [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        raise RuntimeError(f"still on the meta device after initialisation: {_names(left)}")


def assign_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace parameter `name` by `tensor` (no copy), keeping its requires_grad."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    old = module._parameters[attr]
    module._parameters[attr] = nn.Parameter(tensor, requires_grad=old.requires_grad)


def _names(names: Iterable[str], limit: int = 8) -> str:
    names = list(names)
    text = ", ".join(names[:limit])
    return f"{text} (+{len(names) - limit} more)" if len(names) > limit else text


# ---------------------------------------------------------------------------------------------------- own checkpoints
def save_checkpoint(model: Backbone, path: str | Path, trainable_only: bool = False,
                    trained_duration_s: int | None = None) -> Path:
    """Parameters (all, or only those with requires_grad) as one safetensors file with the spec in its metadata,
    and the longest video duration the weights were trained on when known (`checkpoint_info`). A model with fp8
    frozen weights saves its parameters only (the fp8 codes are buffers), so its file is marked partial: whoever
    loads it builds the frozen weights from `model.pretrained_path` first, as for a trainable-only file."""
    from tttvideo.tensorfile import write_safetensors

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad or not trainable_only}
    metadata = {
        "format": CHECKPOINT_FORMAT,
        "spec": json.dumps(dataclasses.asdict(model.spec)),
        "use_ttt": str(model.use_ttt),
        "sequence_layer": model.sequence_layer,
        "partial": str(trainable_only or has_fp8_layers(model)),
    }
    if trained_duration_s is not None:
        metadata["trained_duration_s"] = str(int(trained_duration_s))
    write_safetensors(tensors, path, metadata)  # chunk by chunk through host memory, hashed on the way
    return path


def has_fp8_layers(model: object) -> bool:
    """Whether `model` stores frozen weights as fp8 codes (buffers, which no parameter list holds)."""
    # the multi-process trainer saves a gathered stand-in (train/dcp.py) with the sharded model's modules
    modules = getattr(model, "modules", None)
    return modules is not None and any(isinstance(m, Fp8Linear) for m in modules())


def model_file_metadata(path: str | Path) -> dict[str, str]:
    """The metadata of a `save_checkpoint` file, read from its header; a UserError naming the file when it is
    missing, truncated, not safetensors or not a tttvideo model (safetensors checks the header against the file
    size, so a cut-off file fails here, before anything is loaded)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
    except Exception as err:  # safetensors has its own error types for damaged headers and short files
        raise UserError(f"{path} is not a readable safetensors file ({err}); it is damaged or was not written by "
                        f"tttv train: use an intact checkpoint") from None
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise UserError(f"{path} is not a tttvideo model checkpoint (for diffusers folders use from_pretrained)")
    return meta


def check_same_model(path: str | Path, meta: dict[str, str], spec: Any, hint: str = "") -> None:
    """A UserError when the model file `path` (its `model_file_metadata`) was saved from a backbone of other
    sizes than `spec` (a preset config), naming the fields that differ: the config's SHAPE_FIELDS when it names
    them, else every field."""
    saved = json.loads(meta["spec"])
    # through JSON as the saved one went, so that tuple fields (Wan's patch_size) compare as the lists they become
    ours = json.loads(json.dumps(dataclasses.asdict(spec)))
    fields = getattr(spec, "SHAPE_FIELDS", tuple(ours))
    diff = [f"{k} {saved.get(k)!r} (model has {ours[k]!r})" for k in fields if saved.get(k) != ours[k]]
    if diff:
        raise UserError(f"{path} was saved from model {saved.get('name')!r}, not {spec.name!r}: {'; '.join(diff)}"
                        f"{hint}")


def trained_duration(path: str | Path) -> int | None:
    """The longest video (seconds) the weights of a tttvideo model file were trained on: its metadata, else the
    `layout.duration` of the `config.toml` the trainer writes beside it; None when neither says."""
    path = Path(path)
    try:
        value = model_file_metadata(path).get("trained_duration_s")
    except UserError:  # an unreadable file is the loader's to report
        return None
    if value is not None:
        return int(value)
    beside = path.parent / "config.toml"
    if beside.is_file():
        from tttvideo.config.loader import load_config
        from tttvideo.layout import parse_duration

        try:
            return parse_duration(load_config(beside).layout.duration)
        except UserError:
            return None
    return None


@torch.no_grad()
def load_checkpoint(model: Backbone, path: str | Path) -> list[str]:
    """Copy a save_checkpoint file into `model`. Every tensor must exist in the model with its shape; a full
    checkpoint must also cover every parameter. The weight of a layer the model stores in fp8
    (`model.frozen_weights = "fp8"`) is quantised as it loads, one layer at a time, exactly as `store_fp8` would
    have converted it: a full bf16 or fp32 checkpoint loads into a model with fp8 frozen weights. Returns the names
    loaded."""
    from safetensors import safe_open

    path = Path(path)
    meta = model_file_metadata(path)
    own = dict(model.named_parameters())
    fp8 = {f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
    shapes = {**{k: tuple(p.shape) for k, p in own.items()}, **{k: (m.out_features, m.in_features)
                                                                 for k, m in fp8.items()}}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        check_same_model(path, meta, model.spec)
        keys = list(f.keys())
        unexpected = [k for k in keys if k not in shapes]
        wrong = [k for k in keys if k in shapes and tuple(f.get_slice(k).get_shape()) != shapes[k]]
        missing = [] if meta.get("partial") == "True" else [n for n in own if n not in set(keys)]
        if unexpected or wrong or missing:
            parts = [f"{label} {_names(v)}" for label, v in
                     (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if v]
            raise UserError(
                f"{path} does not fit this model ({'; '.join(parts)}); was it saved with another adapter, use_ttt or "
                f"sequence_layer?"
            )
        for k in keys:
            if k in fp8:
                _load_fp8(fp8[k], f.get_tensor(k))
                continue
            p = own[k]
            p.copy_(f.get_tensor(k).to(device=p.device, dtype=p.dtype))
    return keys


def _load_fp8(layer: Fp8Linear, weight: torch.Tensor) -> None:
    # through the dtype the model was built in, as store_fp8 quantises a loaded model's weight: the same codes
    codes, scale = quantize_rows(weight.to(device=layer.weight_fp8.device, dtype=layer.dtype))
    layer.weight_fp8.copy_(codes)
    layer.weight_scale.copy_(scale)
