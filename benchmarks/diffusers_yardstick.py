"""diffusers' CogVideoXTransformer3DModel as the yardstick of benchmarks/model_step.py (`--yardstick diffusers`).

For one case of model_step (a duration at a resolution) it builds diffusers' transformer of the same preset
(`ModelSpec.to_diffusers_config`, random initialisation, in the benchmark's dtype, built on the meta device and
materialised directly on the device), feeds it the case's latents [1, F, C, H, W] and one segment's text features
[1, T, text_embed_dim] with the RoPE of diffusers' CogVideoXPipeline, and times (a) the inference forward (no grad,
eval mode) and (b) a training step: forward + backward of an MSE loss on its output with diffusers' gradient
checkpointing of every block (what model_step's block group 1 does), the trainable weights mirroring model_step's
adapter (attention q/k/v/o and q/k norms for `qkvo`, everything for `sft`). At 3 s (one segment) both models see the
same tokens; at longer durations diffusers attends over all latent frames at once, which the result's `note` says.

model_step.py imports this module only with --yardstick (as `benchmarks.diffusers_yardstick`) and passes its timer,
so that both models are timed by the same loop (warm-up, then the median of --steps, the peak memory reset in
between).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import diffusers
import torch
import torch.nn.functional as F
from diffusers import CogVideoXTransformer3DModel
from diffusers.models.embeddings import get_3d_rotary_pos_embed
from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

from tttvideo.layout import VideoLayout
from tttvideo.models.cogvideox.presets import ModelSpec

NAME = "diffusers CogVideoXTransformer3DModel"
TIMESTEP = 500  # any timestep: the cost does not depend on it
# (call i, untimed preparation) -> (warm-up seconds, timed seconds); model_step's `timed`
Timer = Callable[[Callable[[int], None], Callable[[], None]], tuple[list[float], list[float]]]


def build(spec: ModelSpec, dtype: torch.dtype, device: torch.device, adapter: str) -> CogVideoXTransformer3DModel:
    """diffusers' transformer of `spec`, randomly initialised on `device` in `dtype`: the weights are allocated
    once, in their final dtype and place (no fp32 copy of 5B parameters on the host or the device)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = CogVideoXTransformer3DModel(**spec.to_diffusers_config())
    if any(True for _ in model.buffers()):
        # to_empty would leave a buffer computed in __init__ uninitialised; the rotary-embedding models have none
        raise RuntimeError(f"{NAME} of {spec.name!r} has buffers; the meta-device build cannot initialise them")
    # nn.Module's `to`: diffusers' own warns about modules to keep in fp32, of which CogVideoX has none
    model = torch.nn.Module.to(model, dtype).to_empty(device=device)
    with torch.no_grad():
        for module in model.modules():
            if any(True for _ in module.parameters(recurse=False)):
                module.reset_parameters()  # Linear, Conv2d and LayerNorm: their own default initialisation
    for name, p in model.named_parameters():
        # as model_step's adapter: qkvo trains the attention (q/k/v/o and the q/k norms), sft everything
        p.requires_grad_(adapter == "sft" or ".attn1." in f".{name}")
    return model


def inputs(model: CogVideoXTransformer3DModel, latents: torch.Tensor, text: torch.Tensor) -> dict[str, Any]:
    """Keyword arguments of diffusers' forward: the latents [B, F, C, H, W], the first segment's text [B, T, D],
    timesteps [B] (long) and the RoPE as CogVideoXPipeline._prepare_rotary_positional_embeddings builds it."""
    cfg = model.config
    rope = None
    if cfg.use_rotary_positional_embeddings:
        p = cfg.patch_size
        grid = (latents.shape[3] // p, latents.shape[4] // p)
        crops = get_resize_crop_region_for_grid(grid, cfg.sample_width // p, cfg.sample_height // p)
        rope = get_3d_rotary_pos_embed(embed_dim=cfg.attention_head_dim, crops_coords=crops, grid_size=grid,
                                       temporal_size=latents.shape[1], device=latents.device)
    timestep = torch.full((latents.shape[0],), TIMESTEP, dtype=torch.long, device=latents.device)
    return {"hidden_states": latents, "encoder_hidden_states": text[:, 0], "timestep": timestep,
            "image_rotary_emb": rope, "return_dict": False}


def note(layout: VideoLayout, tokens: int) -> str:
    if layout.num_segments == 1:
        return f"one 3-s segment: both models see the same {tokens} tokens"
    return (f"diffusers attends over all {layout.latent_frames} latent frames at once (full attention over {tokens} "
            f"tokens, one segment's {layout.text_tokens} text tokens); ours over {layout.num_segments} local 3-s "
            f"windows of {layout.window_tokens} tokens")


def run(spec: ModelSpec, layout: VideoLayout, batch: dict[str, torch.Tensor], adapter: str, timer: Timer
        ) -> dict[str, Any]:
    """The yardstick's forward and training-step times on `batch` (model_step's latents and text of `layout`), its
    peak allocated memory above what was allocated before it was built, and what it saw. Nothing outside holds
    the model: it is garbage once this returns."""
    latents, text = batch["latents"], batch["text"]
    device = latents.device
    cuda = device.type == "cuda"
    resident = torch.cuda.memory_allocated(device) if cuda else 0
    start = time.perf_counter()
    model = build(spec, latents.dtype, device, adapter)
    build_s = time.perf_counter() - start
    kwargs = inputs(model, latents, text)
    shapes = {"latents_shape": list(latents.shape), "text_shape": list(kwargs["encoder_hidden_states"].shape)}
    tokens = text.shape[2] + layout.latent_frames * layout.tokens_per_frame
    result: dict[str, Any] = {
        "name": NAME, "version": diffusers.__version__, **shapes, "tokens": tokens, "note": note(layout, tokens),
        "params": sum(p.numel() for p in model.parameters()),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "gradient_checkpointing": "every block (enable_gradient_checkpointing)", "build_s": build_s,
    }

    def peak() -> float | None:  # this model's weights and activations, not those of ours held meanwhile
        return (torch.cuda.max_memory_allocated(device) - resident) / 2**30 if cuda else None

    model.eval()
    seen: list[list[int]] = []
    with torch.no_grad():
        def forward(i: int) -> None:
            seen.append(list(model(**kwargs)[0].shape))

        result["forward_warmup_s"], result["forward_steps_s"] = timer(forward, lambda: None)
    result["forward_s"] = statistics.median(result["forward_steps_s"])
    result["output_shape"] = seen[-1]
    result["peak_forward_allocated_gib"] = peak()

    model.train()
    model.enable_gradient_checkpointing()
    target = torch.randn_like(latents, dtype=torch.float32)

    def train_step(i: int) -> None:
        F.mse_loss(model(**kwargs)[0].float(), target).backward()

    result["train_warmup_s"], result["train_steps_s"] = timer(train_step, lambda: model.zero_grad(set_to_none=True))
    result["train_step_s"] = statistics.median(result["train_steps_s"])
    result["peak_train_allocated_gib"] = peak()
    # what the backward reached: every trainable weight, also through the checkpointed blocks
    result["params_with_grad"] = sum(p.numel() for p in model.parameters() if p.grad is not None)
    result["resident_before_gib"] = resident / 2**30 if cuda else None
    return result

