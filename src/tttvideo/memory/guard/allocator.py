"""The CUDA caching allocator setting every `tttv` command runs with, shared by the benchmarks that measure what
the trainer and the sampler reserve."""

from __future__ import annotations

import os

# Segments that grow in place keep a long video's varying activation sizes from fragmenting the cache; the planner's
# costs were measured with it.
ALLOC_CONF = "expandable_segments:True"


def use_tttv_allocator() -> None:
    """Set PYTORCH_CUDA_ALLOC_CONF to `ALLOC_CONF` unless the user set it (theirs wins). PyTorch reads it at the first
    CUDA allocation, so call this before one."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)
