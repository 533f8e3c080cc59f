"""Frozen linear weights stored as float8 (e4m3) with one scale per output channel: `store_fp8(model)`.

Every `nn.Linear` whose weight does not require grad becomes an `Fp8Linear`: its weight is kept as
`weight_fp8` (torch.float8_e4m3fn, 1 byte per value) and `weight_scale` (fp32, one per output row, amax / 448 so
that the row's largest value lands on e4m3's largest finite value 448), and upcast to the compute dtype (the
autocast dtype when autocast is on, else the input's) inside each call, so only one layer's full-precision weight
exists at a time; in training, backward dequantises again rather than keeping that weight from forward. With
`model.fp8_matmul` (`use_fp8_matmul`) the forward multiplies the codes in fp8 instead (`fp8_linear`). Bias stays a
frozen parameter in its original dtype. Layers that train (weight requires_grad) are never touched, so gradients,
the optimizer and LoRA wrappers around frozen base layers see what they saw before.

Why not the existing tools:
- diffusers' `apply_layerwise_casting` casts whole modules to the storage dtype with no scale and back on every
  forward with `module.to(dtype)`: trainable parameters in those modules would be rounded to fp8 too, and a plain
  cast loses precision wherever weights are small, since values below e4m3's smallest normal (2^-6) keep fewer
  bits. Measured on the tiny model (tests/test_fp8_storage.py), relative error of the output with every frozen
  linear stored in fp8: per-channel scales 2.5% (default init), 2.3% / 1.9% with frozen weights ~N(0, 0.02) /
  N(0, 0.01); a plain cast 2.4%, 3.1%, 4.3% (weight errors 2.4%, 3.3%, 5.6%): it degrades as weights shrink,
  per-channel scaling does not.
- torchao's `Float8WeightOnlyConfig` (per-row scales, runs forward and backward on CPU, 2.5% error on a single
  random layer) replaces `weight` by a tensor-subclass parameter: safetensors cannot save it (our model files
  would break) and it would make torchao a requirement of this feature. The per-row scheme is the same; it is a
  few lines here.

What a converted model saves: `state_dict()` holds `<layer>.weight_fp8` (float8_e4m3fn) and `<layer>.weight_scale`
(fp32) instead of `<layer>.weight`, and `<layer>.bias` unchanged. `tttvideo.models.weights.save_checkpoint` walks
`named_parameters()`, where the fp8 weights are buffers and therefore absent: a trainable-only checkpoint is the
same as without fp8; a "full" checkpoint holds every parameter except the converted frozen weights and is marked
partial: the sampler then builds the model from `model.pretrained_path` and loads it on top (with or without fp8
storage), and a later stage that starts from it with `train.init_from` must set `model.pretrained_path` too (the
frozen weights come from there). The other way round works too: a full
checkpoint of a model without fp8 storage (bf16 or fp32) loads into a model with it, `load_checkpoint` quantising
each frozen weight as it reads it (the same codes as loading into the unconverted model and then `store_fp8`).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tttvideo.config.schema import Config
from tttvideo.device import triton_runs_on
from tttvideo.errors import ConfigError

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448.0
# an all-zero row still needs a finite, non-zero scale to divide by
_MIN_AMAX = 1e-12


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes, fp32 scale per row) of a 2-d weight: weight ~= codes * scale[:, None]."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=_MIN_AMAX) / FP8_MAX
    codes = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return codes.to(dtype) * scale.to(dtype)[:, None]


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes, fp32 scales [rows, 1]) of a 2-d activation, one scale per row (token): the row-wise scaling
    torch._scaled_mm takes. The reference of the Triton kernel `triton_fp8_quantize` (`quantize_tokens_fast`)."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=_MIN_AMAX) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def use_quantize_kernel(x: torch.Tensor) -> bool:
    """Whether `quantize_tokens_fast` runs the Triton kernel for `x`: on CUDA with compute capability 8.9+ (the
    kernel writes e4m3, which Triton compiles from there on; what `model.fp8_matmul` needs anyway) and Triton
    installed; on CPU only inside the Triton interpreter (the tests)."""
    if x.numel() == 0:  # nothing to launch; the reference's error for rows of no elements stays its own
        return False
    return triton_runs_on(x, (8, 9))


def quantize_tokens_fast(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_tokens` by its Triton kernel where `use_quantize_kernel` says so, else by the reference itself; the
    same codes and scales either way (tests/test_fp8_quantize.py). The kernel reads x once and writes the codes
    once: torch.compile's version of the reference ran at a seventh of the memory bandwidth (H200), and hit
    torch._dynamo's recompile limit on row counts despite dynamic=True."""
    if use_quantize_kernel(x):
        from tttvideo.models.triton_fp8_quantize import quantize_tokens_triton

        return quantize_tokens_triton(x)
    return quantize_tokens(x)


