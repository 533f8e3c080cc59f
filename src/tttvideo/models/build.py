"""The model a config asks for: the backbone and size of its preset, weights (the backbone's outside weights or
random), dtype, adapter, fp8 storage and matrix products, checkpointing and chunked inference."""

from __future__ import annotations

import logging

import torch

from tttvideo.config.schema import Config
from tttvideo.dtypes import torch_dtype
from tttvideo.errors import ConfigError
from tttvideo.models.adapters import apply_adapter
from tttvideo.models.backbone import Backbone, backbone_of
from tttvideo.models.checkpointing import apply_checkpointing
from tttvideo.models.chunked_inference import apply_chunked_inference
from tttvideo.models.fp8_storage import check_fp8_matmul, store_fp8, use_fp8_matmul
from tttvideo.models.weights import init_model
from tttvideo.sequence.build import configured_layer
from tttvideo.ttt.layer import inner_hidden
from tttvideo.ttt.ops import check_backend_config

log = logging.getLogger(__name__)


def long_range_layer(cfg: Config) -> str:
    """The long-range layer of a config's blocks: model.sequence_layer, or "none" with model.use_ttt = false."""
    m = cfg.model
    if not m.use_ttt and m.sequence_layer not in ("ttt", "none"):
        raise ConfigError(f"model.use_ttt = false builds no long-range layer, but model.sequence_layer = "
                          f"{m.sequence_layer!r} asks for one; set only sequence_layer (use_ttt = false is "
                          f"sequence_layer = 'none')")
    layer = configured_layer(m)
    # before any weight loads; of the long-range layers only TTT has a chunked pass (`chunked_pass_`)
    if layer not in ("ttt", "none") and cfg.memory.chunked_inference:
        raise ConfigError(f"memory.chunked_inference runs the TTT layer in chunks; model.sequence_layer = {layer!r} "
                          f"has no chunked forward: set memory.chunked_inference = false")
    return layer


def build_model(cfg: Config, device: torch.device | str = "cpu",
                compute_device: torch.device | str | None = None) -> Backbone:
    """The model of a config: `cfg.model` (preset, pretrained_path, dtype, adapter, LoRA rank/alpha, use_ttt,
    frozen_weights: fp8 storage of the linears the adapter froze), `cfg.ttt`, `cfg.checkpointing` and
    `cfg.memory.chunked_inference`. The preset picks the backbone (`models.backbone`). Random initialisation
    follows torch's current seed. The trainer, the sampler's `load_model`, the memory profiler and
    benchmarks/model_step.py all build their model here. `compute_device`: where the model will run, when it is
    built elsewhere (blocks streamed from host memory to a GPU); `device` by default."""
    m = cfg.model
    backbone = backbone_of(m.preset)
    spec = backbone.presets[m.preset]
    head_dim = spec.attention_head_dim
    layer = long_range_layer(cfg)
    if layer == "ttt":
        check_backend_config(cfg.ttt, head_dim, (cfg.ttt.kind == "mlp" and cfg.ttt.mlp_hidden)
                             or inner_hidden(cfg.ttt.kind, head_dim), device)
    compute_device = device if compute_device is None else compute_device
    check_fp8_matmul(cfg, compute_device)
    dtype = torch_dtype(m.dtype)
    use_ttt = layer != "none"
    if m.pretrained_path:
        if backbone.from_pretrained is None:
            raise ConfigError(f"model.pretrained_path is set, but the {backbone.name!r} backbone of preset "
                              f"{m.preset!r} loads no outside weights; set model.pretrained_path = ''")
        model = backbone.from_pretrained(m.pretrained_path, spec=spec, ttt=cfg.ttt, use_ttt=use_ttt, dtype=dtype,
                                         device=device, sequence_layer=layer)
    else:
        model = init_model(spec, cfg.ttt, use_ttt, dtype=dtype, device=device, sequence_layer=layer)
    apply_adapter(model, m.adapter, m.lora_rank, m.lora_alpha)
    if m.frozen_weights == "fp8":
        # after the adapter: requires_grad decides which linears are frozen
        if store_fp8(model) == 0:
            raise ConfigError(f"model.frozen_weights = 'fp8' found no frozen linear layer to store (model.adapter "
                              f"= {m.adapter!r} trains them all); use adapter 'qkvo' or 'lora', or frozen_weights "
                              f"'dtype'")
        if m.fp8_matmul:
            on, layers = use_fp8_matmul(model, compute_device)
            log.info("model.fp8_matmul: %d of %d frozen fp8 linear layers multiply in fp8%s", on, layers,
                     "" if on == layers else " (the others' sizes are not multiples of 16, as torch._scaled_mm "
                     "needs on CUDA: they upcast their weights)")
    backbone.configure(model, m)
    apply_checkpointing(model, cfg.checkpointing)
    apply_chunked_inference(model, cfg.memory)
    return model
