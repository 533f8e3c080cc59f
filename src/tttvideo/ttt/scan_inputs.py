"""The TTT layer's glue between its q/k/v projection and the scan: `scan_inputs` (plain PyTorch, the reference) and
`prepare_scan_inputs`, which picks the implementation.

On CUDA (compute capability >= 8.0) with the TTT backend "auto" or "triton", the fused Triton kernels of
`triton_scan_inputs` run it, forward and backward, one pass over the sequence each; elsewhere the reference runs,
torch.compile'd on CUDA when `ttt.compile_glue` is on. The CPU runs the kernels only inside the Triton interpreter
with backend "triton" (the tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tttvideo.device import compiled_on_cuda, triton_runs_on
from tttvideo.rope import apply_rope

# eps of the reconstruction-target LayerNorm: the original normalises by (unbiased std + eps).
TARGET_LN_EPS = 1e-8


def scan_inputs(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_w: torch.Tensor,
    norm_b: torch.Tensor,
    pad: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """qkv [B, L, 3, H, D] (scan order) -> [3, B, H, L + pad, D] in `dtype`, zero-padded: L2-normalised q/k with
    RoPE, and v replaced by the reconstruction target LN_ttt(v - k) + k, with the original's (unbiased std + eps)
    normalisation. Math in fp32. One function, so that torch.compile can fuse it into a few kernels."""
    q, k, v = qkv.unbind(2)  # fp32 per tensor: no fp32 copy of the whole q/k/v block at once
    q = apply_rope(F.normalize(q.float(), dim=-1), cos, sin)
    k = apply_rope(F.normalize(k.float(), dim=-1), cos, sin)
    d = v.float() - k
    d = (d - d.mean(dim=-1, keepdim=True)) / (d.std(dim=-1, keepdim=True) + TARGET_LN_EPS)
    v = norm_w * d + norm_b + k
    B, L, H, D = q.shape
    # cast, transpose and pad in one write per tensor, never a stacked fp32 copy of all three
    out = q.new_zeros((3, B, H, L + pad, D), dtype=dtype)
    for i, t in enumerate((q, k, v)):
        out[i, :, :, :L] = t.transpose(1, 2)
    return out


def use_kernel(qkv: torch.Tensor, backend: str) -> bool:
    """Whether `prepare_scan_inputs` runs the Triton kernels for this call (see the module docstring)."""
    if backend == "reference" or qkv.shape[-1] & (qkv.shape[-1] - 1) or qkv.shape[-1] < 2:
        return False
    if qkv.device.type != "cuda" and backend != "triton":  # off CUDA the reference, unless asked for the kernels
        return False
    return triton_runs_on(qkv, (8, 0))


def prepare_scan_inputs(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm_w: torch.Tensor,
                        norm_b: torch.Tensor, pad: int, dtype: torch.dtype, backend: str = "auto",
                        compile_glue: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """`scan_inputs` by the implementation `backend` (the layer's `ttt.backend`) and the device select. `out`
    (without gradients): a [3, B, H, L + pad, D] tensor, e.g. a token slice of a longer buffer, to write the result
    into; the kernels write it there directly, the reference is copied in."""
    if out is not None and torch.is_grad_enabled():
        raise ValueError("prepare_scan_inputs: out= is for forwards without gradients")
    if use_kernel(qkv, backend):
        from tttvideo.ttt.triton_scan_inputs import ScanInputsFunction, scan_inputs_forward

        if out is not None:
            return scan_inputs_forward(qkv, cos, sin, norm_w, norm_b, pad, dtype, out=out)
        return ScanInputsFunction.apply(qkv, cos, sin, norm_w, norm_b, pad, dtype)
    result = compiled_on_cuda(scan_inputs, qkv, compile_glue)(qkv, cos, sin, norm_w, norm_b, pad, dtype)
    return result if out is None else out.copy_(result)