def fp8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
               dtype: torch.dtype) -> torch.Tensor:
    """x W^T + b multiplied in fp8 (`model.fp8_matmul`): x quantised per token here, W the stored e4m3 codes with
    their per-output-channel scales, accumulated in fp32 by torch._scaled_mm, the result in `dtype`. The product
    runs at up to twice bf16's rate on Hopper, the 5B model's large layers at 1.0-1.2x bf16's at 36,096 rows
    (docs/model.md); the error is x's quantisation on top of the weights'."""
    rows = x.reshape(-1, x.shape[-1]).to(dtype).contiguous()
    x_codes, x_scale = quantize_tokens_fast(rows)
    # CUDA's row-wise kernels write bf16 only: another compute dtype (fp16 autocast, fp32) gets bf16 cast to it
    out_dtype = torch.bfloat16 if rows.is_cuda else dtype
    # the bias in the product's epilogue, added to the fp32 sums: added apart, it cost a pass over the output
    # about as long as the quantisation (docs/model.md)
    fused = bias is not None and scaled_mm_takes_bias(rows.device, out_dtype)
    out = torch._scaled_mm(x_codes, codes.t(), scale_a=x_scale, scale_b=scale.float()[None, :],
                           bias=bias.to(out_dtype) if fused else None, out_dtype=out_dtype)
    out = out.to(dtype)
    if bias is not None and not fused:
        out = out.add_(bias.to(dtype))
    return out.reshape(*x.shape[:-1], out.shape[-1])


