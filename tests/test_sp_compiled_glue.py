"""Sequence parallelism hands plain tensors to compiled code: the local attention's compiled window gather traced
the views of an un-waited all-to-all result (AsyncCollectiveTensor) and dynamo failed to rebuild them ("Expected
cond to be True", seen with sp = 2 on two GPUs). One process with a one-rank gloo group that calls itself two
ranks keeps every shape and stride of a rank of sp = 2; dynamo traces with the eager backend (no C++ build)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from tttvideo.layout import VideoLayout
from tttvideo.models import attention
from tttvideo.models.attention import LocalAttention
from tttvideo.parallel.sequence import SequenceParallel

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("rank", [0, 1])
def test_compiled_attention_glue_on_sp_shards(one_rank_group, monkeypatch, rank):
    monkeypatch.setattr(attention, "compiled_on_cuda",
                        lambda fn, t, on: torch.compile(fn, backend="eager") if on else fn)
    torch._dynamo.reset()
    torch.manual_seed(rank)
    layout = VideoLayout.create("6s", height=64, width=64, text_tokens=8, mini_batch_size=16)
    attn = LocalAttention(64, 4, 16)
    sp = SequenceParallel(one_rank_group, 2, rank)
    x = torch.randn(1, layout.sp_shard_tokens(2), 64, requires_grad=True)

    attn.compile_glue = False
    eager = checkpoint(attn, x, layout, sp, use_reentrant=False)
    (eager_grad,) = torch.autograd.grad(eager.square().mean(), x)
    attn.compile_glue = True
    compiled = checkpoint(attn, x, layout, sp, use_reentrant=False)
    (compiled_grad,) = torch.autograd.grad(compiled.square().mean(), x)
    torch._dynamo.reset()

    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-5, atol=1e-6)


def test_exchanges_return_plain_tensors(one_rank_group):
    layout = VideoLayout.create("6s", height=64, width=64, text_tokens=8, mini_batch_size=16)
    sp = SequenceParallel(one_rank_group, 2, 0)
    shard = torch.randn(1, layout.sp_shard_tokens(2), 3, 4, 16)
    heads = sp.to_head_shards(shard, layout, head_axis=3)
    back = sp.to_sequence_shards(heads[:, :, 0], layout, head_axis=2)
    whole = sp.unshard(torch.randn(1, layout.sp_shard_tokens(2), 8), layout)
    assert [type(t) for t in (heads, back, whole)] == [torch.Tensor] * 3
