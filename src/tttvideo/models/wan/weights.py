"""Weights of diffusers' Wan2.1 text-to-video folders (`Wan-AI/Wan2.1-T2V-1.3B-Diffusers`) into `WanTTT`.

The model is built on the meta device; each tensor of the `transformer/` folder's safetensors shards is read with
`safe_open` and put in place of its meta parameter under our name (`wan_name_map`), so the weights exist once in
memory; the parameters diffusers does not have (the TTT layers and their gates) are then allocated and initialised.
The folder handling that is not CogVideoX's (shard lists, in-place assignment, meta initialisation) is shared with
`tttvideo.models.weights`.
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
from tttvideo.models.wan.spec import DIFFUSERS_CLASS, WanSpec
from tttvideo.models.wan.transformer import WanTTT
from tttvideo.models.weights import (CONFIG_NAME, find_diffusers_folder, load_mapped_weights, materialize,
                                     save_mapped_folder)

# keys diffusers' own loader skips in Wan folders (an image-branch norm some conversions carry)
IGNORED = ("norm_added_q",)


def wan_name_map(num_layers: int) -> dict[str, str]:
    """diffusers parameter name -> ours, for every parameter a Wan2.1 text-to-video transformer can have."""
    modules = {
        "patch_embedding": "patch",
        "condition_embedder.time_embedder.linear_1": "time_embed.linear1",
        "condition_embedder.time_embedder.linear_2": "time_embed.linear2",
        "condition_embedder.time_proj": "time_proj",
        "condition_embedder.text_embedder.linear_1": "text_embed.linear1",
        "condition_embedder.text_embedder.linear_2": "text_embed.linear2",
        "proj_out": "proj_out",
    }
    block = {"norm2": "cross_norm", "ffn.net.0.proj": "ffn.fc1", "ffn.net.2": "ffn.fc2"}
    for diffusers, ours in (("attn1", "attn"), ("attn2", "cross_attn")):
        block.update({f"{diffusers}.{p}": f"{ours}.{p}" for p in ("to_q", "to_k", "to_v", "norm_q", "norm_k")})
        block[f"{diffusers}.to_out.0"] = f"{ours}.to_out"
    for i in range(num_layers):
        modules.update({f"blocks.{i}.{d}": f"blocks.{i}.{o}" for d, o in block.items()})
    names = {f"{d}.{s}": f"{o}.{s}" for d, o in modules.items() for s in ("weight", "bias")}
    names["scale_shift_table"] = "head_modulation.table"
    names.update({f"blocks.{i}.scale_shift_table": f"blocks.{i}.modulation.table" for i in range(num_layers)})
    return names


def find_wan_folder(path: str | Path) -> Path:
    """The folder holding the transformer's config.json: `path` itself or its `transformer/` subfolder."""
    return find_diffusers_folder(path, "Wan2.1-T2V-1.3B-Diffusers", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers")


def read_wan_spec(folder: Path, spec: WanSpec | None) -> WanSpec:
    """The folder's spec, checked against the requested preset (None: the folder's own)."""
    try:
        config: dict[str, Any] = json.loads((folder / CONFIG_NAME).read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{folder / CONFIG_NAME} is not valid JSON ({e.msg} at line {e.lineno})") from None
    cls = config.get("_class_name")
    if cls is not None and cls != DIFFUSERS_CLASS:
        raise UserError(f"{folder} holds a {cls}, not a {DIFFUSERS_CLASS}; point at a Wan2.1 transformer/ folder")
    try:
        found = WanSpec.from_diffusers_config(
            config, name=folder.parent.name if folder.name == "transformer" else folder.name)
    except UserError as e:
        raise UserError(f"{folder}: {e}") from None
    if spec is None:
        return found
    diff = spec.mismatches(found)
    if diff:
        raise UserError(f"{folder} does not hold the {spec.name!r} model: {'; '.join(diff)}; set model.preset to "
                        f"match the folder or point model.pretrained_path at a {spec.name} download")
    return spec


def from_pretrained_wan(path: str | Path, spec: WanSpec | None = None, ttt: TTTConfig | None = None,
                        use_ttt: bool = True, dtype: torch.dtype | str = torch.float32,
                        device: torch.device | str = "cpu", sequence_layer: str = "ttt") -> WanTTT:
    """Our Wan model with the backbone weights of a diffusers Wan2.1 T2V transformer folder and fresh TTT layers."""
    dtype, device = torch_dtype(dtype), torch.device(device)
    folder = find_wan_folder(path)
    spec = read_wan_spec(folder, spec)
    with torch.device("meta"):
        model = WanTTT(spec, ttt, use_ttt, sequence_layer)
    expected = {n: p for n, p in model.named_parameters() if not is_ttt_parameter(n)}
    load_mapped_weights(model, folder, wan_name_map(spec.num_layers), expected, device, dtype, spec.name, IGNORED)
    materialize(model, device, dtype)  # only the TTT layers are still on meta
    return model


def save_wan_folder(model: WanTTT, folder: str | Path, shard_bytes: int = 5 * 2**30) -> Path:
    """Write `model`'s backbone as a diffusers WanTransformer3DModel folder (`save_mapped_folder`)."""
    return save_mapped_folder(model, folder, wan_name_map(model.spec.num_layers),
                              {"_class_name": DIFFUSERS_CLASS, **model.spec.to_diffusers_config()}, shard_bytes)
