"""One rank of tests/test_parallel.py, started by torchrun on CPU (gloo): every parallel variant of this world size
against the one-process run of the same model on the same global batch.

Each rank builds the same seeded model and data. The one-process loss, output and gradients of each variant's global
batch are computed once, by one rank each (the variants' references at once, spread over the ranks), and sent whole
to the others (pickled: the values exactly). Then each rank runs each variant — Ulysses sp alone, FSDP alone, both,
HSDP with sp — on its own part of the batch and checks that the mean loss over ranks, its output and every
parameter's gradient (averaged over ranks without FSDP, gathered from the shards with it) match within fp32
tolerance. Exits non-zero on the first mismatch.
"""

from __future__ import annotations

import copy
import dataclasses
import faulthandler
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tttvideo.config.schema import ParallelConfig, TTTConfig
from tttvideo.layout import VideoLayout
from tttvideo.models.cogvideox.presets import PRESETS, ModelSpec
from tttvideo.models.cogvideox.transformer import CogVideoXTTT
from tttvideo.parallel import close_parallel, init_parallel, resolve_degrees, shard_model

# fp32 everywhere: the parallel runs differ from the one-process run only in summation order
RTOL, ATOL = 1e-4, 1e-5
# 9 s at 32x48: 3 segments x 75 text + 37 frames x 6 = 447 tokens, so the stream needs padding for sp = 2 and 4
# and its text runs past the first shard; a TTT mini-batch of 16 pads the scan by 1
LAYOUT = VideoLayout.create("9s", height=32, width=48, text_tokens=75, mini_batch_size=16)
TTT = TTTConfig(mini_batch_size=16, scan_checkpoint_group_size=2)
# samples per data-parallel rank: more than one, so that the exchanges are checked with a batch dimension
PER_RANK = 2
# the loss is scaled so that the gradients span about 1e-4 .. 20: ATOL is small beside most of them, and fp32 rounding
# of the largest (~1e-7 x 20) is small beside ATOL
LOSS_SCALE = 1e3

# (name, [parallel] keys, FSDP, activation checkpointing) per world size
VARIANTS = {
    2: [
        ("sp", dict(dp_shard=1, sp=2), False, False),
        ("fsdp", dict(dp_shard=2), True, False),
        ("fsdp+sp", dict(sp=2), True, True),
    ],
    4: [
        ("sp", dict(dp_shard=1, sp=4), False, False),
        ("fsdp", dict(dp_shard=4), True, False),
        ("fsdp+sp", dict(dp_shard=2, sp=2), True, True),
        ("hsdp+sp", dict(dp_replicate=2, dp_shard=1, sp=2), True, False),
    ],
}


def spec_for(world: int) -> ModelSpec:
    """The tiny preset (2 heads) for 2 ranks; with 4 heads of 16 for 4 ranks, so that sp = 4 divides the heads."""
    tiny = PRESETS["tiny"]
    return tiny if world == 2 else dataclasses.replace(tiny, num_attention_heads=4, attention_head_dim=16)


