"""The parallel foundation on CPU: the [parallel] degrees and their validation, the layout's sequence shards, and
under torchrun with gloo (tests/parallel_worker.py) Ulysses sp, FSDP, both and HSDP + sp against the one-process
run: loss, output and every parameter gradient within rtol 1e-4, atol 1e-5 (fp32)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.launching import run_launch
from tttvideo.config.loader import load_config
from tttvideo.config.schema import ParallelConfig
from tttvideo.errors import ConfigError
from tttvideo.layout import VideoLayout
from tttvideo.parallel import Degrees, init_parallel, resolve_degrees

if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

WORKER = Path(__file__).with_name("parallel_worker.py")
# both launches together take about 55 s on a 2-core machine
LAUNCH_TIMEOUT_S = 150


# ------------------------------------------------------------------------------------------- degrees and validation
def test_dp_shard_minus_one_takes_what_is_left():
    assert resolve_degrees(ParallelConfig(), heads=48, world_size=8) == Degrees(1, 8, 1)
    assert resolve_degrees(ParallelConfig(sp=4), heads=48, world_size=8) == Degrees(1, 2, 4)
    assert resolve_degrees(ParallelConfig(dp_replicate=2, sp=2), heads=48, world_size=8) == Degrees(2, 2, 2)
    assert resolve_degrees(ParallelConfig(), heads=2, world_size=1) == Degrees(1, 1, 1)


@pytest.mark.parametrize("keys, world, needle", [
    (dict(sp=5), 10, "parallel.sp = 5 does not divide the model's 48 attention heads"),
    (dict(sp=4), 6, "parallel.sp = 4 does not divide the world size 6"),
    (dict(dp_shard=2, sp=2), 8, "dp_replicate x dp_shard x sp = 1 x 2 x 2 = 4, but the world size (WORLD_SIZE) is 8"),
    (dict(dp_replicate=3), 8, "parallel.dp_replicate x sp = 3 x 1 does not divide the world size 8"),
    (dict(dp_shard=0), 8, "parallel.dp_shard = 0 is not a degree"),
    (dict(tensor_parallel=2), 8, "parallel.tensor_parallel = 2: tensor parallelism is not implemented"),
    (dict(sp=2), 1, "parallel.sp = 2 does not divide the world size 1"),
])
def test_inconsistent_degrees_are_one_sentence(keys, world, needle):
    with pytest.raises(ConfigError) as err:
        resolve_degrees(ParallelConfig(**keys), heads=48, world_size=world)
    assert needle in str(err.value)
    assert str(err.value).count(". ") == 0  # one sentence


def test_one_process_initialises_nothing(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    plan = init_parallel(ParallelConfig(), heads=2)
    assert not plan.distributed and plan.sequence is None and plan.fsdp_mesh is None
    assert (plan.dp_rank, plan.dp_size) == (0, 1)
    assert not dist.is_initialized()


def test_old_key_data_parallel_shard_is_read_as_dp_shard(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("[parallel]\ndata_parallel_shard = 1\ntensor_parallel = 1\n")
    assert load_config(path).parallel == ParallelConfig(dp_shard=1)
    assert load_config(None, ["parallel.data_parallel_shard=4"]).parallel.dp_shard == 4


# ------------------------------------------------------------------------------------------------ sequence shards
def test_layout_shards_cover_the_stream_and_its_text():
    layout = VideoLayout.create("9s", height=32, width=48, text_tokens=75, mini_batch_size=16)
    assert layout.total_tokens == 447 and layout.total_text_tokens == 225
    for sp, shard, pad, text in [(1, 447, 0, [225]), (2, 224, 1, [224, 1]), (4, 112, 1, [112, 112, 1, 0])]:
        assert (layout.sp_shard_tokens(sp), layout.sp_padding(sp)) == (shard, pad)
        assert [layout.sp_shard_text_tokens(sp, r) for r in range(sp)] == text


def test_reverse_scan_order_is_the_interleave_of_the_reversed_stream():
    layout = VideoLayout.create("9s", height=32, width=48, text_tokens=5, mini_batch_size=16)
    x = torch.randn(1, layout.total_tokens, 3)
    assert torch.equal(x[:, layout.reverse_interleave_perm], x[:, layout.reverse_perm][:, layout.interleave_perm])
    back = x[:, layout.reverse_interleave_perm][:, layout.reverse_deinterleave_perm]
    assert torch.equal(back, x)


# ------------------------------------------------------------------------------------------------------- torchrun
@pytest.mark.parametrize("ranks", [2, 4])
def test_parallel_runs_match_one_process(ranks):
    """sp alone, FSDP alone, FSDP + sp (with activation checkpointing) and, on 4 ranks, sp = 4 and HSDP + sp."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
           str(WORKER)]
    run = run_launch(cmd, env, LAUNCH_TIMEOUT_S)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-6000:]
    variants = 3 if ranks == 2 else 4
    assert log.count(" ok: ") == variants * ranks, log[-6000:]


@pytest.mark.parametrize("env, asked, expected", [
    ({}, "cuda", "cuda:0"),  # a one-process torchrun or none: torch.cuda.set_device refuses a bare 'cuda'
    ({"WORLD_SIZE": "1", "LOCAL_RANK": "0"}, "cuda", "cuda:0"),
    ({"WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "cuda", "cuda:1"),
    ({"WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "cuda:0", "cuda:1"),  # each rank takes its own GPU
    ({}, "cuda:1", "cuda:1"),
    ({"WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "cpu", "cpu"),
])
def test_rank_device_is_always_an_indexed_gpu(monkeypatch, env, asked, expected):
    from tttvideo.parallel.launch import rank_device

    for key in ("WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert rank_device(torch.device(asked)) == torch.device(expected)


def test_barrier_names_the_gpu_to_nccl(monkeypatch):
    # without device_ids NCCL's barrier guesses the device and torch warns on every rank at every barrier
    import torch.distributed as dist

    from tttvideo.parallel import mesh

    calls = []
    monkeypatch.setattr(dist, "barrier", lambda **kw: calls.append(kw))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    mesh.barrier()
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    mesh.barrier()
    assert calls == [{"device_ids": [1]}, {}]
