"""Weights: diffusers CogVideoX folders in, our own safetensors checkpoints in and out, random initialisation.

`from_pretrained(path)` reads the `transformer/` folder of a CogVideoX download (config.json plus
`diffusion_pytorch_model-0000X-of-0000Y.safetensors` with its `.index.json`, or one `.safetensors` file). The model is
built on the meta device and every tensor is read shard by shard with `safe_open` and assigned in place of its meta
parameter, so the weights exist once in memory (plus one tensor in flight). Names go through an explicit map
(`diffusers_name_map`). The TTT parameters, which diffusers does not have, are then materialised and initialised as
the original does (`BidirectionalTTT.reset_parameters`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from tttvideo.config.schema import TTTConfig
from tttvideo.dtypes import torch_dtype
from tttvideo.errors import UserError
from tttvideo.models.adapters import is_ttt_parameter
from tttvideo.models.fp8_storage import Fp8Linear, quantize_rows
from tttvideo.models.presets import ModelSpec, describe_config
from tttvideo.models.transformer import CogVideoXTTT

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
DIFFUSERS_CLASS = "CogVideoXTransformer3DModel"
CHECKPOINT_FORMAT = "tttvideo-model-1"


def diffusers_name_map(num_layers: int) -> dict[str, str]:
    """diffusers parameter name -> ours, for every parameter a CogVideoX 1.0 transformer can have."""
    pairs = {
        "patch_embed.proj": "embed.patch",
        "patch_embed.text_proj": "embed.text",
        "time_embedding.linear_1": "time_embed.linear1",
        "time_embedding.linear_2": "time_embed.linear2",
        "norm_final": "norm_final",
        "norm_out.linear": "norm_out.linear",
        "norm_out.norm": "norm_out.norm",
        "proj_out": "proj_out",
    }
    block = {
        "norm1.linear": "norm1.linear",
        "norm1.norm": "norm1.norm",
        "attn1.to_q": "attn.to_q",
        "attn1.to_k": "attn.to_k",
        "attn1.to_v": "attn.to_v",
        "attn1.to_out.0": "attn.to_out",
        "attn1.norm_q": "attn.norm_q",
        "attn1.norm_k": "attn.norm_k",
        "norm2.linear": "norm2.linear",
        "norm2.norm": "norm2.norm",
        "ff.net.0.proj": "mlp.fc1",
        "ff.net.2": "mlp.fc2",
    }
    for i in range(num_layers):
        pairs.update({f"transformer_blocks.{i}.{d}": f"blocks.{i}.{o}" for d, o in block.items()})
    return {f"{d}.{suffix}": f"{o}.{suffix}" for d, o in pairs.items() for suffix in ("weight", "bias")}


# ---------------------------------------------------------------------------------------------------- folders
def find_transformer_folder(path: str | Path) -> Path:
    """The folder holding the transformer's config.json: `path` itself or its `transformer/` subfolder."""
    path = Path(path).expanduser()
    for folder in (path, path / "transformer"):
        if (folder / CONFIG_NAME).is_file() and (
            (folder / INDEX_NAME).is_file() or any(folder.glob("*.safetensors"))
        ):
            return folder
    if not path.exists():
        raise UserError(f"model folder {path} does not exist; point model.pretrained_path at a CogVideoX-5B download")
    raise UserError(
        f"{path} is not a diffusers transformer folder: expected config.json and diffusion_pytorch_model*.safetensors "
        f"in it or in its transformer/ subfolder (the layout of a CogVideoX-5B download)"
    )


def read_config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / CONFIG_NAME).read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{folder / CONFIG_NAME} is not valid JSON ({e.msg} at line {e.lineno})") from None
    cls = config.get("_class_name")
    if cls is not None and cls != DIFFUSERS_CLASS:
        raise UserError(f"{folder} holds a {cls}, not a {DIFFUSERS_CLASS}; point at the transformer/ folder")
    return config


def weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise UserError(f"{folder}: the shard index names {', '.join(absent)}, which is not there (incomplete download?)")
        return files
    if (folder / WEIGHTS_NAME).is_file():
        return [folder / WEIGHTS_NAME]
    files = sorted(folder.glob("*.safetensors"))
    if len(files) == 1:
        return files
    raise UserError(f"{folder}: found {len(files)} .safetensors files and no {INDEX_NAME}; expected one file or an index")


def spec_for_folder(config: dict[str, Any], folder: Path, spec: ModelSpec | None) -> ModelSpec:
    """The folder's spec, checked against the requested preset; a folder of another model is an error saying which."""
    try:
        found = ModelSpec.from_diffusers_config(config, name=folder.name)
    except UserError as e:
        raise UserError(f"{folder} holds {describe_config(config)}: {e}") from None
    if spec is None:
        return found
    diff = spec.mismatches(found)
    if diff:
        raise UserError(
            f"{folder} holds {describe_config(config)}, not the {spec.name!r} preset: {'; '.join(diff)}; "
            f"set model.preset to match the folder or point model.pretrained_path at a {spec.name} download"
        )
    return spec


