"""The reference system's (ttt-video-dit) model state dict, in our names and shapes.

Its model is a `dit` module: a patch embedding (`vid_proj` conv, `text_proj`), a two-linear `time_embed`
(indices 0 and 2 of a Sequential), `layers.<i>` of the transformer, `transformer_norm` and a `final_layer`. A layer
holds the adaLN modulations as index 1 of a (SiLU, Linear) Sequential, the pre-norms, the local attention (`q`,
`k`, `v`, `o`, `q_norm`, `k_norm`), the four tanh gates of the bidirectional TTT (`gating_alpha` of
forward/backward x text/video), the TTT layer under `ssm.ttt`, and the MLP (`layer1`, `layer2`). Its TTT
parameters keep a singleton axis ours do not have: the learning-rate gate weight is [H, 1, C] and its bias
[H, 1], the inner biases b1 and b2 are [H, 1, E] and [H, 1, D]. Every other tensor has our shape.

Its trained checkpoints are torch.distributed.checkpoint folders of {"model": state dict, "optimizer": ...,
...}, so their model keys carry a leading "model."; its converted-from-diffusers ones hold the model keys alone.
"""

from __future__ import annotations

import re

import torch

SOURCE_NAME = "ttt-video-dit"
TRAINED_PREFIX = "model."

# (reference module path, our module path) of the parameters outside the layers; each has .weight and .bias
_TOP = {
    "dit.patch_embedding.vid_proj": "embed.patch",
    "dit.patch_embedding.text_proj": "embed.text",
    "dit.time_embed.0": "time_embed.linear1",
    "dit.time_embed.2": "time_embed.linear2",
    "dit.transformer_norm": "norm_final",
    "dit.final_layer.adaLN_modulation.1": "norm_out.linear",
    "dit.final_layer.norm": "norm_out.norm",
    "dit.final_layer.linear": "proj_out",
}
# the same inside layer i (prefixes dit.layers.<i>. and blocks.<i>.)
_LAYER = {
    "pre_seq_layernorm": "norm1.norm",
    "pre_seq_adaLN_modulation.1": "norm1.linear",
    "seq_modeling_block.q": "attn.to_q",
    "seq_modeling_block.k": "attn.to_k",
    "seq_modeling_block.v": "attn.to_v",
    "seq_modeling_block.o": "attn.to_out",
    "seq_modeling_block.q_norm": "attn.norm_q",
    "seq_modeling_block.k_norm": "attn.norm_k",
    "pre_mlp_layernorm": "norm2.norm",
    "pre_mlp_adaLN_modulation.1": "norm2.linear",
    "mlp.layer1": "mlp.fc1",
    "mlp.layer2": "mlp.fc2",
    "seq_modeling_block.ssm.ttt.wq": "ttt.ttt.wq",
    "seq_modeling_block.ssm.ttt.wk": "ttt.ttt.wk",
    "seq_modeling_block.ssm.ttt.wv": "ttt.ttt.wv",
    "seq_modeling_block.ssm.ttt.wo": "ttt.ttt.wo",
    "seq_modeling_block.ssm.ttt.post_norm": "ttt.ttt.post_norm",
}
# single tensors inside layer i: (reference name, our name)
_LAYER_TENSORS = {
    "seq_modeling_block.forward_ssm_gating_text.gating_alpha": "ttt.forward_gate_text",
    "seq_modeling_block.forward_ssm_gating_video.gating_alpha": "ttt.forward_gate_video",
    "seq_modeling_block.backward_ssm_gating_text.gating_alpha": "ttt.reverse_gate_text",
    "seq_modeling_block.backward_ssm_gating_video.gating_alpha": "ttt.reverse_gate_video",
    "seq_modeling_block.ssm.ttt.learnable_ttt_lr_weight": "ttt.ttt.learnable_ttt_lr_weight",
    "seq_modeling_block.ssm.ttt.learnable_ttt_lr_bias": "ttt.ttt.learnable_ttt_lr_bias",
    "seq_modeling_block.ssm.ttt.ttt_norm_weight": "ttt.ttt.ttt_norm_weight",
    "seq_modeling_block.ssm.ttt.ttt_norm_bias": "ttt.ttt.ttt_norm_bias",
    "seq_modeling_block.ssm.ttt.W1": "ttt.ttt.W1",
    "seq_modeling_block.ssm.ttt.b1": "ttt.ttt.b1",
    "seq_modeling_block.ssm.ttt.W2": "ttt.ttt.W2",
    "seq_modeling_block.ssm.ttt.b2": "ttt.ttt.b2",
}
# our tensors whose reference shape has a singleton axis at this position
_SINGLETON_AXIS = {"ttt.ttt.learnable_ttt_lr_weight": 1, "ttt.ttt.learnable_ttt_lr_bias": 1, "ttt.ttt.b1": 1,
                   "ttt.ttt.b2": 1}
_LAYER_INDEX = re.compile(r"^dit\.layers\.(\d+)\.")


def name_map(num_layers: int) -> dict[str, str]:
    """Reference parameter name -> ours, for a model of `num_layers` layers (TTT-MLP's; TTT-Linear has no W2/b2)."""
    out = {f"{ref}.{s}": f"{ours}.{s}" for ref, ours in _TOP.items() for s in ("weight", "bias")}
    for i in range(num_layers):
        out.update({f"dit.layers.{i}.{ref}.{s}": f"blocks.{i}.{ours}.{s}"
                    for ref, ours in _LAYER.items() for s in ("weight", "bias")})
        out.update({f"dit.layers.{i}.{ref}": f"blocks.{i}.{ours}" for ref, ours in _LAYER_TENSORS.items()})
    return out


def _singleton_axis(our_name: str) -> int | None:
    return _SINGLETON_AXIS.get(re.sub(r"^blocks\.\d+\.", "", our_name))


def reference_shape(our_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape the reference system stores our parameter `our_name` of `shape` in."""
    axis = _singleton_axis(our_name)
    return shape if axis is None else (*shape[:axis], 1, *shape[axis:])


def to_ours(our_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A reference tensor in our shape (its singleton axis dropped)."""
    axis = _singleton_axis(our_name)
    return tensor if axis is None else tensor.squeeze(axis)


def strip_prefix(keys: list[str]) -> dict[str, str]:
    """Stored key -> reference model name: a trained checkpoint's "model.dit..." loses its "model."."""
    return {k: k[len(TRAINED_PREFIX):] if k.startswith(TRAINED_PREFIX + "dit.") else k for k in keys}


def model_keys(keys: list[str]) -> list[str]:
    """The stored keys that are model parameters (a trained checkpoint also holds the optimizer's state, the data
    sampler's, ...)."""
    return [k for k in keys if k.startswith("dit.") or k.startswith(TRAINED_PREFIX + "dit.")]


def num_layers(names: list[str]) -> int:
    found = [int(m.group(1)) for n in names if (m := _LAYER_INDEX.match(n))]
    return max(found) + 1 if found else 0


def ttt_kind(names: list[str]) -> str:
    """TTT-MLP has a second inner layer (W2); TTT-Linear has W1 alone."""
    return "mlp" if any(n.endswith(".ssm.ttt.W2") for n in names) else "linear"
