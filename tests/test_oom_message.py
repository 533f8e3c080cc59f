"""A CUDA out-of-memory error becomes one sentence (tttvideo.memory.guard.oom): `tttv train` and `tttv sample` exit 2
naming the phase, the block, the newest checkpoint and the switches not on with what each saves, counted from the
model (with the planner's byte counts, checked against the optimizers' real state). The error is faked on CPU by a
block that raises torch.cuda.OutOfMemoryError."""

from __future__ import annotations

import copy

import pytest
import torch

from tttvideo.cli import main
from tttvideo.config.loader import load_config
from tttvideo.memory.guard.oom import train_savings
from tttvideo.memory.techniques import ModelBytes, optimizer_state_bytes
from tttvideo.models import build_model
from tttvideo.models.cogvideox.block import Block
from tttvideo.models.fp8_storage import frozen_weight_bytes, store_fp8

pytestmark = pytest.mark.usefixtures("one_thread")

TRAIN = ["train.if_exists=refuse", "layout.duration=3s", "data.demo_videos=2", "data.demo_text_encoder=table",
         "train.batch_size=1", "train.steps=4", "train.checkpoint_every=2", "train.log_every=1",
         "train.sample_at_end=false", "train.tensorboard=false", "model.adapter=qkvo"]
LAYERS = 2  # the tiny preset's blocks


def fail_at(monkeypatch, call: int) -> None:
    """Block.forward raises CUDA's out-of-memory error on its `call`-th call (0-based, over all blocks)."""
    forward, calls = Block.forward, [0]

    def maybe_fail(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] - 1 == call:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Block, "forward", maybe_fail)