@functools.cache
def scaled_mm_takes_bias(device: torch.device, out_dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm with per-row scales adds a bias of `out_dtype` on `device` (asked once): PyTorch
    builds and GPUs differ in which of its kernels take one."""
    return _scaled_mm_error(device, out_dtype, bias=True) is None


def fp8_matmul_takes(in_features: int, out_features: int) -> bool:
    """Whether torch._scaled_mm multiplies a layer of these sizes on CUDA (both multiples of 16)."""
    return in_features % 16 == 0 and out_features % 16 == 0


class _Fp8LinearFunction(torch.autograd.Function):
    """y = x W^T + b with W dequantised from e4m3 codes; backward saves the codes and scales, not W, and
    dequantises again: the full-precision weight would otherwise stay alive from forward to backward in every
    layer, as large as the bf16 weights fp8 storage replaces."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                dtype: torch.dtype, in_fp8: bool) -> torch.Tensor:
        ctx.save_for_backward(codes, scale)
        ctx.dtype = dtype
        if in_fp8:
            return fp8_linear(x, codes, scale, bias, dtype)
        return F.linear(x, dequantize_rows(codes, scale, dtype), bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        # with model.fp8_matmul too: the gradient of x W^T + b for the stored W (x's rounding in forward has none)
        codes, scale = ctx.saved_tensors
        grad_x = grad_out @ dequantize_rows(codes, scale, ctx.dtype) if ctx.needs_input_grad[0] else None
        grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.needs_input_grad[3] else None
        return grad_x, None, None, grad_bias, None, None


class Fp8Linear(nn.Module):
    """A frozen linear layer whose weight is stored as e4m3 codes with per-output-channel fp32 scales."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.weight.requires_grad:
            raise ValueError("Fp8Linear stores frozen weights only; this layer's weight requires grad")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype  # what `weight` gives back, the dtype the model was built in
        codes, scale = quantize_rows(linear.weight)
        self.register_buffer("weight_fp8", codes)
        self.register_buffer("weight_scale", scale)
        self.bias = linear.bias  # the same frozen Parameter object: no copy
        self.fp8_matmul = False  # multiply in fp8 (`use_fp8_matmul`) instead of upcasting the weight

    @property
    def weight(self) -> torch.Tensor:
        """The weight in the dtype it was built in (code that reads `layer.weight` keeps working; it costs a
        dequantisation of this layer)."""
        return dequantize_rows(self.weight_fp8, self.weight_scale, self.dtype)

    def compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return x.dtype

    def codes_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes and scales on `device`: the stored ones, or (streamed from pinned host memory,
        `stream_fp8_weights`) a copy queued on the current stream, which lives as long as this call's result or,
        in training, until backward has used it."""
        codes, scale = self.weight_fp8, self.weight_scale
        if codes.device != device:
            codes, scale = codes.to(device, non_blocking=True), scale.to(device, non_blocking=True)
        return codes, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.compute_dtype(x)
        bias = None if self.bias is None else self.bias.to(dtype)
        codes, scale = self.codes_on(x.device)
        if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
            return _Fp8LinearFunction.apply(x.to(dtype), codes, scale, bias, dtype, self.fp8_matmul)
        if self.fp8_matmul:
            return fp8_linear(x, codes, scale, bias, dtype)
        return F.linear(x.to(dtype), dequantize_rows(codes, scale, dtype), bias)

    @staticmethod
    def stacked_product(layers: tuple[nn.Module, ...], rows: slice,
                        heads: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """`stacked_fp8_product`, for layers that stack their q/k/v products (`ttt.layer.TTTLayer.qkv_product`,
        which cannot import this module: it sits in a lower layer of the package)."""
        return stacked_fp8_product(layers, rows, heads)

    def extra_repr(self) -> str:
        matmul = ", matmul=fp8" if self.fp8_matmul else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"storage=float8_e4m3fn/row{matmul}")


def _convert_children(module: nn.Module) -> int:
    """Swap the frozen Linear children of `module` (recursively) one at a time; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear and not child.weight.requires_grad:
            setattr(module, name, Fp8Linear(child))
            # the bf16/fp32 weight goes when `child` is dropped here, before the next layer is converted
            del child
            count += 1
        else:
            count += _convert_children(child)
    return count


@torch.no_grad()
def store_fp8(model: nn.Module) -> int:
    """Convert every frozen `nn.Linear` of `model` (weight.requires_grad False) to `Fp8Linear`, in place, one
    layer at a time, so that the extra memory at any moment is one layer's codes and scales. Trainable layers and
    subclasses of nn.Linear (LoRA wrappers) are left alone; their frozen base layers are converted. Returns the
    number of layers converted."""
    return _convert_children(model)


def use_fp8_matmul(model: nn.Module, device: torch.device | str) -> tuple[int, int]:
    """Let every `Fp8Linear` of `model` whose sizes torch._scaled_mm takes multiply in fp8 (`model.fp8_matmul`);
    returns (layers that do, frozen fp8 layers in all). `device` is where the model computes; on CUDA it needs
    compute capability 8.9 (Ada, Hopper), which `check_fp8_matmul` asks first."""
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    cuda = torch.device(device).type == "cuda"
    on = [m for m in layers if not cuda or fp8_matmul_takes(m.in_features, m.out_features)]
    for m in on:
        m.fp8_matmul = True
    return len(on), len(layers)


@torch.no_grad()
def store_every_linear_fp8(model: nn.Module, device: torch.device | str, matmul: bool) -> tuple[int, int]:
    """Sampling with `sample.fp8_linears = "all"`: once its weights are loaded nothing of the model trains, so the
    linear layers its adapter trained (under 'qkvo' attention's and TTT's q/k/v/o: a third of a 5B block's linear
    work) are stored in fp8 like the frozen ones and, with `matmul` (`model.fp8_matmul`), multiply in fp8.
    Returns (layers that multiply in fp8, fp8 layers in all)."""
    model.requires_grad_(False)
    store_fp8(model)
    if matmul:
        return use_fp8_matmul(model, device)
    return 0, sum(isinstance(m, Fp8Linear) for m in model.modules())


def stacked_fp8_product(layers: tuple[nn.Module, ...], rows: slice,
                        heads: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """x -> the outputs of `layers` (linears of one input and equal sizes, each split into `heads` groups of output
    rows) for the head groups `rows` of each, concatenated: one quantisation of x and one fp8 product instead of one
    per layer, the codes stacked here once (a caller projecting many chunks keeps the product); None unless every
    layer multiplies in fp8 (`Fp8Linear.fp8_matmul`)."""
    if not all(isinstance(m, Fp8Linear) and m.fp8_matmul for m in layers):
        return None
    n, C = len(layers), layers[0].in_features
    pick = lambda ts, *tail: torch.stack(ts).view(n, heads, -1, *tail)[:, rows].reshape(-1, *tail)  # noqa: E731
    codes = pick([m.weight_fp8 for m in layers], C)
    scale = pick([m.weight_scale for m in layers])
    bias = None if layers[0].bias is None else pick([m.bias for m in layers])

    def product(x: torch.Tensor) -> torch.Tensor:
        dtype = layers[0].compute_dtype(x)
        return fp8_linear(x, codes, scale, None if bias is None else bias.to(dtype), dtype)

    return product


def check_fp8_matmul(cfg: Config, device: torch.device | str) -> None:
    """One sentence when `model.fp8_matmul` cannot apply on `device` (where the model computes, which may not be
    where it is built): it multiplies the fp8-stored frozen weights, on a GPU with fp8 tensor cores whose per-row
    scaled product this PyTorch runs."""
    m = cfg.model
    if not m.fp8_matmul:
        return
    if m.frozen_weights != "fp8":
        raise ConfigError("model.fp8_matmul multiplies the fp8-stored frozen weights; set model.frozen_weights = "
                          "'fp8' too, or model.fp8_matmul = false")
    device = torch.device(device)
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ConfigError(f"model.fp8_matmul needs fp8 tensor cores (compute capability 8.9 or newer: Ada, Hopper); "
                          f"{torch.cuda.get_device_name(device)} has {major}.{minor}: set model.fp8_matmul = false "
                          f"(model.frozen_weights = 'fp8' still halves the weights' memory)")
    refusal = scaled_mm_refusal(device)
    if refusal is not None:
        raise ConfigError(f"model.fp8_matmul: this PyTorch ({torch.__version__}) has no fp8 matrix product with "
                          f"per-row scales on {torch.cuda.get_device_name(device)} ({refusal}); set "
                          f"model.fp8_matmul = false")


def scaled_mm_refusal(device: torch.device) -> str | None:
    """None when torch._scaled_mm multiplies with per-row scales on `device`, else the first line of its error:
    which scalings it runs depends on the GPU and on the PyTorch build, so it is asked once."""
    return _scaled_mm_error(device, torch.bfloat16, bias=False)


def _scaled_mm_error(device: torch.device, out_dtype: torch.dtype, bias: bool) -> str | None:
    """The first line of torch._scaled_mm's error for a 16 x 16 product with per-row scales (and a bias of
    `out_dtype`) on `device`, None where it runs."""
    codes = torch.zeros(16, 16, device=device, dtype=FP8)
    try:
        torch._scaled_mm(codes, codes.t(), scale_a=torch.ones(16, 1, device=device),
                         scale_b=torch.ones(1, 16, device=device),
                         bias=torch.zeros(16, device=device, dtype=out_dtype) if bias else None, out_dtype=out_dtype)
    except RuntimeError as err:
        return str(err).splitlines()[0] if str(err) else type(err).__name__
    return None


def fp8_code_bytes(module: nn.Module) -> int:
    """Bytes of the fp8 codes and scales of every `Fp8Linear` in `module`."""
    return sum(t.nbytes for m in module.modules() if isinstance(m, Fp8Linear) for t in (m.weight_fp8, m.weight_scale))


def frozen_weight_bytes(model: nn.Module) -> int:
    """Bytes of frozen linear weights: fp8 codes and scales of converted layers, plain weights of frozen Linears."""
    plain = sum(m.weight.nbytes for m in model.modules() if isinstance(m, nn.Linear) and not m.weight.requires_grad)
    return fp8_code_bytes(model) + plain


def check_weight_streaming(cfg: Config, world_size: int) -> None:
    """One sentence when `memory.stream_frozen_weights` cannot apply: it streams fp8 codes, in one process."""
    if not cfg.memory.stream_frozen_weights:
        return
    if cfg.model.frozen_weights != "fp8":
        raise ConfigError("memory.stream_frozen_weights streams the fp8-stored frozen weights; set "
                          "model.frozen_weights = 'fp8' too, or memory.stream_frozen_weights = false")
    if world_size > 1:
        raise ConfigError("memory.stream_frozen_weights runs in one process (FSDP2 already shards the weights "
                          "across GPUs); set it false under torchrun")


@torch.no_grad()
def stream_fp8_weights(model: nn.Module) -> int:
    """Keep every `Fp8Linear`'s codes and scales in pinned host memory; each call copies its layer's to the input's
    GPU on the compute stream (`Fp8Linear.codes_on`), so the GPU holds only the layers in flight and, in training,
    those whose backward is still to come (with block checkpointing: one block's). Returns the bytes moved. A
    no-op (0) when the codes are not on a CUDA device."""
    moved = 0
    for m in model.modules():
        if isinstance(m, Fp8Linear) and m.weight_fp8.device.type == "cuda":
            for name in ("weight_fp8", "weight_scale"):
                t = m._buffers[name]
                m._buffers[name] = t.to("cpu").pin_memory()
                moved += t.nbytes
    return moved