# ---------------------------------------------------------------------------------------------------- loading
def from_pretrained(
    path: str | Path,
    spec: ModelSpec | None = None,
    ttt: TTTConfig | None = None,
    use_ttt: bool = True,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    sequence_layer: str = "ttt",
) -> CogVideoXTTT:
    """Our model with the backbone weights of a diffusers CogVideoX transformer folder and freshly initialised TTT.

    spec: the preset the folder must match (None: take the folder's own config). ttt: a TTTConfig.
    """
    dtype = torch_dtype(dtype)
    device = torch.device(device)
    folder = find_transformer_folder(path)
    config = read_config(folder)
    spec = spec_for_folder(config, folder, spec)
    files = weight_files(folder)

    with torch.device("meta"):
        model = CogVideoXTTT(spec, ttt, use_ttt, sequence_layer)
    expected = {n: p for n, p in model.named_parameters() if not is_ttt_parameter(n)}
    name_map = diffusers_name_map(spec.num_layers)
    loaded: set[str] = set()
    unexpected: list[str] = []
    wrong_shape: list[str] = []
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                ours = name_map.get(key)
                if ours is None or ours not in expected:
                    unexpected.append(key)
                    continue
                shape = tuple(f.get_slice(key).get_shape())
                if shape != tuple(expected[ours].shape):
                    wrong_shape.append(f"{key} {list(shape)} (model has {list(expected[ours].shape)})")
                    continue
                assign_tensor(model, ours, f.get_tensor(key).to(device=device, dtype=dtype))
                loaded.add(ours)
    inverse = {o: d for d, o in name_map.items()}
    missing = [inverse.get(n, n) for n in expected if n not in loaded]
    problems = []
    if missing:
        problems.append(f"missing {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected {_names(unexpected)}")
    if wrong_shape:
        problems.append(f"wrong shape {_names(wrong_shape)}")
    if problems:
        raise UserError(f"{folder} does not fit the {spec.name!r} model: {'; '.join(problems)}")
    materialize(model, device, dtype)  # only the TTT parameters are still on meta
    return model


def init_model(spec: ModelSpec, ttt: TTTConfig | None = None, use_ttt: bool = True, dtype: torch.dtype | str = torch.float32,
               device: torch.device | str = "cpu", sequence_layer: str = "ttt") -> CogVideoXTTT:
    """A randomly initialised model built directly on `device` in `dtype` (meta first, so no CPU copy of 5B). On
    the meta device itself: the skeleton with every shape and dtype and no data (the memory planner counts it)."""
    dtype = torch_dtype(dtype)
    with torch.device("meta"):
        model = CogVideoXTTT(spec, ttt, use_ttt, sequence_layer)
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
def save_checkpoint(model: CogVideoXTTT, path: str | Path, trainable_only: bool = False,
                    trained_duration_s: int | None = None) -> Path:
    """Parameters (all, or only those with requires_grad) as one safetensors file with the spec in its metadata,
    and the longest video duration the weights were trained on when known (`checkpoint_info`). A model with fp8
    frozen weights saves its parameters only (the fp8 codes are buffers), so its file is marked partial: whoever
    loads it builds the frozen weights from `model.pretrained_path` first, as for a trainable-only file."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad or not trainable_only}
    metadata = {
        "format": CHECKPOINT_FORMAT,
        "spec": json.dumps(dataclasses.asdict(model.spec)),
        "use_ttt": str(model.use_ttt),
        "sequence_layer": model.sequence_layer,
        "partial": str(trainable_only or _has_fp8_layers(model)),
    }
    if trained_duration_s is not None:
        metadata["trained_duration_s"] = str(int(trained_duration_s))
    save_file(tensors, str(path), metadata=metadata)
    return path


def _has_fp8_layers(model: object) -> bool:
    # the multi-process trainer saves a gathered stand-in (train/dcp.py) that has parameters but no modules
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


def check_same_model(path: str | Path, meta: dict[str, str], spec: ModelSpec, hint: str = "") -> None:
    """A UserError when the model file `path` (its `model_file_metadata`) was saved from a backbone of other
    sizes than `spec`, naming the fields that differ."""
    saved = json.loads(meta["spec"])
    ours = dataclasses.asdict(spec)
    diff = [f"{k} {saved.get(k)!r} (model has {ours[k]!r})" for k in ModelSpec.SHAPE_FIELDS if saved.get(k) != ours[k]]
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
def load_checkpoint(model: CogVideoXTTT, path: str | Path) -> list[str]:
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
