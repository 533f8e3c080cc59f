"""Weight initialisation that costs nothing on the meta device.

`nn.init.normal_` on a meta tensor runs through torch's Python decompositions, whose first use imports
torch._dynamo: 1.8 s of every process that builds a model (`init_model` builds on meta, then `materialize`
initialises again on the real device, so the meta pass is thrown away). A CPU test that launches a training costs
that much more; these helpers skip meta tensors instead.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def normal_(tensor: torch.Tensor, std: float = 1.0) -> torch.Tensor:
    """`tensor` filled from N(0, std^2) in place; a meta tensor is returned as it is (it holds no values)."""
    if tensor.is_meta:
        return tensor
    return nn.init.normal_(tensor, std=std)
