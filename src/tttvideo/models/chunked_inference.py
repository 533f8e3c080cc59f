"""A block's forward without gradients in bounded memory (`memory.chunked_inference`).

The plain forward holds, per block, several tensors the size of the whole sequence at once: q/k/v and their window
copies in attention, q/k/v in two layouts and in fp32 for each TTT pass, the MLP's 4x hidden layer. At 63 s
(351,168 tokens) one bf16 copy of the residual stream is 2.0 GiB and the MLP's hidden layer 8.0 GiB, which is why a
63-s step does not fit a 24 GB card. Without gradients nothing has to be kept for a backward, so the same arithmetic
runs piece by piece:

- attention one window at a time: adaLN, q/k/v, their norms, RoPE and SDPA of window i, summed into one accumulator
  the size of the residual stream; then the overlap average and the output projection over token chunks, in place;
- each TTT pass: projections, eta and the elementwise glue over token chunks in scan order, written into the scan's
  input buffers; the scan over `ttt_head_groups` groups of heads; post-norm, output projection, gate and residual
  add over token chunks, in place;
- the MLP over token chunks, added into the residual stream in place.

What is alive at the peak (inside a TTT scan), in copies of the residual stream (2.0 GiB at 63 s): the stream, the
attention output, the scan's q/k/v and output for one head group (4 / G) and, with G > 1, the output of all heads
(1): 6 copies with G = 1, 4 with G = 4; plus one chunk's work. The scan is serial along the sequence and parallel
over heads, so each group of heads costs about as long as the whole scan did: G = 1 is the fastest, larger G only
for the smallest cards (docs/memory.md has the measured figures).

The result equals the plain forward's up to the summation order inside the matmuls (the tests compare them). The
chunked forward updates the residual stream `x` in place and returns it: the model owns that tensor (it is built
from the embeddings in the model's forward), which is what saves its copy.

Each layer owns its chunked forward beside its plain one: the block's `chunked_forward` (CogVideoX:
`models/cogvideox/block.py`), `LocalAttention.chunked_forward`, the long-range layer's `chunked_forward_`
(`sequence/bidirectional.py`) and the TTT pass's `chunked_pass_` (`ttt/layer.py`). This module hands the plan to
the blocks.
"""

from __future__ import annotations

import torch

from tttvideo.config.schema import MemoryConfig
from tttvideo.errors import ConfigError
from tttvideo.sequence.chunks import ChunkPlan

__all__ = ["ChunkPlan", "apply_chunked_inference"]


def apply_chunked_inference(model: torch.nn.Module, memory: MemoryConfig) -> None:
    """Give every block of `model` the plan of `memory` (or none when `memory.chunked_inference` is off)."""
    plan = (ChunkPlan(memory.inference_chunk_tokens, memory.ttt_head_groups) if memory.chunked_inference
            else None)
    for block in model.blocks:
        if plan is not None and not callable(getattr(block, "chunked_forward", None)):
            raise ConfigError(f"memory.chunked_inference: the blocks of this backbone ({type(block).__name__}) have "
                              f"no chunked forward; set memory.chunked_inference = false")
        block.inference_chunks = plan
