"""The memory planner on the tiny model: what it counts equals the built model's tensors, the optimizer's real state
and the streamed weights; predictions grow with the tokens; a setup that fits nowhere is reported as such; the plan
it writes is a config the trainer reads; `tttv plan` end to end."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tttvideo.config.loader import load_config
from tttvideo.config.schema import Config
from tttvideo.layout import VideoLayout
from tttvideo.memory.plan.costs import CostTable, Curve, activation_key, load_costs, save_costs, time_key
from tttvideo.memory.plan.count import count
from tttvideo.memory.plan.planner import (CUDA_CONTEXT, FRAGMENTATION, GIB, best, candidates, fits_in, parse_size, plan,
                                    plan_toml, predict)
from tttvideo.models import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(adapter: str = "lora", frozen: str = "fp8", optimizer: str = "adamw8bit", dtype: str = "bf16") -> Config:
    cfg = Config()
    cfg.model.adapter, cfg.model.frozen_weights, cfg.model.dtype = adapter, frozen, dtype
    cfg.model.lora_rank = 4
    cfg.train.optimizer = optimizer
    cfg.ttt.mini_batch_size = 16
    cfg.layout.height, cfg.layout.width, cfg.layout.text_tokens = 32, 48, 8
    return cfg


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def state_bytes(optimizer) -> int:
    """Both moments of every parameter as they sit in memory (8-bit codes and scales, or plain tensors)."""
    total = 0
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            t = state[key]
            if hasattr(t, "codes"):
                total += tensor_bytes([t.codes, t.scale])
            else:
                total += tensor_bytes([t])
    return total


@pytest.mark.parametrize("adapter,frozen,optimizer,dtype", [
    ("lora", "fp8", "adamw8bit", "bf16"),
    ("qkvo", "dtype", "adamw", "fp32"),
    ("sft", "dtype", "adamw", "bf16"),
])
def test_counted_parts_equal_the_built_model_and_its_optimizer(adapter, frozen, optimizer, dtype):
    if optimizer == "adamw8bit":
        pytest.importorskip("torchao")
    from tttvideo.train.optim import build_optimizer

    cfg = tiny(adapter, frozen, optimizer, dtype)
    counted = count(cfg, "train")
    torch.manual_seed(0)
    model = build_model(cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert counted.weights == tensor_bytes(model.parameters()) + tensor_bytes(model.buffers())
    assert counted.gradients == tensor_bytes(trainable)
    assert counted.trainable_params == sum(p.numel() for p in trainable)
    opt = build_optimizer(model, cfg.train)
    for p in trainable:
        p.grad = torch.randn_like(p)
    opt.step()
    assert counted.optimizer == state_bytes(opt)


def test_streamed_sampling_counts_only_the_blocks_in_flight():
    cfg = tiny()
    resident = count(cfg, "sample")
    cfg.sample.offload_blocks, cfg.sample.prefetch_blocks = True, 1
    streamed = count(cfg, "sample")
    model = build_model(cfg)
    layers = len(model.blocks)
    block = tensor_bytes(model.blocks[0].parameters()) + tensor_bytes(model.blocks[0].buffers())
    assert resident.weights == tensor_bytes(model.parameters()) + tensor_bytes(model.buffers())
    assert streamed.weights == resident.weights - (layers - 2) * block
    assert resident.gradients == resident.optimizer == 0


def test_fsdp_shards_the_counted_parts():
    cfg = tiny()
    cfg.parallel.sp, cfg.parallel.dp_shard = 1, -1
    one, four = count(cfg, "train", 1), count(cfg, "train", 4)
    assert four.gradients == one.gradients // 4 and four.optimizer == one.optimizer // 4
    model = build_model(cfg)
    buffers = tensor_bytes(model.buffers())
    assert buffers > 0  # fp8 codes: FSDP2 does not shard buffers
    assert four.weights == (one.weights - buffers) // 4 + buffers + 2 * one.block_weights
    # the sp ranks are in the FSDP mesh too (parallel.mesh): sp 2 x dp_shard 2 shards over all four, and HSDP's
    # replicas each hold a sharded copy
    cfg.parallel.sp, cfg.parallel.dp_shard = 2, 2
    assert count(cfg, "train", 4) == four
    cfg.parallel.sp, cfg.parallel.dp_shard, cfg.parallel.dp_replicate = 2, 1, 2
    two = count(cfg, "train", 4)
    assert two.optimizer == one.optimizer // 2 and two.gradients == one.gradients // 2


def test_ema_copy_is_counted_as_the_trainer_keeps_it():
    """train.ema_decay > 0: the fp32 average of every trainable parameter (what tttvideo.train.ema holds) is counted
    in the weights, for training only."""
    from tttvideo.train.ema import WeightAverage

    cfg = tiny("qkvo", "dtype", "adamw", "bf16")
    off = count(cfg, "train")
    cfg.train.ema_decay = 0.99
    on = count(cfg, "train")
    average = WeightAverage(build_model(cfg), 0.99)
    assert on.ema == average.nbytes() == 4 * off.trainable_params > 0
    assert on.weights == off.weights + on.ema and on.total == off.total + on.ema and off.ema == 0
    assert count(cfg, "sample") == count(tiny("qkvo", "dtype", "adamw", "bf16"), "sample")


def synthetic_costs(cfg: Config, phase: str) -> CostTable:
    """A cost for every regime the planner proposes: 1 KiB and 1 ms per token, more without offload."""
    table = CostTable("test")
    for cand in candidates(cfg, phase):
        c = cand.apply(cfg)
        per_token = 2048.0 if phase == "train" and not c.checkpointing.offload_activations else 1024.0
        table.activation[activation_key(c, phase)] = Curve.fit([(t, per_token * t + 1e6) for t in (1e3, 1e5)])
        seconds = 1e-3 * (1.5 if c.checkpointing.offload_activations else 1.0)
        table.time[time_key(c, phase)] = Curve.fit([(t, seconds * t + 0.1) for t in (1e3, 1e5)])
    return table


@pytest.mark.parametrize("phase", ["train", "sample"])
def test_predictions_grow_with_the_tokens(phase):
    cfg = tiny()
    costs = synthetic_costs(cfg, phase)
    previous = None
    for duration in ("3s", "6s", "9s", "18s"):
        cfg.layout.duration = duration
        preds = [predict(cfg, phase, c, costs) for c in candidates(cfg, phase)]
        peaks = [p.peak for p in preds]
        times = [p.step_s for p in preds]
        if previous is not None:
            assert all(a > b for a, b in zip(peaks, previous[0]))
            assert all(a > b for a, b in zip(times, previous[1]))
        previous = (peaks, times)


def test_fastest_fitting_candidate_is_chosen_and_nothing_fits_a_tiny_card():
    cfg = tiny()
    costs = synthetic_costs(cfg, "train")
    preds = plan(cfg, "train", 80 * GIB, costs)
    chosen = best(preds)
    assert chosen is not None and all(p.fits for p in preds)
    assert chosen.step_s == min(p.step_s for p in preds)
    # as fast (weight storage and optimizer share a time regime), so the exact setup is taken over fp8 / 8-bit
    assert chosen.config.model.frozen_weights == "dtype" and chosen.config.train.optimizer == "adamw"
    assert any(p.step_s == chosen.step_s and p.config.model.frozen_weights == "fp8" for p in preds)
    none = plan(cfg, "train", 2**20, costs)
    assert best(none) is None and all(p.fits is False for p in none)
    # a regime nobody measured is listed, with no prediction, and never chosen
    empty = plan(cfg, "train", 80 * GIB, CostTable("empty"))
    assert best(empty) is None and all(p.fits is None and p.peak is None for p in empty)
    assert all("not measured" in "; ".join(p.notes) for p in empty)


def test_kept_outputs_are_chosen_where_they_fit_and_block_checkpointing_where_they_do_not(tmp_path):
    """The selective regimes cost more memory per token and less time: a large card takes the one that keeps the
    most, a smaller one the one that keeps attention only, a smaller still plain block checkpointing; the chosen
    switches round-trip through the written plan file."""
    cfg = tiny()
    table = CostTable("test")
    # per token: bytes far above what the weight storage and optimizer switches change, seconds
    per_token = {"block": (1e6, 1.0), "block-keep-attention": (2e6, 0.9), "block-keep-attention+matmul": (8e6, 0.8)}
    for cand in candidates(cfg, "train"):
        c = cand.apply(cfg)
        key = activation_key(c, "train")
        policy = key.split("|")[4]
        if policy in per_token and not c.checkpointing.offload_activations:
            mem, sec = per_token[policy]
            table.activation[key] = Curve.fit([(1.0, mem)])
            table.time[time_key(c, "train")] = Curve.fit([(1.0, 1e-3 * sec)])
    tokens = VideoLayout.from_config(cfg.layout, cfg.ttt).total_tokens
    assert not any(c.apply(cfg).checkpointing.offload_activations and c.apply(cfg).checkpointing.keep
                   for c in candidates(cfg, "train"))
    exact = copy.deepcopy(cfg)
    exact.model.frozen_weights = "dtype"
    base = count(exact, "train").total

    def chosen_keep(activation_room: float) -> list[str]:
        card = int((base + activation_room * tokens) * (1 + FRAGMENTATION)) + CUDA_CONTEXT + 2**20
        return best(plan(cfg, "train", card, table, margin=0.0)).config.checkpointing.keep

    assert chosen_keep(9e6) == ["attention", "matmul"]
    assert chosen_keep(4e6) == ["attention"]
    assert chosen_keep(1.5e6) == []
    pred = best(plan(cfg, "train", 10**12, table))
    path = tmp_path / "plan.toml"
    path.write_text(plan_toml(pred, None, path, "test"))
    assert load_config(path).checkpointing.keep == ["attention", "matmul"]


def test_fit_margin_and_sizes():
    assert fits_in(10 * GIB, 24 * GIB) and not fits_in(23 * GIB, 24 * GIB)
    # streamed weights get the wider margin: 21.96 GiB predicted ran out of memory under a 24 GiB card's cap
    assert fits_in(int(21.96 * GIB), 24 * GIB) and not fits_in(int(21.96 * GIB), 24 * GIB, streamed=True)
    assert parse_size("24GiB") == parse_size("24 GiB") == parse_size("24") == 24 * GIB
    assert parse_size("80GB") == 80 * 10**9
    from tttvideo.errors import UserError

    with pytest.raises(UserError, match="--gpu-mem"):
        parse_size("lots")


def test_curve_interpolates_the_measured_points():
    curve = Curve.fit([(300, 3000.0), (100, 1000.0), (200, 2500.0), (100, 1200.0)])
    assert curve.points == ((100.0, 1100.0), (200.0, 2500.0), (300.0, 3000.0))  # sorted, repeats averaged
    assert curve(200) == pytest.approx(2500.0) and curve(150) == pytest.approx(1800.0)
    assert curve(400) == pytest.approx(3500.0) and curve(50) == pytest.approx(400.0)  # the end segments, extended
    assert Curve.fit([(100, 500.0)])(300) == pytest.approx(1500.0)
    with pytest.raises(ValueError):
        Curve.fit([])


def test_plan_file_is_a_config_that_includes_the_base(tmp_path):
    base = tmp_path / "base.toml"
    base.write_text('[model]\nadapter = "lora"\nlora_rank = 4\n[ttt]\nmini_batch_size = 16\n'
                    '[layout]\nheight = 32\nwidth = 48\ntext_tokens = 8\n')
    cfg = load_config(base)
    costs = synthetic_costs(cfg, "train")
    chosen = best(plan(cfg, "train", 80 * GIB, costs))
    out = tmp_path / "plans" / "plan.toml"
    out.parent.mkdir()
    out.write_text(plan_toml(chosen, base, out, "tttv plan base.toml --gpu-mem 80GiB", {"layout.duration": "9s"}))
    loaded = load_config(out)
    assert loaded.model.lora_rank == 4 and loaded.layout.duration == "9s"
    for key, value in chosen.candidate.settings(chosen.config).items():
        section, name = key.split(".")
        assert getattr(getattr(loaded, section), name) == value


def test_plan_command_end_to_end(tmp_path, capsys):
    from tttvideo.cli import main

    cfg = tiny()
    costs_file = tmp_path / "costs.json"
    table = synthetic_costs(cfg, "sample")
    table.gpu = "testgpu"
    save_costs(table, costs_file)
    assert load_costs("testgpu", costs_file).activation == table.activation
    config = tmp_path / "tiny.toml"
    config.write_text('[model]\nadapter = "lora"\nlora_rank = 4\nfrozen_weights = "fp8"\ndtype = "bf16"\n'
                      '[train]\noptimizer = "adamw8bit"\n[ttt]\nmini_batch_size = 16\n'
                      '[layout]\nheight = 32\nwidth = 48\ntext_tokens = 8\n')
    out = tmp_path / "plan.toml"
    code = main(["plan", str(config), "--gpu-mem", "24GiB", "--phase", "sample", "--gpu-kind", "testgpu",
                 "--costs", str(costs_file), "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and "sample plan" in printed and out.is_file()
    assert load_config(out).model.lora_rank == 4
    code = main(["plan", str(config), "--gpu-mem", "1MiB", "--phase", "sample", "--gpu-kind", "testgpu",
                 "--costs", str(costs_file)])
    assert code == 1 and "nothing measured fits" in capsys.readouterr().err


def test_unknown_gpu_kind_is_one_sentence(tmp_path):
    from tttvideo.errors import UserError

    (tmp_path / "c.json").write_text(json.dumps({}))
    with pytest.raises(UserError, match="no measured costs for GPU kind 'a100'"):
        load_costs("a100", tmp_path / "c.json")


def test_auto_fit_without_a_gpu_is_one_sentence(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this checks the CPU-only message")
    from tttvideo.cli import main

    code = main(["train", "configs/demo.toml", "--auto-fit", "--set", f"train.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "--auto-fit plans for a CUDA GPU" in err and "Traceback" not in err


def test_streamed_fp8_weights_leave_two_blocks_counted():
    from tttvideo.models.fp8_storage import Fp8Linear

    cfg = tiny()
    resident = count(cfg, "train")
    cfg.memory.stream_frozen_weights = True
    streamed = count(cfg, "train")
    model = build_model(cfg)
    fp8 = tensor_bytes(t for m in model.modules() if isinstance(m, Fp8Linear) for t in (m.weight_fp8, m.weight_scale))
    block_fp8 = tensor_bytes(t for m in model.blocks[0].modules() if isinstance(m, Fp8Linear)
                             for t in (m.weight_fp8, m.weight_scale))
    assert fp8 > 0 and streamed.weights == resident.weights - fp8 + 2 * block_fp8
    assert any(c.apply(tiny()).memory.stream_frozen_weights for c in candidates(tiny(), "train"))


def test_streaming_needs_fp8_weights(tmp_path, capsys):
    from tttvideo.cli import main

    code = main(["train", "configs/demo.toml", "--set", "memory.stream_frozen_weights=true",
                 "--set", f"train.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "memory.stream_frozen_weights streams the fp8-stored frozen weights" in err


@pytest.mark.parametrize("layer", ["mamba2", "gated-deltanet", "full-attention", "none"])
def test_another_long_range_layer_is_counted_exactly_and_never_given_ttts_costs(layer):
    """The counted part follows the layer actually built; the measured costs are the TTT-MLP model's, so another
    layer's regimes are its own: listed as not measured, never chosen."""
    cfg = tiny("lora", "dtype", "adamw", "fp32")
    cfg.model.sequence_layer = layer
    model = build_model(cfg)
    assert count(cfg, "train").weights == tensor_bytes(model.parameters()) + tensor_bytes(model.buffers())
    base = tiny("lora", "dtype", "adamw", "fp32")
    assert activation_key(cfg, "train") != activation_key(base, "train")
    assert activation_key(cfg, "sample") == activation_key(base, "sample") + f"|{layer}"
    costs = CostTable("x", activation={activation_key(base, "train"): Curve([(1, 1.0)])},
                      time={time_key(base, "train"): Curve([(1, 1.0)])})
    preds = plan(cfg, "train", 80 * GIB, costs)
    assert best(preds) is None and all("not measured" in "; ".join(p.notes) for p in preds)


