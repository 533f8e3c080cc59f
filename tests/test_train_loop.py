"""The trainer in-process on the tiny model: optimizer groups and schedule, loss inputs (strata, text dropout),
checkpoints (atomic, pruned, refused without --resume), init_from, and NaN/Inf handling."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from tttvideo.config.loader import load_config
from tttvideo.errors import ConfigError, UserError
from tttvideo.train import checkpoint as ckpt
from tttvideo.train.optim import build_optimizer, lr_multiplier
from tttvideo.train.trainer import Trainer, TrainingDiverged, batch_plan

TINY = [
    "train.if_exists=refuse", "layout.duration=3s", "data.demo_videos=3", "data.demo_text_encoder=table",
    "train.batch_size=1",
    "train.steps=4", "train.checkpoint_every=2", "train.keep_checkpoints=2", "train.log_every=1",
    "train.sample_at_end=false", "train.tensorboard=false", "train.warmup_steps=1",
]


def tiny_config(tmp_path, *extra):
    return load_config("configs/demo.toml", TINY + [f"train.output_dir={tmp_path / 'run'}",
                                                    f"data.demo_dir={tmp_path / 'data'}", *extra])


def test_lr_schedule():
    assert [lr_multiplier(s, 10, 2, "constant", 0.1) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    cos = [lr_multiplier(s, 10, 2, "cosine", 0.1) for s in range(10)]
    assert cos[1] == 1.0 and math.isclose(cos[-1], 0.1) and all(a >= b for a, b in zip(cos[1:], cos[2:]))
    lin = [lr_multiplier(s, 10, 0, "linear", 0.0) for s in range(10)]
    assert lin[0] == 1.0 and lin[-1] == 0.0 and math.isclose(lin[5] - lin[6], 1 / 9)


def test_stage_schedule_is_the_originals(tmp_path):
    """3 s stage: lr 1e-5 linear to lr_end 1e-5 (constant after warmup), lr_ssm 1e-4 cosine down to 1e-5."""
    from tttvideo.models import build_model
    from tttvideo.train.optim import build_scheduler

    cfg = load_config("configs/cogvideox-5b/stage1-3s.toml", ["model.preset=tiny", "model.pretrained_path="])
    assert (cfg.train.lr, cfg.train.lr_ssm, cfg.train.lr_end, cfg.train.warmup_steps) == (1e-5, 1e-4, 1e-5, 100)
    model = build_model(cfg)
    opt = build_optimizer(model, cfg.train)
    sched = build_scheduler(opt, cfg.train)
    seen = []
    for _ in range(cfg.train.steps):
        seen.append({g["name"]: g["lr"] for g in opt.param_groups})
        opt.step()
        sched.step()
    assert math.isclose(seen[0]["pretrained"], 1e-7) and math.isclose(seen[0]["ssm"], 1e-6)  # warmup 1 of 100
    assert all(math.isclose(s["pretrained"], 1e-5) for s in seen[99:])
    assert math.isclose(seen[99]["ssm"], 1e-4) and math.isclose(seen[-1]["ssm"], 1e-5)
    assert math.isclose(seen[2550]["ssm"], 1e-5 + 0.5 * 9e-5, rel_tol=1e-3)  # half way down the cosine


def test_param_groups_follow_the_recipe(tmp_path):
    from tttvideo.models import build_model

    cfg = tiny_config(tmp_path, "model.adapter=qkvo", "train.lr=1e-5", "train.lr_ssm=1e-4")
    model = build_model(cfg)
    opt = build_optimizer(model, cfg.train)
    groups = {g["name"]: g for g in opt.param_groups}
    assert set(groups) == {"pretrained", "pretrained_no_decay", "ssm", "ssm_no_decay"}
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-8
    names = {n: g["name"] for g in opt.param_groups for n in g["param_names"]}
    assert names["blocks.0.attn.to_q.weight"] == "pretrained"
    assert names["blocks.0.attn.to_q.bias"] == "pretrained_no_decay"
    assert names["blocks.0.attn.norm_q.weight"] == "pretrained_no_decay"
    assert names["blocks.0.ttt.ttt.W1"] == "ssm" and names["blocks.0.ttt.forward_gate_video"] == "ssm"
    for leaf in ("b1", "b2", "ttt_norm_weight", "ttt_norm_bias", "post_norm.weight", "learnable_ttt_lr_bias"):
        assert names[f"blocks.0.ttt.ttt.{leaf}"] == "ssm_no_decay", leaf
    assert "blocks.0.mlp.fc1.weight" not in names  # qkvo freezes the MLP
    assert groups["ssm"]["lr"] == 1e-4 and groups["pretrained"]["lr"] == 1e-5
    assert groups["ssm"]["weight_decay"] == 1e-4 and groups["ssm_no_decay"]["weight_decay"] == 0.0
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(names)


def test_batch_plan():
    cfg = load_config(None, ["train.batch_size=2", "train.global_batch=64"])
    assert batch_plan(cfg.train, 1) == (32, 64) and batch_plan(cfg.train, 4) == (8, 64)
    with pytest.raises(ConfigError, match="not a multiple"):
        batch_plan(cfg.train, 3)
    cfg = load_config(None, ["train.batch_size=1", "train.grad_accum=64", "train.global_batch=32"])
    with pytest.raises(ConfigError, match="global_batch 32 != batch_size 1 x grad_accum 64"):
        batch_plan(cfg.train, 1)


def test_loss_inputs(monkeypatch):
    """Timesteps fall in the micro-batch's strata and dropped samples see all-zero text."""
    from tttvideo.diffusion import ZeroSNRSchedule
    from tttvideo.layout import VideoLayout
    from tttvideo.train.loss import NoiseSource, diffusion_loss

    seen = {}

    def fake_model(x, text, t, layout):
        seen.update(text=text.clone(), t=t.clone())
        return torch.zeros_like(x)

    lay = VideoLayout.create(3, 32, 48, text_tokens=2, mini_batch_size=16)
    batch = {"latents": torch.randn(4, 13, 2, 2, 3), "text": torch.ones(4, 1, 2, 5)}
    noise = NoiseSource(0, torch.device("cpu"))
    dropped_any = kept_any = False
    for _ in range(20):
        loss, info = diffusion_loss(fake_model, batch, ZeroSNRSchedule(), noise, lay, 0.5, 4, 8)
        assert torch.equal(info["timesteps"] // 125, torch.arange(4, 8))
        for i, d in enumerate(info["text_dropped"].tolist()):
            assert torch.all(seen["text"][i] == (0.0 if d else 1.0))
            dropped_any |= d
            kept_any |= not d
        assert loss.item() > 0
    assert dropped_any and kept_any


def test_checkpoints_resume_guard_and_init_from(tmp_path):
    cfg = tiny_config(tmp_path, "train.cpu_threads=2")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = Trainer(cfg, quiet=True).run()
        assert torch.get_num_threads() == 1  # train.cpu_threads holds for the run, not for the process after it
    finally:
        torch.set_num_threads(threads)
    assert result.steps_done == 4 and math.isfinite(result.first_loss)
    found = ckpt.list_checkpoints(tmp_path / "run")
    assert [s for s, _ in found] == [2, 4]  # every checkpoint_every = 2 steps
    assert not list((tmp_path / "run/checkpoints").glob(".tmp-*"))
    metrics = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(k in metrics[0] for k in ("loss", "lr", "lr_ssm", "grad_norm", "step_time", "tokens_per_s"))
    # where each step's time went beside the model's forward and backward: parts of step_time, each measured
    for m in metrics:
        parts = [m["data_s"], m["optimizer_s"], m["ema_s"]]
        assert all(p >= 0 for p in parts) and m["optimizer_s"] > 0 and sum(parts) < m["step_time"]
        assert m["ema_s"] == 0.0  # no EMA in this run
    # a stray temporary folder from a killed save is not a checkpoint
    (tmp_path / "run/checkpoints/.tmp-step-000006-1").mkdir()
    assert ckpt.latest_checkpoint(tmp_path / "run") == found[-1][1]

    with pytest.raises(UserError, match="already holds checkpoints .*pass --resume"):
        Trainer(tiny_config(tmp_path, "train.if_exists=refuse"), quiet=True)
    more = tiny_config(tmp_path, "train.steps=6")
    assert Trainer(more, resume=True, quiet=True).run().steps_done == 6
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "run")] == [4, 6]  # pruned to the last 2

    # the next stage starts from this run's weights with a fresh optimizer and step 0
    from tttvideo.models import build_model, load_checkpoint

    stage2 = tiny_config(tmp_path, f"train.output_dir={tmp_path / 'stage2'}", f"train.init_from={tmp_path / 'run'}",
                         "train.steps=1", "train.lr=0", "train.lr_ssm=0")
    Trainer(stage2, quiet=True).run()
    a, b = build_model(stage2), build_model(stage2)
    load_checkpoint(a, tmp_path / "run/checkpoints/step-000006/model.safetensors")
    load_checkpoint(b, tmp_path / "stage2/checkpoints/step-000001/model.safetensors")
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n  # lr 0: the stage-2 weights are exactly the stage-1 ones
    with pytest.raises(UserError, match="init_from"):
        Trainer(tiny_config(tmp_path, f"train.output_dir={tmp_path / 's3'}", f"train.init_from={tmp_path / 'nope'}"),
                quiet=True).run()


