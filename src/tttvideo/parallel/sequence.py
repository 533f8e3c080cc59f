"""Ulysses sequence parallelism: `sp` ranks share one video, each holding a contiguous shard of its tokens.

The residual stream [all text | all video] is padded at its end to a multiple of sp (`VideoLayout.sp_padding`) and
cut into equal shards, rank r holding tokens [r * shard, (r + 1) * shard). Every token-local part of the model
(adaLN, MLP, the q/k/v and output projections, the TTT eta gate and post-norm, the output head) runs on the shard.
The two parts that mix tokens — local attention and the TTT scan — need the whole sequence but treat heads
independently, so an all-to-all trades the token shard for a head shard before them ([B, L/sp, H, D] ->
[B, L, H/sp, D], padding dropped), the unchanged attention / scan code runs on H/sp heads, and a second all-to-all
trades back.

Gradients follow the exact adjoints of these exchanges (all-to-all backward is the reverse all-to-all, the
all-gather of the output reduce-scatters its gradient). Each of the sp ranks computes the same loss on the gathered
output, so the gradients over an sp group sum to sp times the one-process gradient: the mean over the sp ranks,
which FSDP's reduce-scatter over the dp_shard x sp ranks takes (`tttvideo.parallel.mesh.ParallelPlan.fsdp_mesh`),
is the one-process gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from tttvideo.layout import VideoLayout


@dataclass(frozen=True)
class SequenceParallel:
    """The sp process group of this rank and where this rank sits in it."""

    group: dist.ProcessGroup
    size: int
    rank: int

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> "SequenceParallel":
        return cls(group, dist.get_world_size(group), dist.get_rank(group))

    # ------------------------------------------------------------------ layout of a shard
    def text_tokens(self, layout: VideoLayout) -> int:
        """Text tokens at the start of this rank's shard (the rest is video, or padding in the last shard)."""
        return layout.sp_shard_text_tokens(self.size, self.rank)

    def heads(self, num_heads: int) -> slice:
        """The heads this rank computes between the two all-to-alls (a contiguous block of H / sp)."""
        per_rank = num_heads // self.size
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)

    # ------------------------------------------------------------------ residual stream in and out
    def shard(self, x: torch.Tensor, layout: VideoLayout) -> torch.Tensor:
        """[B, L, ...] (the same on every rank) -> this rank's [B, L / sp, ...], the stream zero-padded first."""
        n = layout.sp_shard_tokens(self.size)
        return _pad_sequence(x, layout.sp_padding(self.size))[:, self.rank * n:(self.rank + 1) * n]

    def unshard(self, x: torch.Tensor, layout: VideoLayout) -> torch.Tensor:
        """This rank's [B, L / sp, ...] -> the whole [B, L, ...] on every rank, padding dropped."""
        full = _waited(_all_gather(x.contiguous(), gather_dim=1, group=self.group))
        return full[:, :layout.total_tokens]

    # ------------------------------------------------------------------ the two all-to-alls
    def to_head_shards(self, t: torch.Tensor, layout: VideoLayout, head_axis: int) -> torch.Tensor:
        """[B, L / sp, ..., H, ...] -> [B, L, ..., H / sp, ...]: the whole sequence for this rank's heads."""
        # [sp, B, L / sp, ..., H / sp, ...]: chunk j goes to rank j
        send = t.unflatten(head_axis, (self.size, -1)).movedim(head_axis, 0).contiguous()
        got = _waited(funcol.all_to_all_single_autograd(send, None, None, self.group))
        # got[j] is rank j's token shard: concatenated in rank order they are the padded sequence
        return got.movedim(0, 1).flatten(1, 2)[:, :layout.total_tokens]

    def to_sequence_shards(self, t: torch.Tensor, layout: VideoLayout, head_axis: int) -> torch.Tensor:
        """[B, L, ..., H / sp, ...] -> [B, L / sp, ..., H, ...], the inverse of `to_head_shards`."""
        t = _pad_sequence(t, layout.sp_padding(self.size))
        send = t.unflatten(1, (self.size, -1)).movedim(1, 0).contiguous()
        got = _waited(funcol.all_to_all_single_autograd(send, None, None, self.group))
        # got[j] holds rank j's heads of this rank's tokens: heads are rank-major
        return got.movedim(0, head_axis).flatten(head_axis, head_axis + 1)


# the all-gather whose backward reduce-scatters the gradient: newer torch names it all_gather_single_autograd and
# deprecates the older all_gather_tensor_autograd, which older torch alone has
_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def _waited(t: torch.Tensor) -> torch.Tensor:
    """A functional collective's result as a plain tensor (the wait is differentiable). Left as an
    AsyncCollectiveTensor, the views taken of it stay that subclass, and torch.compile cannot rebuild a subclass view
    from its base: the compiled window gather then failed with "Expected cond to be True" (sp = 2 on two GPUs). The
    next op would wait anyway, so nothing overlaps less."""
    return funcol.wait_tensor(t)


def _pad_sequence(t: torch.Tensor, pad: int) -> torch.Tensor:
    if pad == 0:
        return t
    # F.pad counts dims from the last one: (0, 0) for each dim after the sequence dim, then (0, pad)
    return F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
