"""train.optimizer = "adamw8bit" (torchao's AdamW8bit through build_optimizer): 8-bit state, bitwise resume through
state_dict, losses that track fp32 AdamW on the tiny model, the error when torchao is missing."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn

from tttvideo.config.schema import TrainConfig, TTTConfig
from tttvideo.errors import ConfigError
from tttvideo.models import apply_adapter, get_preset, init_model
from tttvideo.train import optim
from tttvideo.train.optim import build_optimizer, build_scheduler, group_lr
from tttvideo.train.statefile import read_state, write_state

pytest.importorskip("torchao.optim")
from torchao.optim.subclass_8bit import OptimState8bit  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TTT = TTTConfig(mini_batch_size=16, scan_checkpoint_group_size=2)


def tiny(use_ttt: bool = True) -> nn.Module:
    torch.manual_seed(0)
    model = init_model(get_preset("tiny"), TTT, use_ttt)
    return apply_adapter(model, "qkvo")


def batch(step: int):
    g = torch.Generator().manual_seed(step % 4)
    latents = torch.randn(1, 13, 16, 4, 6, generator=g)
    return latents, torch.randn(1, 1, 5, 64, generator=g), torch.tensor([400.0]), torch.randn(latents.shape,
                                                                                               generator=g)


def train(model: nn.Module, opt: torch.optim.Optimizer, sched, steps: range) -> list[float]:
    losses = []
    for step in steps:
        latents, text, t, target = batch(step)
        loss = (model(latents, text, t) - target).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def config(name: str, **kw) -> TrainConfig:
    return TrainConfig(optimizer=name, lr=1e-3, lr_ssm=1e-3, lr_end=1e-4, steps=200, warmup_steps=5, **kw)


def test_state_is_8bit_and_resumes_bitwise(tmp_path):
    cfg = config("adamw8bit")
    straight = tiny()
    opt = build_optimizer(straight, cfg)
    sched = build_scheduler(opt, cfg)
    train(straight, opt, sched, range(3))
    kinds = [type(s["exp_avg"]) for s in opt.state.values()]
    assert OptimState8bit in kinds and torch.Tensor in kinds  # small tensors keep fp32 moments
    assert all(isinstance(g["lr"], float) for g in opt.param_groups) and isinstance(group_lr(opt, True), float)

    model = copy.deepcopy(straight)
    # through the checkpoint's state file: the 8-bit moments are stored as their codes, scales and maps
    write_state({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, tmp_path / "state.safetensors")
    train(straight, opt, sched, range(3, 6))

    state = read_state(tmp_path / "state.safetensors")
    opt2 = build_optimizer(model, cfg)
    sched2 = build_scheduler(opt2, cfg)  # the trainer's order: build both, then load both
    opt2.load_state_dict(state["optimizer"])
    sched2.load_state_dict(state["scheduler"])
    train(model, opt2, sched2, range(3, 6))
    for (name, a), b in zip(straight.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name


def test_8bit_losses_track_fp32_adamw():
    """200 steps on four fixed batches, without the TTT layers (their CPU scan costs 0.2 s a step; the attention
    q/k/v/o weights, 64 x 64, are the tensors with 8-bit state either way). Measured: the loss falls from 1.351 to a
    last-20-step mean of 1.132 with both; the 8-bit run's differs by 0.010% at the end and by 0.018% at worst."""
    curves = {}
    for name in ("adamw", "adamw8bit"):
        model = tiny(use_ttt=False)
        cfg = config(name)
        opt = build_optimizer(model, cfg)
        curves[name] = train(model, opt, build_scheduler(opt, cfg), range(200))
    ref, got = torch.tensor(curves["adamw"]), torch.tensor(curves["adamw8bit"])
    assert ref[-20:].mean() < 0.9 * ref[0] and got[-20:].mean() < 0.9 * got[0]
    gap = ((got - ref).abs() / ref).max().item()
    end_gap = abs(got[-20:].mean() - ref[-20:].mean()).item() / ref[-20:].mean().item()
    assert 0 < gap and end_gap < 0.002 and gap < 0.005, (end_gap, gap)


def test_missing_torchao_is_one_sentence(monkeypatch):
    optim.adamw8bit_class.cache_clear()
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    try:
        with pytest.raises(ConfigError) as info:
            build_optimizer(tiny(), config("adamw8bit"))
    finally:
        optim.adamw8bit_class.cache_clear()
    msg = str(info.value)
    assert "train.optimizer" in msg and "pip install" in msg and "\n" not in msg


def test_compiled_update_traces_bf16_fsdp2_state(tmp_path):
    """FSDP2 with bf16 parameters: the state torchao's compiled update receives must fakeify. With the parameter's
    dtype as the state's appearance, DTensor.from_local's view answered float32 over a bf16 base and tracing
    failed ("OptimState8bit ... aten.view.dtype"; seen on two GPUs after forward and backward). The eager backend
    traces with dynamo like the GPU path, without a C++ build."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchao.optim.adam import single_param_adam

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        layer = nn.Linear(256, 256).to(torch.bfloat16)
        fully_shard(layer, mesh=init_device_mesh("cpu", (1,)))
        layer(torch.randn(4, 256, dtype=torch.bfloat16)).square().mean().backward()
        opt = build_optimizer(layer, config("adamw8bit"))
        p = layer.weight
        exp_avg, exp_avg_sq = opt._new_buffer(p, True), opt._new_buffer(p, False)
        assert isinstance(exp_avg.to_local(), OptimState8bit)
        before = p.detach().to_local().clone()
        torch._dynamo.reset()
        update = torch.compile(single_param_adam, backend="eager", fullgraph=True)
        update(p.detach(), p.grad, torch.tensor(1.0), exp_avg, exp_avg_sq, None, torch.tensor(1e-2), 0.9, 0.95,
               0.0, 1e-8, True, False)
        assert not torch.equal(p.detach().to_local(), before)  # the update ran and moved the weights
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


@pytest.mark.parametrize("stochastic", [False, True])
def test_bf16_stochastic_round_keeps_updates_below_half_a_bf16_step(stochastic):
    # weights of 1.0 in bf16 are 2^-7 apart; AdamW moves each by about lr = 1e-4 a step, far below half a step, so
    # round-to-nearest drops every update while stochastic rounding moves the weights by lr a step on average
    torch.manual_seed(0)
    model = nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    nn.init.ones_(model.weight)
    train = TrainConfig(optimizer="adamw8bit", lr=1e-4, weight_decay=0.0, bf16_stochastic_round=stochastic)
    opt = build_optimizer(model, train)
    steps = 40
    for _ in range(steps):
        model.weight.grad = torch.ones_like(model.weight)
        opt.step()
    moved = 1.0 - model.weight.float().mean().item()
    if stochastic:
        assert moved == pytest.approx(steps * 1e-4, rel=0.2)
    else:
        assert moved == 0.0


def test_bf16_stochastic_round_needs_the_8bit_optimizer():
    with pytest.raises(ConfigError, match="train.bf16_stochastic_round needs train.optimizer = 'adamw8bit'"):
        build_optimizer(tiny(), TrainConfig(optimizer="adamw", bf16_stochastic_round=True))