def _poison(monkeypatch, bad_steps):
    """Make the loss NaN on the given (1-based) optimizer steps."""
    import tttvideo.train.step as step_mod

    real = step_mod.diffusion_loss
    calls = {"n": 0}

    def loss(*args, **kwargs):
        calls["n"] += 1
        value, info = real(*args, **kwargs)
        return (value * float("nan") if calls["n"] in bad_steps else value), info

    monkeypatch.setattr(step_mod, "diffusion_loss", loss)


def test_nan_stops_naming_step_and_checkpoint(tmp_path, monkeypatch):
    _poison(monkeypatch, {3})
    with pytest.raises(TrainingDiverged, match=r"loss is nan at step 3; the last good checkpoint is .*step-000002"):
        Trainer(tiny_config(tmp_path), quiet=True).run()


def test_nan_skipped_with_a_counter(tmp_path, monkeypatch):
    _poison(monkeypatch, {2, 3})
    cfg = tiny_config(tmp_path, "train.on_nonfinite=skip", "train.max_nonfinite_skips=2")
    result = Trainer(cfg, quiet=True).run()
    assert result.steps_done == 4 and result.nonfinite_skips == 2
    metrics = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [math.isnan(m["loss"]) for m in metrics] == [False, True, True, False]
    monkeypatch.undo()
    _poison(monkeypatch, {1, 2, 3})
    with pytest.raises(TrainingDiverged, match="at step 3 after 2 skipped step"):
        Trainer(tiny_config(tmp_path / "b", "train.on_nonfinite=skip", "train.max_nonfinite_skips=2"),
                quiet=True).run()