def inputs(batch: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(batch, LAYOUT.latent_frames, 16, LAYOUT.latent_height, LAYOUT.latent_width, generator=g)
    text = torch.randn(batch, LAYOUT.num_segments, LAYOUT.text_tokens, 64, generator=g)
    timesteps = torch.rand(batch, generator=g) * 1000
    target = torch.randn(latents.shape, generator=g)
    return latents, text, timesteps, target


def loss_of(model: torch.nn.Module, batch: tuple[torch.Tensor, ...], sp=None) -> tuple[torch.Tensor, torch.Tensor]:
    latents, text, timesteps, target = batch
    out = model(latents, text, timesteps, LAYOUT, sp=sp)
    return LOSS_SCALE * F.mse_loss(out, target), out


def one_process(base: torch.nn.Module, batch: tuple[torch.Tensor, ...]):
    model = copy.deepcopy(base)
    loss, out = loss_of(model, batch)
    loss.backward()
    return loss.detach(), out.detach(), {n: p.grad for n, p in model.named_parameters()}


def references(base: torch.nn.Module, world: int) -> list[tuple]:
    """`one_process` of each variant's global batch (PER_RANK samples per data-parallel rank): variant i computed
    by rank i % world, all ranks at once, then broadcast from it to every rank."""
    heads = base.spec.num_attention_heads
    batches = [inputs(PER_RANK * resolve_degrees(ParallelConfig(**keys), heads, world).data_parallel)
               for _, keys, _, _ in VARIANTS[world]]
    mine = {i: one_process(base, batch) for i, batch in enumerate(batches) if i % world == dist.get_rank()}
    refs = []
    for i in range(len(batches)):
        box = [mine.get(i)]
        dist.broadcast_object_list(box, src=i % world)
        refs.append(box[0])
    return refs


def full_gradients(model: torch.nn.Module, fsdp: bool, world: int) -> dict[str, torch.Tensor]:
    """Every parameter's gradient on every rank: gathered from the FSDP shards (already averaged over the mesh), or
    averaged over all ranks here (what FSDP's reduce-scatter would do)."""
    grads = {}
    for name, p in model.named_parameters():
        if fsdp:
            assert isinstance(p.grad, DTensor), name
            grads[name] = p.grad.full_tensor()
        else:
            g = p.grad.clone()
            dist.all_reduce(g)
            grads[name] = g / world
    return grads


def run_variant(name: str, keys: dict, fsdp: bool, remat: bool, base: torch.nn.Module, world: int,
                reference: tuple) -> None:
    plan = init_parallel(ParallelConfig(**keys), base.spec.num_attention_heads, device_type="cpu")
    batch = inputs(PER_RANK * plan.dp_size)
    ref_loss, ref_out, ref_grads = reference
    assert ref_out.shape[0] == batch[0].shape[0], (name, ref_out.shape, plan.dp_size)

    model = copy.deepcopy(base)
    if remat:
        for block in model.blocks:
            block.checkpoint_attention = block.checkpoint_mlp = True
            block.ttt.checkpoint_forward = block.ttt.checkpoint_reverse = True
    if fsdp:
        shard_model(model, plan.fsdp_mesh, param_dtype=torch.float32, reduce_dtype=torch.float32)
    rows = slice(PER_RANK * plan.dp_rank, PER_RANK * (plan.dp_rank + 1))
    mine = tuple(t[rows] for t in batch)
    loss, out = loss_of(model, mine, plan.sequence)
    loss.backward()

    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= world
    label = f"[{name}, rank {dist.get_rank()}]"
    torch.testing.assert_close(mean_loss, ref_loss, rtol=RTOL, atol=ATOL, msg=lambda m: f"{label} loss: {m}")
    torch.testing.assert_close(out.detach(), ref_out[rows], rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{label} output: {m}")
    grads = full_gradients(model, fsdp, world)
    assert grads.keys() == ref_grads.keys()
    worst = 0.0  # the largest error as a fraction of what the tolerance allows
    for pname, ref in ref_grads.items():
        torch.testing.assert_close(grads[pname], ref, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, pname=pname: f"{label} gradient of {pname}: {m}")
        worst = max(worst, ((grads[pname] - ref).abs() / (ATOL + RTOL * ref.abs())).max().item())
    print(f"{label} ok: loss {mean_loss.item():.6f}, {len(grads)} gradients match, worst error {worst:.2f} of the "
          f"tolerance", flush=True)


def main() -> int:
    # a launch past its time limit asks for the stacks (tests/launching.run_launch), as `tttv` answers it
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    base = CogVideoXTTT(spec_for(world), TTT)
    base.set_ttt_gates(0.5)  # the TTT branches weigh in the output and the gradients
    dist.init_process_group("gloo")
    try:
        for (name, keys, fsdp, remat), reference in zip(VARIANTS[world], references(base, world)):
            run_variant(name, keys, fsdp, remat, base, world, reference)
    except BaseException:
        close_parallel(wait=False)
        raise
    close_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