def test_several_gpus_sample_with_the_guidance_split_where_it_is_faster():
    """Two GPUs: sp 2 at sampling's measured efficiency (0.724, not training's), or the two guided passes on one GPU
    each (1.64x a batch-2 forward, measured); the split is faster and is chosen. Four GPUs on the tiny model's 2
    heads: only the split over two sp-2 groups."""
    cfg = tiny()
    costs = synthetic_costs(cfg, "sample")
    costs.sp_efficiency = {2: 0.9}  # training's: not what sampling is counted with
    preds = plan(cfg, "sample", 80 * GIB, costs, gpus=2)
    layouts = {(p.config.parallel.sp, p.config.sample.split_guidance) for p in preds}
    assert layouts == {(2, False), (1, True)}
    one = predict(cfg, "sample", candidates(cfg, "sample")[0], costs).step_s
    by_layout = {(p.config.parallel.sp, p.config.sample.split_guidance): p.step_s for p in preds}
    assert by_layout[(1, True)] == pytest.approx(one / 1.64)
    assert by_layout[(2, False)] == pytest.approx(one / (2 * 0.724))
    # memory, measured at 63 s: one pass a rank holds half the batch-2 forward's activations, sp = 2 0.73 of them
    one_gpu = predict(cfg, "sample", candidates(cfg, "sample")[0], costs).activation
    activations = {(p.config.parallel.sp, p.config.sample.split_guidance): p.activation for p in preds}
    assert activations[(1, True)] == pytest.approx(one_gpu * 0.5, abs=1)
    assert activations[(2, False)] == pytest.approx(one_gpu * 0.73, abs=1)
    chosen = best(preds)
    assert chosen.config.sample.split_guidance and chosen.config.parallel.sp == 1
    four = plan(cfg, "sample", 80 * GIB, costs, gpus=4)
    assert {(p.config.parallel.sp, p.config.sample.split_guidance) for p in four} == {(2, True)}
    assert best(four).step_s == pytest.approx(one / (1.64 * 2 * 0.724))