def test_validation_videos_and_one_process_only(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path, "train.steps=3", "train.validate_every=2", "sample.steps=2", "train.checkpoint_every=3")
    result = Trainer(cfg, quiet=True).run()
    assert (tmp_path / "run/samples/step-000002.mp4").is_file()  # mid-run validation video
    assert result.video == tmp_path / "run/samples/step-000003.mp4" and result.video.is_file()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="WORLD_SIZE is 2 but .* not set: start multi-process training with torchrun"):
        Trainer(tiny_config(tmp_path / "b"), quiet=True)


def test_overwrite_starts_over(tmp_path):
    Trainer(tiny_config(tmp_path, "train.steps=2"), quiet=True).run()
    cfg = tiny_config(tmp_path, "train.steps=1", "train.if_exists=overwrite")
    assert Trainer(cfg, quiet=True).run().steps_done == 1
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "run")] == [1]
    assert len((tmp_path / "run/metrics.jsonl").read_text().splitlines()) == 1
    assert (tmp_path / "data/manifest.jsonl").is_file()  # the demo set stays


def test_checkpoints_carry_the_longest_trained_duration_across_stages(tmp_path):
    """A 6-s stage started from a 3-s one, then a 3-s stage started from that: every checkpoint's model file says
    the longest video its weights have trained on (what `tttv sample` warns against)."""
    from tttvideo.models.weights import trained_duration

    first = Trainer(tiny_config(tmp_path / "a", "train.steps=1", "train.checkpoint_every=1"), quiet=True).run()
    alone = tmp_path / "alone.safetensors"  # no config.toml beside it: the metadata alone must say it
    alone.write_bytes((first.checkpoints[-1] / ckpt.MODEL_FILE).read_bytes())
    assert trained_duration(alone) == 3
    second = Trainer(tiny_config(tmp_path / "b", "train.steps=1", "train.checkpoint_every=1", "layout.duration=6s",
                                 f"train.init_from={first.output_dir}"), quiet=True).run()
    assert trained_duration(second.checkpoints[-1] / ckpt.MODEL_FILE) == 6
    third = Trainer(tiny_config(tmp_path / "c", "train.steps=1", "train.checkpoint_every=1",
                                f"train.init_from={second.output_dir}"), quiet=True).run()
    assert trained_duration(third.checkpoints[-1] / ckpt.MODEL_FILE) == 6


