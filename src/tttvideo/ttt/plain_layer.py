"""The TTT layer's forward written the plain way: gather q, k, v one at a time in residual order, apply RoPE to the
video slice, build the reconstruction target, interleave and pad each tensor, then scan. With the layer's
`eta_layout = "reference"` the learning rates are built as the reference system states them: one b x b matrix per
residual-order mini-batch, every row that mini-batch's rates, then the matrices' rows (only) interleaved.

`TTTLayer.forward` does the same in scan order with fused glue (one projection, RoPE tables over all tokens, an
optional torch.compile); this independent composition is what the layer is tested against
(tests/test_ttt_layer.py) and timed against (benchmarks/ttt_layer_glue.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tttvideo.layout import VideoLayout
from tttvideo.rope import apply_rope, rope_cos_sin
from tttvideo.ttt import ops
from tttvideo.ttt.eta_layout import REFERENCE
from tttvideo.ttt.layer import TTTLayer
from tttvideo.ttt.scan_inputs import TARGET_LN_EPS


def plain_ttt_layer(layer: TTTLayer, x: torch.Tensor, layout: VideoLayout, backend: str = "reference",
                    reverse: bool = False) -> torch.Tensor:
    """`layer(x, layout, reverse)` computed step by step with `layer`'s parameters; `backend` picks the scan (ops).
    The reverse pass is the forward computation on the reversed sequence, its output reversed back."""
    if reverse:
        flip = layout.reverse_perm.to(x.device)  # its own inverse
        return plain_ttt_layer(layer, x[:, flip], layout, backend)[:, flip]
    B, L, C = x.shape
    H, D = layer.num_heads, layer.head_dim
    T = layout.total_text_tokens
    cos, sin = (t.to(x.device) for t in rope_cos_sin(layout.global_positions, D, layer.rope_theta))
    q = F.normalize(layer.wq(x).view(B, L, H, D).float(), dim=-1)
    k = F.normalize(layer.wk(x).view(B, L, H, D).float(), dim=-1)
    v = layer.wv(x).view(B, L, H, D).float()
    q = torch.cat([q[:, :T], apply_rope(q[:, T:].transpose(1, 2), cos, sin).transpose(1, 2)], dim=1)
    k = torch.cat([k[:, :T], apply_rope(k[:, T:].transpose(1, 2), cos, sin).transpose(1, 2)], dim=1)
    d = v - k
    d = (d - d.mean(dim=-1, keepdim=True)) / (d.std(dim=-1, keepdim=True) + TARGET_LN_EPS)
    v = layer.ttt_norm_weight * d + layer.ttt_norm_bias + k
    eta = layer.base_lr * torch.sigmoid(
        F.linear(x, layer.learnable_ttt_lr_weight, layer.learnable_ttt_lr_bias).float()
    ) / (D * layout.mini_batch_size)
    perm, pad = layout.interleave_perm.to(x.device), layout.ttt_padding
    q, k, v = (F.pad(t.to(x.dtype)[:, perm].transpose(1, 2), (0, 0, 0, pad)) for t in (q, k, v))
    rows = None
    if layer.eta_layout == REFERENCE:
        b, P = layout.mini_batch_size, L + pad
        rates = F.pad(eta.transpose(1, 2), (0, pad))  # [B, H, P] residual order, padding rate 0
        matrices = rates.view(B, H, P // b, 1, b).expand(B, H, P // b, b, b).reshape(B, H, P, b)
        matrices = matrices[:, :, torch.cat([perm, torch.arange(L, P, device=x.device)])]  # rows only
        # explicit matrices through the scan's index form: row p takes entries p * b .. p * b + b - 1
        eta, rows = matrices.reshape(B, H, P * b), torch.arange(P * b, device=x.device).view(P, b)
    else:
        eta = F.pad(eta[:, perm].transpose(1, 2), (0, pad))
    scan = ops.ttt_mlp if layer.kind == "mlp" else ops.ttt_linear
    out = scan(q, k, v, eta, layer.ttt_norm_weight, layer.ttt_norm_bias, *layer.inner_params(),
               mini_batch_size=layout.mini_batch_size, checkpoint_group_size=layer.scan_checkpoint_group_size,
               backend=backend, eta_rows=rows)
    out = out[:, :, :L].transpose(1, 2).reshape(B, L, C).to(x.dtype)
    return layer.wo(layer.post_norm(out))[:, layout.deinterleave_perm.to(x.device)]