def test_sample_plans_count_the_dtype_the_sampler_builds_on_a_gpu():
    """A run's config keeps fp32 master weights; `sample.dtype = "auto"` samples them in bf16 on a GPU, so the
    sample plan counts bf16 weights and reads the bf16 regime's costs, unless sample.dtype asks for fp32."""
    fp32 = tiny(dtype="fp32")
    costs = synthetic_costs(tiny(dtype="bf16"), "sample")
    auto = [predict(fp32, "sample", c, costs) for c in candidates(fp32, "sample")]
    bf16 = [predict(tiny(dtype="bf16"), "sample", c, costs) for c in candidates(fp32, "sample")]
    assert [p.peak for p in auto] == [p.peak for p in bf16] and all(p.peak is not None for p in auto)
    asked = copy.deepcopy(fp32)
    asked.sample.dtype = "fp32"
    kept = [predict(asked, "sample", c, costs) for c in candidates(asked, "sample")]
    assert all(p.peak is None for p in kept)  # the fp32 regime was never measured
    assert count(asked, "sample").total > count(tiny(dtype="bf16"), "sample").total


def test_chunked_sampling_is_held_at_its_floor_below_the_measured_lengths():
    """The 12 GB sample config at 3 s: the chunked curve's line (measured at 9 and 63 s) falls under the phase
    outside the TTT scan, so the prediction is the floor (two streams + the measured fixed part, costs.py), which is
    at or above the 3-s run's measured activation (2.14 GiB allocated with 4 head groups, plan_calibration_h100.json);
    at 63 s the curve is above the floor and stays the prediction."""
    from pathlib import Path

    from tttvideo.memory.plan.costs import chunked_floor_streams
    from tttvideo.memory.plan.planner import Candidate

    costs = load_costs("h100")
    config = Path(__file__).resolve().parents[1] / "configs/cogvideox-5b/12gb-sample-63s.toml"
    short = load_config(config, ["model.pretrained_path=", "train.init_from=", "layout.duration=3s",
                                 "memory.ttt_head_groups=4"])
    p = predict(short, "sample", Candidate("as configured", ()), costs)
    key = activation_key(p.config, "sample")
    assert p.basis.startswith("counted floor") and any("outside the TTT scan" in n for n in p.notes)
    assert p.activation == int(chunked_floor_streams(p.config) + costs.floors[key])
    assert p.activation > costs.activation[key](VideoLayout.from_config(short.layout, short.ttt).total_tokens)
    assert p.peak >= 2.14 * GIB
    long = load_config(config, ["model.pretrained_path=", "train.init_from=", "memory.ttt_head_groups=4"])
    q = predict(long, "sample", Candidate("as configured", ()), costs)
    assert not q.basis.startswith("counted floor") and q.activation > int(chunked_floor_streams(q.config)
                                                                          + costs.floors[key])


