"""The gated linear recurrences of Mamba 2 and Gated DeltaNet, on the implementation a backend names:
"triton" = flash-linear-attention's chunked Triton kernels (`chunk_simple_gla`, `chunk_gated_delta_rule`; CUDA only:
fla does not run in the Triton interpreter), "reference" = `tttvideo.sequence.recurrence` (any device), "auto" = fla
on CUDA when it is installed and can compute what is asked, the reference otherwise (the reason logged once). fla
refuses its gated backward on Hopper GPUs with Triton >= 3.4 and < 3.7.1 (it gives wrong gradients there, fla issue
#640; the forward is right), so on such a machine "auto" trains on the reference and samples on fla. Shapes are
fla's: q, k, v [B, T, H, D], g and beta [B, T, H]; the output is [B, T, H, D] in v's dtype."""

from __future__ import annotations

import importlib.util
import logging

import torch

from tttvideo.errors import ConfigError
from tttvideo.sequence.recurrence import gated_recurrence_chunked

log = logging.getLogger(__name__)
# Tokens per chunk of the PyTorch reference: on a CPU, where its work is compute, the quadratic part inside a chunk
# favours small chunks; on a GPU, where it stands in for fla's kernels and its time is kernel launches (one set per
# chunk), fewer, larger chunks. The function is the same for any chunk (tests/test_sequence_layers.py).
REFERENCE_CHUNK = {"cpu": 64, "cuda": 256}
_logged: set[str] = set()
FLA_HINT = "pip install 'tttvideo[long-range]' (flash-linear-attention)"


def fla_missing() -> str | None:
    """Why flash-linear-attention's kernels cannot be imported here (None when they can)."""
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
        import fla.ops.simple_gla  # noqa: F401
    except ImportError as e:
        return f"flash-linear-attention is not installed ({e}); {FLA_HINT}"
    return None


def fla_backward_refused() -> str | None:
    """Why fla's gated backward refuses to run on this GPU (None when it runs): fla raises inside the backward on
    Hopper with Triton >= 3.4 and < 3.7.1 unless tilelang provides the kernel instead."""
    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1

    if IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1 \
            and importlib.util.find_spec("tilelang") is None:
        return ("flash-linear-attention's gated backward gives wrong gradients on Hopper GPUs with Triton >= 3.4 and "
                "< 3.7.1 and refuses to run (fla issue #640); upgrade Triton to 3.7.1 or later or install tilelang")
    return None


def fla_unavailable(x: torch.Tensor, needs_grad: bool) -> str | None:
    """Why fla's kernels cannot compute this call (None when they can)."""
    if not x.is_cuda:
        return "the tensors are not on a CUDA device"
    return fla_missing() or (fla_backward_refused() if needs_grad else None)


def use_fla(backend: str, x: torch.Tensor, *inputs: torch.Tensor | None) -> bool:
    if backend == "reference":
        return False
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *inputs))
    reason = fla_unavailable(x, needs_grad)
    if backend == "triton" and reason:
        raise ConfigError(f"ttt.backend = 'triton' runs Mamba 2 / Gated DeltaNet on flash-linear-attention's "
                          f"kernels, which cannot run here: {reason}; use backend 'auto' or 'reference'")
    if reason and reason not in _logged:
        _logged.add(reason)
        log.info("Mamba 2 / Gated DeltaNet recurrence in plain PyTorch: %s", reason)
    return reason is None


def reference_chunk(x: torch.Tensor) -> int:
    return REFERENCE_CHUNK["cuda" if x.is_cuda else "cpu"]


def simple_gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, scale: float,
               backend: str = "auto") -> torch.Tensor:
    """Mamba 2's recurrence (SSD: one scalar decay per head and token)."""
    if use_fla(backend, q, k, v, g):
        from fla.ops.simple_gla import chunk_simple_gla

        return chunk_simple_gla(q, k, v, g=g.float(), scale=scale)[0]
    return gated_recurrence_chunked(q, k, v, g, None, scale, reference_chunk(q)).to(v.dtype)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     scale: float, backend: str = "auto") -> torch.Tensor:
    """Gated DeltaNet's recurrence (q and k L2-normalised by the caller)."""
    if use_fla(backend, q, k, v, g, beta):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        return chunk_gated_delta_rule(q, k, v, g=g.float(), beta=beta.to(q.dtype), scale=scale)[0]
    return gated_recurrence_chunked(q, k, v, g, beta, scale, reference_chunk(q)).to(v.dtype)
