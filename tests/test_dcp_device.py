"""A checkpoint written by two processes (FSDP2 shards of torchao's 8-bit AdamW state in dcp/, with or without the
model's) read by one process into a model on its training device: `--resume` on another number of GPUs.

DCP reads every tensor into host memory and copies it into its target, a slice of the one-process state per saved
shard. On two H200s (benchmarks/stage_chain.py --reshard-gpus 1) the one-process resume on a GPU failed inside
torchao's copy into the 8-bit state ("Expected all tensors to be on the same device": it quantises the source with
its code map, which is on the GPU). The two writers run on CPU (gloo); the reader runs on CPU everywhere and on the
GPU where there is one (the case that failed). The 8-bit state must come back code for code.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from tttvideo.config.schema import TrainConfig
from tttvideo.train.dcp import DCP_DIR, holds_model_state, load_sharded_checkpoint
from tttvideo.train.optim import build_optimizer

if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _model(seed: int) -> nn.Module:
    """Big enough for 8-bit state (torchao keeps tensors under 4096 values in float32), each weight's rows in
    whole 256-value blocks on either of two shards."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 64))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, device: str) -> None:
    generator = torch.Generator().manual_seed(7)
    for _ in range(2):
        model(torch.randn(4, 128, generator=generator).to(device)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _write_sharded(rank: int, world: int, folder: str) -> None:
    """One of the two writers: FSDP2 over gloo, two steps, the sharded checkpoint, and (rank 0) the whole state
    gathered, to compare with."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        model = _model(0)
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = build_optimizer(model, TrainConfig(optimizer="adamw8bit", lr=1e-3))
        _train(model, optimizer, "cpu")
        model_sd, optim_sd = get_state_dict(model, optimizer)
        # the trainer's layout (the optimizer's shards; the model whole beside them) and the earlier one (both)
        dcp.save({"optimizer": optim_sd}, checkpoint_id=f"{folder}/optimizer-only/{DCP_DIR}")
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=f"{folder}/with-model/{DCP_DIR}")
        whole = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save({"model": whole[0], "optimizer": _plain(whole[1])}, f"{folder}/whole.pt")
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # done: leave without tearing the group and torch down, which now and then aborted the process after its work
    # ("terminate called without an active exception")
    os._exit(0)


def _plain(tree: object) -> object:
    """A state dict with torchao's 8-bit tensors as their float values (what the comparison reads)."""
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_plain(v) for v in tree]
    if isinstance(tree, torch.Tensor):
        return (tree.dequantize() if hasattr(tree, "dequantize") else tree).detach().cpu().clone()
    return tree


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> object:
    folder = tmp_path_factory.mktemp("sharded")
    mp.spawn(_write_sharded, args=(2, str(folder)), nprocs=2, join=True)
    return folder


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("trust", [False, True], ids=["allow-listed", "trusted"])
@pytest.mark.parametrize("layout", ["optimizer-only", "with-model"])
@pytest.mark.parametrize("device", DEVICES)
def test_one_process_reads_two_processes_8bit_state_onto_its_device(sharded, device, layout, trust):
    want = torch.load(sharded / "whole.pt", weights_only=True)
    model = _model(1).to(device)  # other weights and state: every value must come from the files
    optimizer = build_optimizer(model, TrainConfig(optimizer="adamw8bit", lr=1e-3))
    _train(model, optimizer, device)
    assert holds_model_state(sharded / layout) == (layout == "with-model")
    if layout == "optimizer-only":  # the model from its whole file, as the trainer reads model.safetensors
        model.load_state_dict(want["model"])
    load_sharded_checkpoint(sharded / layout, model, optimizer, trust=trust)
    for name, value in model.state_dict().items():
        assert value.device.type == device and torch.equal(value.cpu(), want["model"][name]), name
    got = _plain(get_state_dict(model, optimizer)[1])["state"]  # keyed by parameter name, as the whole one
    assert set(got) == set(want["optimizer"]["state"])
    for name, values in got.items():
        for key, value in values.items():
            assert torch.equal(value, want["optimizer"]["state"][name][key]), (name, key)
    quantised = sum(hasattr(v, "dequantize") and v.device.type == device
                    for state in optimizer.state.values() for v in state.values())
    assert quantised >= 4  # the test covers the quantised state it is about, on the device


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_trusted_metadata_that_the_allow_list_refuses_still_reads_the_optimizer_only_layout(sharded, monkeypatch):
    """--trust-checkpoint is for metadata the allow-list refuses (another torch version's types). The layout test
    (does dcp/ hold the model?) then reads it with DCP's own reader too: taking an unreadable file for the earlier
    layout asked DCP for model keys the checkpoint does not have ("Missing key")."""
    from tttvideo.errors import UserError
    from tttvideo.train import dcp as dcp_module

    allowed = dcp_module._allowed
    monkeypatch.setattr(dcp_module, "_allowed", lambda module, name: name != "Size" and allowed(module, name))
    folder = sharded / "optimizer-only"
    with pytest.raises(UserError, match="--trust-checkpoint"):
        dcp_module.read_dcp_metadata(folder / DCP_DIR / ".metadata")
    assert holds_model_state(folder)  # unreadable without trust: the load says why
    assert not holds_model_state(folder, trust=True)
    want = torch.load(sharded / "whole.pt", weights_only=True)
    model = _model(1)
    optimizer = build_optimizer(model, TrainConfig(optimizer="adamw8bit", lr=1e-3))
    _train(model, optimizer, "cpu")
    model.load_state_dict(want["model"])
    load_sharded_checkpoint(folder, model, optimizer, trust=True)
    got = _plain(get_state_dict(model, optimizer)[1])["state"]
    for name, values in got.items():
        for key, value in values.items():
            assert torch.equal(value, want["optimizer"]["state"][name][key]), (name, key)
