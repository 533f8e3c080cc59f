"""offload_activations (tttvideo.models.activation_offload): the same gradients with saved activations taken
through host copies, a count of what was offloaded, parameters and small tensors left in place."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tttvideo.config.schema import CheckpointingConfig, TTTConfig
from tttvideo.models import apply_adapter, apply_checkpointing, get_preset, init_model
from tttvideo.models.activation_offload import offload_activations
from tttvideo.models.fp8_storage import store_fp8

pytestmark = pytest.mark.usefixtures("one_thread")

TTT = TTTConfig(mini_batch_size=16, scan_checkpoint_group_size=2)


def grads(model: nn.Module, offload: offload_activations | None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(1, 13, 16, 4, 6, generator=g).requires_grad_()
    text, t = torch.randn(1, 1, 5, 64, generator=g), torch.tensor([400.0])
    model.zero_grad(set_to_none=True)
    if offload is None:
        out = model(latents, text, t)
    else:
        with offload:
            out = model(latents, text, t)
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    found = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    found["latents"] = latents.grad
    return found


@pytest.mark.parametrize("fp8,block_checkpointing", [(False, False), (True, False), (False, True)])
def test_gradients_equal_with_offload(fp8, block_checkpointing):
    torch.manual_seed(0)
    model = apply_adapter(init_model(get_preset("tiny"), TTT, True), "qkvo")
    if fp8:
        store_fp8(model)
    if block_checkpointing:  # what a checkpointed block keeps (its inputs) goes through the hooks too
        apply_checkpointing(model, CheckpointingConfig(block=True))
    plain = grads(model, None)
    off = offload_activations(min_bytes=4096, keep=model)
    moved = grads(model, off)
    assert moved.keys() == plain.keys() and len(plain) > 10
    for name, g in plain.items():
        assert torch.equal(moved[name], g), name
    assert off.offloaded_tensors > 0 and off.offloaded_bytes >= 4096 * off.offloaded_tensors


def test_threshold_parameters_and_kept_buffers_stay():
    lin = nn.Linear(64, 64)
    codes = torch.randn(64, 64)  # stands for a module buffer (fp8 codes) saved by a custom backward
    holder = nn.Module()
    holder.register_buffer("codes", codes)
    x = torch.randn(32, 64, requires_grad=True)
    with offload_activations(min_bytes=1024) as off:
        lin(x)  # saves x (8 KiB) and a view of the weight (a Parameter)
    assert off.offloaded_tensors == 1 and off.offloaded_bytes == x.numel() * 4
    with offload_activations(min_bytes=1024, keep=holder) as off:
        y = lin(x) + (x @ codes).sum()  # saves x, the weight and codes (a kept buffer, 16 KiB)
    assert off.offloaded_tensors == 1 and off.offloaded_bytes == x.numel() * 4
    with offload_activations(min_bytes=1 << 20) as big:
        lin(x)
    assert big.offloaded_tensors == 0
    y.sum().backward()
    assert x.grad is not None


# ------------------------------------------------------------------------- checkpointing.offload_activations wired
TRAIN = ["train.if_exists=refuse", "layout.duration=3s", "data.demo_videos=2", "data.demo_text_encoder=table",
         "train.batch_size=1", "train.steps=3", "train.checkpoint_every=3", "train.log_every=1",
         "train.sample_at_end=false", "train.tensorboard=false", "model.adapter=qkvo", "checkpointing.block=true"]


def trained_weights(tmp_path, name: str, *extra: str) -> tuple[dict[str, torch.Tensor], int]:
    from tttvideo.config.loader import load_config
    from tttvideo.train.trainer import Trainer

    cfg = load_config("configs/demo.toml", TRAIN + [f"train.output_dir={tmp_path / name}",
                                                    f"data.demo_dir={tmp_path / 'data'}", *extra])
    trainer = Trainer(cfg, quiet=True)
    trainer.run()
    return ({k: v.clone() for k, v in trainer.model.state_dict().items()}, trainer.train_step.offloaded_bytes)


def test_trainer_with_offload_trains_the_same_weights(tmp_path, monkeypatch):
    """A few fp32 steps of the tiny model with checkpointing.offload_activations on give bit-identical weights;
    the threshold is lowered so that the tiny model's saved tensors do go through host copies."""
    from tttvideo.train import step

    monkeypatch.setattr(step, "OFFLOAD_MIN_BYTES", 1024)
    plain, none_moved = trained_weights(tmp_path, "plain")
    moved, offloaded = trained_weights(tmp_path, "offload", "checkpointing.offload_activations=true")
    assert none_moved == 0 and offloaded > 0
    assert moved.keys() == plain.keys()
    for name, w in plain.items():
        assert torch.equal(moved[name], w), name


def test_profiler_train_phase_runs_with_offload(tmp_path, monkeypatch):
    from tttvideo.config.loader import load_config
    from tttvideo.memory.profile import drivers
    from tttvideo.train import step

    monkeypatch.setattr(step, "OFFLOAD_MIN_BYTES", 1024)
    cfg = load_config(None, ["layout.duration=3s", "layout.height=64", "layout.width=64", "layout.text_tokens=24",
                             "ttt.backend=reference", "train.precision=fp32",
                             "checkpointing.offload_activations=true", "checkpointing.block=true"])
    summary, code = drivers.profile(cfg, "train", 1, tmp_path / "report", device="cpu")
    assert code == 0 and summary["status"] == "ok"
    assert {p["name"] for p in summary["phases"]} >= {"forward", "backward", "optimizer step"}


