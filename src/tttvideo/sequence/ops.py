"""The gated linear recurrences of Mamba 2 and Gated DeltaNet, on the implementation a backend names:
"triton" = flash-linear-attention's chunked Triton kernels (`chunk_simple_gla`, `chunk_gated_delta_rule`; CUDA only:
fla does not run in the Triton interpreter), "reference" = `tttvideo.sequence.recurrence` (any device), "auto" = fla
on CUDA when it is installed, the reference otherwise (the reason logged once). Shapes are fla's: q, k, v
[B, T, H, D], g and beta [B, T, H]; the output is [B, T, H, D] in v's dtype."""

from __future__ import annotations

import logging

import torch

from tttvideo.errors import ConfigError
from tttvideo.sequence.recurrence import gated_recurrence_chunked

log = logging.getLogger(__name__)
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


def use_fla(backend: str, x: torch.Tensor) -> bool:
    if backend == "reference":
        return False
    reason = "the tensors are not on a CUDA device" if not x.is_cuda else fla_missing()
    if backend == "triton" and reason:
        raise ConfigError(f"ttt.backend = 'triton' runs Mamba 2 / Gated DeltaNet on flash-linear-attention's "
                          f"kernels, which cannot run here: {reason}; use backend 'auto' or 'reference'")
    if reason and reason not in _logged:
        _logged.add(reason)
        log.info("Mamba 2 / Gated DeltaNet recurrence in plain PyTorch: %s", reason)
    return reason is None


def simple_gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, scale: float,
               backend: str = "auto") -> torch.Tensor:
    """Mamba 2's recurrence (SSD: one scalar decay per head and token)."""
    if use_fla(backend, q):
        from fla.ops.simple_gla import chunk_simple_gla

        return chunk_simple_gla(q, k, v, g=g.float(), scale=scale)[0]
    return gated_recurrence_chunked(q, k, v, g, None, scale).to(v.dtype)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     scale: float, backend: str = "auto") -> torch.Tensor:
    """Gated DeltaNet's recurrence (q and k L2-normalised by the caller)."""
    if use_fla(backend, q):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        return chunk_gated_delta_rule(q, k, v, g=g.float(), beta=beta.to(q.dtype), scale=scale)[0]
    return gated_recurrence_chunked(q, k, v, g, beta, scale).to(v.dtype)