def test_resume_with_another_global_batch_is_refused(tmp_path):
    """The data order is a function of the global batch: resuming with another one would silently change it."""
    Trainer(tiny_config(tmp_path, "train.steps=2"), quiet=True).run()
    with pytest.raises(UserError, match="global batch of 1, this config has 2; resuming would change the data order"):
        Trainer(tiny_config(tmp_path, "train.steps=4", "train.grad_accum=2"), resume=True, quiet=True).run()


def test_weight_average_follows_its_formula_with_the_warm_up():
    """e <- d e + (1 - d) p after every update, d = min(decay, (1 + n) / (10 + n)), in fp32 from bf16 weights; only
    the trainable parameters are averaged, and swapping the average in and out restores the weights exactly."""
    from tttvideo.train.ema import WeightAverage

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)).to(torch.bfloat16)
    model[1].bias.requires_grad_(False)
    for decay in (0.5, 0.99):
        for p in model.parameters():
            p.data.normal_()
        average = WeightAverage(model, decay)
        expected = {n: p.detach().double() for n, p in model.named_parameters() if p.requires_grad}
        assert set(average.average) == set(expected) and all(t.dtype == torch.float32 for t in average.average.values())
        for n in range(6):
            for p in model.parameters():
                p.data.add_(torch.randn_like(p))
            d = min(decay, (1 + n) / (10 + n))
            assert average.rate() == d
            average.update()
            expected = {k: d * e + (1 - d) * dict(model.named_parameters())[k].detach().double()
                        for k, e in expected.items()}
        for k, e in expected.items():
            torch.testing.assert_close(average.average[k].double(), e, rtol=1e-6, atol=1e-6)
        before = [p.detach().clone() for p in model.parameters()]
        with average.swapped_in():
            assert torch.equal(model[0].weight, average.average["0.weight"].to(torch.bfloat16))
            assert not torch.equal(model[0].weight, before[0])
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_ema_checkpoints_sampling_and_init_from(tmp_path):
    """train.ema_decay: every checkpoint holds ema.safetensors (fp32, the trainable parameters, listed in the
    manifest); the sampler loads it over the model file unless sample.use_ema = false; the next stage starts from it
    (under torchrun: tests/test_parallel_train.py)."""
    from safetensors.torch import load_file

    from tttvideo.models import build_model, load_checkpoint
    from tttvideo.runs import read_manifest
    from tttvideo.sample.model import load_model

    cfg = tiny_config(tmp_path, "train.ema_decay=0.9", "train.steps=3", "train.checkpoint_every=3")
    Trainer(cfg, quiet=True).run()
    folder = tmp_path / "run/checkpoints/step-000003"
    raw, ema = load_file(str(folder / ckpt.MODEL_FILE)), load_file(str(folder / ckpt.EMA_FILE))
    model = build_model(cfg)
    assert set(ema) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(t.dtype == torch.float32 for t in ema.values())
    assert any(not torch.equal(raw[n], ema[n]) for n in ema)
    assert ckpt.EMA_FILE in read_manifest(folder)["files"]
    assert ckpt.load_state(folder)["ema"] == {"updates": 3, "decay": 0.9}
    # each step's EMA update is timed apart from the rest of the step (0.0 without an EMA: the other tests)
    metrics = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert all(0 < m["ema_s"] < m["step_time"] for m in metrics)

    def sampled(*extra):
        with load_model(tiny_config(tmp_path, *extra), folder, torch.device("cpu")) as loaded:
            return {n: p.detach().clone() for n, p in loaded.model.named_parameters()}

    for n, p in sampled().items():
        assert torch.equal(p, ema[n].to(p.dtype)), n
    for n, p in sampled("sample.use_ema=false").items():
        assert torch.equal(p, raw[n]), n

    stage2 = tiny_config(tmp_path, f"train.output_dir={tmp_path / 'stage2'}", f"train.init_from={tmp_path / 'run'}",
                         "train.steps=1", "train.lr=0", "train.lr_ssm=0")
    Trainer(stage2, quiet=True).run()
    b = build_model(stage2)
    load_checkpoint(b, tmp_path / "stage2/checkpoints/step-000001/model.safetensors")
    for n, p in b.named_parameters():
        assert torch.equal(p, ema[n]), n  # lr 0: stage 2 holds stage 1's averaged weights


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def stopped_after_step_2(run: Path, to: Path) -> Path:
    """A copy of a 4-step `run` as if it had stopped after its step-2 checkpoint."""
    shutil.copytree(run, to)
    shutil.rmtree(to / "checkpoints" / "step-000004")
    return to


