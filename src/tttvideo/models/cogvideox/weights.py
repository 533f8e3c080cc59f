"""CogVideoX weights in diffusers' layout: a `transformer/` folder of a CogVideoX download into our model.

`from_pretrained(path)` reads the folder (config.json plus `diffusion_pytorch_model-0000X-of-0000Y.safetensors` with
its `.index.json`, or one `.safetensors` file). The model is built on the meta device and every tensor is read shard
by shard with `safe_open` and assigned in place of its meta parameter, so the weights exist once in memory (plus one
tensor in flight). Names go through an explicit map (`diffusers_name_map`). The TTT parameters, which diffusers does
not have, are then materialised and initialised as the original does (`BidirectionalTTT.reset_parameters`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tttvideo.config.schema import TTTConfig
from tttvideo.dtypes import torch_dtype
from tttvideo.errors import UserError
from tttvideo.models.adapters import is_ttt_parameter
from tttvideo.models.cogvideox.presets import ModelSpec, describe_config
from tttvideo.models.cogvideox.transformer import CogVideoXTTT
from tttvideo.models.weights import (CONFIG_NAME, find_diffusers_folder, load_mapped_weights, materialize,
                                     save_mapped_folder)

DIFFUSERS_CLASS = "CogVideoXTransformer3DModel"


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
    return find_diffusers_folder(path, "CogVideoX-5B", "a CogVideoX-5B download")


def read_config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / CONFIG_NAME).read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{folder / CONFIG_NAME} is not valid JSON ({e.msg} at line {e.lineno})") from None
    cls = config.get("_class_name")
    if cls is not None and cls != DIFFUSERS_CLASS:
        raise UserError(f"{folder} holds a {cls}, not a {DIFFUSERS_CLASS}; point at the transformer/ folder")
    return config


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
    with torch.device("meta"):
        model = CogVideoXTTT(spec, ttt, use_ttt, sequence_layer)
    expected = {n: p for n, p in model.named_parameters() if not is_ttt_parameter(n)}
    load_mapped_weights(model, folder, diffusers_name_map(spec.num_layers), expected, device, dtype, spec.name)
    materialize(model, device, dtype)  # only the TTT parameters are still on meta
    return model


def save_diffusers_folder(model: CogVideoXTTT, folder: str | Path, shard_bytes: int = 5 * 2**30) -> Path:
    """Write `model`'s backbone as a diffusers CogVideoXTransformer3DModel folder (`save_mapped_folder`)."""
    return save_mapped_folder(model, folder, diffusers_name_map(model.spec.num_layers),
                              {"_class_name": DIFFUSERS_CLASS, **model.spec.to_diffusers_config()}, shard_bytes)
