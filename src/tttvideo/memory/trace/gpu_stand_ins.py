"""What a CUDA training step would allocate, emulated on CPU tensors (real or fake): `cuda_like()`.

Fake CUDA tensors cannot go through autograd on a CPU-only build of torch, so the memory trace
(`memory.trace.fake_trace`) runs on fake CPU tensors and makes them allocate as CUDA's would:

- autocast: CPU autocast keeps layer_norm, rms_norm, group_norm, softmax and log_softmax in bf16 where CUDA
  autocast returns fp32 (CUDA's fp32 list); the AutocastCPU kernels of those operators are replaced, for the
  duration, by CUDA's policy (floating inputs cast to fp32). tests/test_fake_trace.py checks, op by op, that a Wan
  block's forward then has the dtypes fake CUDA tensors under CUDA autocast give.
- attention: `F.scaled_dot_product_attention` becomes a stand-in that allocates what the fused GPU kernels do (the
  output and a fp32 log-sum-exp per query row; in backward dq, dk, dv and a fp32 row of softmax sums), where the
  CPU kernel would materialise the whole score matrix.
- Triton: the TTT scan and its input glue take their Triton path (what `backend = "auto"` picks on an sm_90 GPU),
  and without gradients the TTT post-norm and local attention's window glue too, with every kernel launch skipped:
  the Python wrappers allocate their outputs, checkpoints and backward scratch exactly as on the GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator
from unittest import mock

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

# the operators CUDA autocast runs in fp32 that the models call (the rest of CUDA's fp32 list is losses, pooling,
# FFT and linear algebra, which a training step's forward does not call under autocast)
CUDA_FP32_OPS = ("layer_norm", "rms_norm", "group_norm", "softmax.int", "log_softmax.int")


def _fp32_policy(op: Any):
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def run(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(keys):
            cast = tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype in (
                torch.bfloat16, torch.float16) else t, (args, kwargs))
            return op(*cast[0], **cast[1])

    return run


@contextlib.contextmanager
def cuda_autocast_policy() -> Iterator[None]:
    """Inside: CPU autocast returns fp32 from CUDA_FP32_OPS as CUDA autocast does."""
    lib = torch.library.Library("aten", "IMPL")
    for name in CUDA_FP32_OPS:
        base, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, base), overload or "default")
        lib.impl(name, _fp32_policy(op), "AutocastCPU", with_keyset=False)
    try:
        yield
    finally:
        lib._destroy()


class _FusedAttention(torch.autograd.Function):
    """Allocates as the flash / cuDNN attention kernels do; the values are not computed (empty tensors)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        delta = torch.empty_like(lse)  # the row sums of grad * out the kernels form first
        del delta
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def fused_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """`F.scaled_dot_product_attention`'s allocations on a GPU (no mask, no dropout: what the models call)."""
    if attn_mask is not None or dropout_p:
        raise NotImplementedError("the attention stand-in covers unmasked attention without dropout")
    device = q.device.type
    if torch.is_autocast_enabled(device):  # autocast casts SDPA's inputs to its dtype, copying the others
        dtype = torch.get_autocast_dtype(device)
        q, k, v = (t.to(dtype) for t in (q, k, v))
    return _FusedAttention.apply(q, k, v)


class _NoLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None

    def __call__(self, *args, **kwargs):
        return None


@contextlib.contextmanager
def triton_allocations() -> Iterator[None]:
    """Inside: the TTT scan, its scan-input glue and the sampling glue kernels run their Triton wrappers on CPU tensors
    with no kernel launched."""
    from triton.runtime.jit import KernelInterface

    from tttvideo.models import attention, triton_window_gather
    from tttvideo.ttt import ops, scan_inputs, triton_mlp, triton_mlp_bwd, triton_post_norm, triton_scan_inputs

    def use_triton(kind, backend, q, hidden, mini_batch_size, eta_matrices=False):
        return backend != "reference" and not eta_matrices and ops.uncovered_reason(kind, q, hidden,
                                                                                    mini_batch_size) is None

    def use_kernel(qkv, backend):
        D = qkv.shape[-1]
        return backend != "reference" and D >= 2 and not D & (D - 1)

    patches = [mock.patch.object(ops, "_use_triton", use_triton),
               mock.patch.object(scan_inputs, "use_kernel", use_kernel),  # also the TTT post-norm's rule
               # attention's own rule (no gradients, a power-of-two head dim), with these CPU tensors a GPU's
               mock.patch.object(attention, "triton_runs_on", lambda x, capability: True)]
    for module in (triton_mlp, triton_mlp_bwd, triton_scan_inputs, triton_post_norm, triton_window_gather):
        if hasattr(module, "check_device"):
            patches.append(mock.patch.object(module, "check_device", lambda *t: None))
        for name, value in vars(module).items():
            if isinstance(value, KernelInterface):
                patches.append(mock.patch.object(module, name, _NoLaunch()))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


@contextlib.contextmanager
def cuda_like() -> Iterator[None]:
    """All three: CUDA's autocast policy, the fused attention's allocations and the Triton wrappers'."""
    with cuda_autocast_policy(), mock.patch.object(F, "scaled_dot_product_attention", fused_attention), \
            triton_allocations():
        yield