def test_resume_with_the_other_optimizer_converts_its_state(tmp_path, capsys):
    """A checkpoint of AdamW resumed with train.optimizer = "adamw8bit" goes on with 8-bit moments (they stayed
    AdamW's full ones before, so the memory the switch was for was not saved), and an 8-bit checkpoint resumed with
    AdamW goes on with AdamW's (it stopped with a traceback in AdamW's update); both end near the uninterrupted
    run. A sharded (DCP) checkpoint refuses the change in one sentence (tests/test_parallel_train.py)."""
    pytest.importorskip("torchao.optim")
    for first, then in (("adamw", "adamw8bit"), ("adamw8bit", "adamw")):
        full = tmp_path / first
        Trainer(tiny_config(tmp_path, f"train.output_dir={full}", f"train.optimizer={first}"), quiet=True).run()
        switched = stopped_after_step_2(full, tmp_path / f"{first}-to-{then}")
        trainer = Trainer(tiny_config(tmp_path, f"train.output_dir={switched}", f"train.optimizer={then}"),
                          if_exists="resume")
        trainer.run()
        said = " ".join(capsys.readouterr().out.split())
        assert f"train.optimizer = '{first}'" in said
        assert f'settings other than the run\'s: train.optimizer "{first}" -> "{then}"' in said
        kinds = {type(v).__name__ for state in trainer.optimizer.state.values() for v in state.values()}
        assert ("OptimState8bit" in kinds) == (then == "adamw8bit"), kinds
        assert losses(switched) == pytest.approx(losses(full), rel=1e-3)