def test_train_oom_is_one_sentence_with_phase_block_checkpoint_and_switches(tmp_path, monkeypatch, capsys):
    fail_at(monkeypatch, 2 * LAYERS + 1)  # the forward of step 3, block 1: step 2 has been saved
    run = tmp_path / "run"
    code = main(["train", "configs/demo.toml", *[a for s in TRAIN for a in ("--set", s)],
                 "--set", f"train.output_dir={run}", "--set", f"data.demo_dir={tmp_path / 'data'}"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    msg = lines[0]
    assert msg.startswith("tttv train: error: out of GPU memory in the forward of step 3, in block 1 of 2 (CUDA out "
                          "of memory. Tried to allocate 2.00 GiB (simulated)); the newest checkpoint is "), msg
    assert f"{run / 'checkpoints' / 'step-000002'}" in msg
    cfg = load_config("configs/demo.toml", TRAIN)
    model = build_model(cfg)
    counted = ModelBytes.of(model)
    frozen_linear_saving = counted.frozen_linear_saving
    adamw_state_saving = counted.optimizer["adamw"] - counted.optimizer["adamw8bit"]
    expected = [f"model.frozen_weights = 'fp8' ({frozen_linear_saving / 2**30:.2f} GiB",
                f"train.optimizer = 'adamw8bit' ({adamw_state_saving / 2**30:.2f} GiB",
                "checkpointing.block = true", "checkpointing.offload_activations = true (",
                "tttv profile CONFIG --phase train shows where the memory goes",
                "`tttv plan CONFIG --gpu-mem SIZE --phase train` (or --auto-fit) picks the fastest setup that fits"]
    at = [msg.index(e) for e in expected]
    # counted savings in decreasing order, then the uncounted ones
    largest = sorted([(frozen_linear_saving, at[0]), (adamw_state_saving, at[1])], reverse=True)
    assert [a for _, a in largest] == sorted(a for _, a in largest) and max(at[:2]) < at[2]


def test_switches_already_on_are_not_suggested():
    cfg = load_config("configs/demo.toml", TRAIN + ["model.frozen_weights=fp8", "train.optimizer=adamw8bit",
                                                    "checkpointing.block=true", "memory.max_gpu_gib=24"])
    model = build_model(cfg)
    found = [s.switch for s in train_savings(cfg, model, gpus=2)]
    # whole blocks (the parts unchecked): checkpointing the parts too frees their activations (not counted)
    assert found == ["checkpointing.offload_activations = true",
                     "checkpointing.attention, forward_ttt, reverse_ttt and mlp = true",
                     "parallel.sp = 2 under torchrun"]
    everything = load_config("configs/demo.toml", TRAIN + [
        "model.frozen_weights=fp8", "train.optimizer=adamw8bit", "checkpointing.block=true",
        *(f"checkpointing.{p}=true" for p in ("attention", "forward_ttt", "reverse_ttt", "mlp"))])
    assert "checkpointing.attention" not in " ".join(s.switch for s in train_savings(everything, model, gpus=2))


def test_kept_outputs_are_suggested_away_with_their_size():
    cfg = load_config("configs/demo.toml", TRAIN + ["model.frozen_weights=fp8", "train.optimizer=adamw8bit",
                                                    "checkpointing.block=true", 'checkpointing.keep=["attention"]'])
    model = build_model(cfg)
    found = {s.switch: s for s in train_savings(cfg, model, gpus=1)}
    offload = found["checkpointing.offload_activations = true"]
    # one stream-sized SDPA output a layer, as the block inputs offloading would move
    assert found["checkpointing.keep = []"].nbytes == offload.nbytes > 0
    cfg.checkpointing.keep = ["attention", "matmul"]
    assert {s.switch: s for s in train_savings(cfg, model, gpus=1)}["checkpointing.keep = []"].nbytes is None


def test_fp8_saving_matches_fp8_storage():
    cfg = load_config("configs/demo.toml", TRAIN)
    model = build_model(cfg)
    converted = copy.deepcopy(model)
    store_fp8(converted)
    assert ModelBytes.of(model).frozen_linear_saving == frozen_weight_bytes(model) - frozen_weight_bytes(converted) > 0


def real_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Both moments of every parameter as they sit in memory: torchao's 8-bit codes and scales, or plain tensors."""
    total = 0
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            t = state[key]
            parts = (t.codes, t.scale) if hasattr(t, "codes") else (t,)
            total += sum(p.numel() * p.element_size() for p in parts)
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimizer_byte_count_is_what_the_optimizers_allocate(dtype):
    """The one count of optimizer state (the planner's and the OOM advice's) against AdamW's and torchao's
    AdamW8bit's real state, after a step on CPU, over tensors torchao quantizes (>= 4096 values, a multiple of 256)
    and those it leaves plain (small, ragged)."""
    pytest.importorskip("torchao")
    from tttvideo.train.optim import adamw8bit_class

    torch.manual_seed(0)
    shapes = [(64, 64), (16, 512), (100,), (65, 64), (4096,)]
    for name in ("adamw", "adamw8bit"):
        params = [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes]
        opt = adamw8bit_class()(params) if name == "adamw8bit" else torch.optim.AdamW(params)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        counted = sum(optimizer_state_bytes(name, p.numel(), p.element_size()) for p in params)
        assert counted == real_state_bytes(opt), name


def test_advice_counts_the_optimizer_as_the_planner_does():
    cfg = load_config("configs/demo.toml", TRAIN)
    model = build_model(cfg)
    saving = {s.switch: s.nbytes for s in train_savings(cfg, model, gpus=1)}["train.optimizer = 'adamw8bit'"]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert saving == sum(optimizer_state_bytes("adamw", p.numel(), p.element_size())
                         - optimizer_state_bytes("adamw8bit", p.numel(), p.element_size()) for p in trainable) > 0


def test_sample_oom_names_the_denoise_step(tmp_path, monkeypatch, capsys):
    import json

    from tttvideo.config.loader import dump_toml
    from tttvideo.models import save_checkpoint

    cfg = load_config(None, ['model.adapter="qkvo"', "layout.height=32", "layout.width=48", "layout.text_tokens=16",
                             "ttt.mini_batch_size=16", "ttt.scan_checkpoint_group_size=0", 'ttt.backend="reference"',
                             'data.demo_text_encoder="table"', 'sample.device="cpu"', "sample.steps=3",
                             "sample.cfg_batched=false"])
    folder = tmp_path / "ck"
    save_checkpoint(build_model(cfg), folder / "model.safetensors")
    (folder / "config.toml").write_text(dump_toml(cfg))
    story = tmp_path / "story.json"
    story.write_text(json.dumps([{"text": "a red circle moves right"}]))
    fail_at(monkeypatch, 2 * 2 * LAYERS)  # two passes per step (cond, uncond): the first block of step 3
    code = main(["sample", "--checkpoint", str(folder), "--scenes", str(story), "--out", str(tmp_path / "v.mp4")])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err, err
    msg = lines[-1]
    assert msg.startswith("tttv sample: error: out of GPU memory in denoise step 3 of 3 of story 'story', in block 0 "
                          "of 2"), msg
    assert "model.frozen_weights = 'fp8' (" in msg and "tttv profile CONFIG --phase sample" in msg
    assert "`tttv plan CONFIG --gpu-mem SIZE --phase sample`" in msg


def test_auto_fit_replans_an_out_of_memory_first_step_and_trains_on(tmp_path, monkeypatch, capsys):
    """--auto-fit: the first step of the chosen setup runs out of memory (faked in block 0's forward); the run says so
    in one sentence naming the setup, the phase and the block, re-plans with the activations scaled by what the
    failure showed, and trains to the end with a setup that needs less (its config saved with the run)."""
    from tttvideo.layout import VideoLayout
    from tttvideo.memory.plan import costs as costs_module
    from tttvideo.memory.plan import auto_fit, planner
    from tttvideo.memory.plan.costs import CostTable, Curve, activation_key, time_key
    from tttvideo.memory.plan.count import count

    cfg = load_config("configs/demo.toml", TRAIN)
    table = CostTable("h100")
    per_token = {"block": (1e6, 1.0), "sub-block": (1e5, 2.0)}  # bytes and seconds per token
    for cand in planner.candidates(cfg, "train"):
        c = cand.apply(cfg)
        policy = activation_key(c, "train").split("|")[4]
        if policy in per_token and not c.checkpointing.offload_activations and c.checkpointing.nested_span < 2:
            table.activation[activation_key(c, "train")] = Curve.fit([(1.0, per_token[policy][0])])
            table.time[time_key(c, "train")] = Curve.fit([(1.0, 1e-3 * per_token[policy][1])])
    tokens = VideoLayout.from_config(cfg.layout, cfg.ttt).total_tokens
    base = count(cfg, "train").total
    card = int(((base + 1.15e6 * tokens) * (1 + planner.FRAGMENTATION) + planner.CUDA_CONTEXT) / (1 - planner.MARGIN))
    monkeypatch.setattr(auto_fit, "this_gpu", lambda: ("NVIDIA H100 80GB HBM3", card))
    monkeypatch.setattr(costs_module, "load_costs", lambda kind, *a: table)
    monkeypatch.setattr(costs_module, "known_gpus", lambda *a: ["h100"])
    fail_at(monkeypatch, 0)  # the forward of step 1, block 0
    run = tmp_path / "run"
    code = main(["train", "configs/demo.toml", *[a for s in TRAIN for a in ("--set", s)], "--auto-fit",
                 "--set", "train.steps=2", "--set", f"train.output_dir={run}",
                 "--set", f"data.demo_dir={tmp_path / 'data'}"])
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err, err
    said = [line for line in err.splitlines() if "--auto-fit" in line]
    assert len(said) == 1 and said[0].startswith("tttv train: --auto-fit: ckpt block, "), err
    assert "ran out of GPU memory in the forward of step 1, in block 0 of 2" in said[0]
    assert ": ckpt sub-block, " in said[0], said[0]
    saved = load_config(run / "config.toml")
    assert saved.checkpointing.mlp and saved.checkpointing.attention  # the re-planned setup trained
    assert (run / "checkpoints" / "step-000002").is_dir()