def test_a_measured_reserve_curve_sets_the_reserve_never_below_the_default_share():
    """A regime's reserve above its peak is its measured curve at the setup's tokens (the gaps grow with the tokens,
    not with the weights), and never less than FRAGMENTATION of the peak: a curve extrapolated below it (or none)
    gives the default share."""
    cfg = tiny()
    costs = synthetic_costs(cfg, "sample")
    cand = candidates(cfg, "sample")[0]
    key = activation_key(cand.apply(cfg), "sample")
    default = predict(cfg, "sample", cand, costs)
    assert default.reserved == default.peak + int(default.peak * FRAGMENTATION)
    tokens = VideoLayout.from_config(cand.apply(cfg).layout, cand.apply(cfg).ttt).total_tokens
    costs.reserve[key] = Curve.fit([(1.0, 1.0), (tokens, 0.5 * default.peak)])
    assert predict(cfg, "sample", cand, costs).reserved == default.peak + int(0.5 * default.peak)
    costs.reserve[key] = Curve.fit([(1.0, 1.0), (2.0, 2.0)])  # a few bytes at these tokens: the default share
    assert predict(cfg, "sample", cand, costs).reserved == default.reserved


def test_nothing_fits_says_the_longest_video_and_the_adapter_that_would():
    """When nothing fits, `tttv plan` says the longest shorter video that fits (found by halving the segments) and,
    for training another adapter, what LoRA fits: at this length, or the longest LoRA video."""
    from types import SimpleNamespace

    from tttvideo.cli.plan_cmd import what_fits_instead
    from tttvideo.layout import parse_duration

    cfg = tiny()
    cfg.layout.duration = "63s"
    cfg.model.adapter = "qkvo"
    asked = []

    def fit_up_to(qkvo_s, lora_s):
        def fit(c):
            asked.append((c.model.adapter, c.layout.duration))
            limit = lora_s if c.model.adapter == "lora" else qkvo_s
            chosen = SimpleNamespace(candidate=SimpleNamespace(label="ckpt sub-block"), reserved=20 * GIB)
            return chosen if parse_duration(c.layout.duration) <= limit else None
        return fit

    said = what_fits_instead(cfg, "train", fit_up_to(12, 30))
    assert said == ("the longest video that fits is 12 s (--duration 12s); with a LoRA adapter (--set "
                    "model.adapter=lora) a video of 30 s fits; use more GPUs (--gpus) or a larger card")
    assert len(asked) <= 2 * 5 + 1  # halving 21 segments: at most 5 plans a search
    said = what_fits_instead(cfg, "train", fit_up_to(0, 63))
    assert said == ("a LoRA adapter fits this video (--set model.adapter=lora: ckpt sub-block, 20.0 GiB reserved); "
                    "use more GPUs (--gpus) or a larger card")
    assert what_fits_instead(cfg, "sample", fit_up_to(0, 63)) == "use more GPUs (--gpus) or a larger card"