# ------------------------------------------------------------------------- the host pool
def test_pool_holds_exact_sizes_and_is_reused():
    """Host memory holds exactly what was offloaded (no rounding up), and a second micro-batch reuses it."""
    from tttvideo.models.activation_offload import HostPool

    torch.manual_seed(0)
    model = apply_adapter(init_model(get_preset("tiny"), TTT, True), "qkvo")
    apply_checkpointing(model, CheckpointingConfig(block=True))
    pool = HostPool()
    first = offload_activations(min_bytes=4096, keep=model, pool=pool)
    plain = grads(model, None)
    moved = grads(model, first)
    assert first.offloaded_tensors > 0 and pool.allocated_bytes == first.offloaded_bytes
    second = offload_activations(min_bytes=4096, keep=model, pool=pool)
    grads(model, second)
    assert second.offloaded_bytes == first.offloaded_bytes and pool.allocated_bytes == first.offloaded_bytes
    for name, g in plain.items():
        assert torch.equal(moved[name], g), name


def test_full_pool_keeps_the_rest_on_the_device():
    from tttvideo.models.activation_offload import HostPool

    torch.manual_seed(0)
    model = apply_adapter(init_model(get_preset("tiny"), TTT, True), "qkvo")
    plain = grads(model, None)
    everything = offload_activations(min_bytes=4096, keep=model)
    grads(model, everything)
    pool = HostPool(capacity_bytes=everything.offloaded_bytes // 2)
    partial = offload_activations(min_bytes=4096, keep=model, pool=pool)
    moved = grads(model, partial)
    assert 0 < partial.offloaded_bytes <= everything.offloaded_bytes // 2
    assert partial.offloaded_bytes + partial.kept_bytes == everything.offloaded_bytes
    for name, g in plain.items():
        assert torch.equal(moved[name], g), name


def test_asking_for_more_host_memory_than_there_is(monkeypatch):
    from tttvideo.errors import ConfigError
    from tttvideo.models import activation_offload

    monkeypatch.setattr(activation_offload, "available_host_bytes", lambda: 8 * 2**30)
    with pytest.raises(ConfigError, match=r"checkpointing.offload_host_gib = 100 .* 8.0 GiB"):
        activation_offload.host_pool_for(100)
    assert activation_offload.host_pool_for(4).capacity_bytes == 4 * 2**30
    assert activation_offload.host_pool_for(0).capacity_bytes == int(8 * 2**30 * 0.9)


def test_the_ranks_of_one_machine_share_its_host_memory(monkeypatch):
    # two torchrun ranks of a machine each took 90 % of what was available for their pools, together 180 %
    from tttvideo.errors import ConfigError
    from tttvideo.models import activation_offload

    monkeypatch.setattr(activation_offload, "available_host_bytes", lambda: 8 * 2**30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert activation_offload.host_pool_for(0).capacity_bytes == int(8 * 2**30 * 0.9 / 2)
    assert activation_offload.host_pool_for(3).capacity_bytes == 3 * 2**30
    with pytest.raises(ConfigError, match=r"= 5 for each of the 2 processes of this machine .* at most 4"):
        activation_offload.host_pool_for(5)


def test_the_pool_leaves_room_for_the_compile_workers(monkeypatch):
    # Inductor forks its compile workers at the first step's first compile, after the pool is sized: on a 125 GiB
    # host a pool of 90 % of what was available and a 16-worker pool of 7 GiB would not fit beside each other
    from tttvideo.errors import ConfigError
    from tttvideo.models import activation_offload

    monkeypatch.setattr(activation_offload, "available_host_bytes", lambda: 8 * 2**30)
    assert activation_offload.host_pool_for(0, held_back=2 * 2**30).capacity_bytes == int(6 * 2**30 * 0.9)
    assert activation_offload.host_pool_for(5, held_back=2 * 2**30).capacity_bytes == 5 * 2**30
    with pytest.raises(ConfigError, match=r"6.0 GiB of host memory available once the compile workers take their "
                                          r"2.0 GiB .* at most 5"):
        activation_offload.host_pool_for(7, held_back=2 * 2**30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # each rank forks its own workers
    assert activation_offload.host_pool_for(0, held_back=2 * 2**30).capacity_bytes == int(4 * 2**30 * 0.9 / 2)


def test_offload_under_fsdp2_keeps_sharded_parameters_and_gradients(tmp_path):
    """FSDP2 makes every parameter a DTensor, whose own storage cannot be read: offload_activations(keep=model) over
    a sharded model raised "Attempted to access the data pointer on an invalid python storage" before any step
    (each rank of the two-GPU 30 s and 63 s stages, which offload). A one-rank gloo mesh shards the same way."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        plain = copy.deepcopy(model)
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        x = torch.randn(32, 64)
        with offload_activations(min_bytes=1024, pin=False, keep=model) as off:
            loss = model(x).square().sum()
        loss.backward()
        plain(x).square().sum().backward()
        assert off.offloaded_tensors > 0  # the 32 x 256 activations went through the host; the weights did not
        assert off.offloaded_bytes < sum(p.numel() for p in plain.parameters()) * 4
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()