def test_resume_with_another_adapter_is_one_sentence_and_another_lr_takes_effect(tmp_path, caplog, capsys):
    """--resume with another model.adapter (other trainable parameters) stopped with a ValueError traceback in
    Optimizer.load_state_dict: now one sentence. With another train.lr the checkpoint's optimizer groups and scheduler
    carried the old peak, which replaced the new one without a word: now the schedule goes on with this config's
    peaks and a warning names the change (a sharded checkpoint: tests/test_parallel_train.py)."""
    import logging

    full = tmp_path / "full"
    Trainer(tiny_config(tmp_path, f"train.output_dir={full}"), quiet=True).run()

    def resumed(name: str, *extra: str) -> Path:
        out = stopped_after_step_2(full, tmp_path / name)
        Trainer(tiny_config(tmp_path, f"train.output_dir={out}", *extra), if_exists="resume").run()
        return out

    with pytest.raises(UserError, match=r"holds the optimizer state of \d+ trained tensors, this config trains \d+: "
                                        r"resume with the model settings .*model.adapter.*train.init_from"):
        resumed("qkvo", "model.adapter=qkvo")

    capsys.readouterr()
    with caplog.at_level(logging.WARNING, logger="tttvideo"):
        faster = resumed("faster", "train.lr=1e-2")
    assert "other learning-rate peaks (train.lr 0.005 -> 0.01): from step 3 on" in caplog.text
    assert losses(faster)[:3] == losses(full)[:3] and losses(faster)[3] != pytest.approx(losses(full)[3], rel=1e-3)
    # the resume names every setting that differs from the checkpoint's (its folder moved: not one of them)
    assert "settings other than the run's: train.lr 0.005 -> 0.01 " in " ".join(capsys.readouterr().out.split())
    assert losses(resumed("same")) == losses(full)  # unchanged: the exact resume, and nothing named
    assert "settings other than" not in capsys.readouterr().out


def test_other_trained_parameters_of_the_same_count_are_refused(tmp_path):
    """The check compares what it is given (a sharded checkpoint's parameter names, a one-process one's group
    sizes), not only their number: as many tensors, other ones, is one sentence too (it was let through to DCP's
    'Missing key' traceback)."""
    from tttvideo.train.dcp import check_trained_parameters

    check_trained_parameters(tmp_path, ["a.weight", "b.weight"], ["a.weight", "b.weight"])
    with pytest.raises(UserError, match=r"holds the optimizer state of 2 trained tensors, this config trains 2 other "
                                        r"ones: resume with the model settings"):
        check_trained_parameters(tmp_path, ["a.weight", "b.weight"], ["a.weight", "c.weight"])
    with pytest.raises(UserError, match=r"of 3 trained tensors, this config trains 3 other ones"):
        check_trained_parameters(tmp_path, [2, 1], [1, 2])


def test_a_slow_loader_shows_as_the_steps_data_time(tmp_path, monkeypatch):
    """metrics.jsonl's data_s is the step's wait for its batches: a loader that takes 0.3 s a batch shows there,
    and not in optimizer_s."""
    import time

    import tttvideo.train.trainer as trainer_module

    make_loader = trainer_module.make_loader

    def slow(*args, **kwargs):
        for batch in make_loader(*args, **kwargs):
            time.sleep(0.3)
            yield batch

    monkeypatch.setattr(trainer_module, "make_loader", slow)
    Trainer(tiny_config(tmp_path, "train.steps=2", "train.checkpoint_every=2"), quiet=True).run()
    metrics = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert all(0.3 <= m["data_s"] < m["step_time"] and m["optimizer_s"] < 0.3 for m in metrics)
