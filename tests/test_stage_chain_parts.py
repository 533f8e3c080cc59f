"""benchmarks/stage_chain.py's parts that decide what a run records: the weights folder it makes whatever stage comes
first, the sentence it keeps from a failed launch, and the merging of a chain run in parts into one results file."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import stage_chain

import stage_chain_stages  # noqa: E402  (benchmarks/ is on sys.path once stage_chain is imported)


def test_weights_folder_holds_every_layer_when_the_first_stage_stores_fp8(tmp_path):
    # the one-GPU 63-s config stores the frozen weights as fp8 codes: a folder written from that model lacked the
    # frozen layers (norm1.linear, ff, the time embedding, ...), which `tttv train` refused on loading
    from tttvideo.models.weights import INDEX_NAME

    args = stage_chain.parse_args(["--workdir", str(tmp_path), "--preset", "tiny", "--device", "cpu",
                                   "--durations", "63"])
    folder = stage_chain.make_weights(args, tmp_path) / "transformer"
    names = set(json.loads((folder / INDEX_NAME).read_text())["weight_map"])
    assert "transformer_blocks.0.norm1.linear.weight" in names and "time_embedding.linear_1.weight" in names
    assert "transformer_blocks.0.ff.net.0.proj.weight" in names


def test_weights_folder_is_made_for_a_chain_run_with_fp8_matrix_products(tmp_path):
    # `--set model.fp8_matmul=true` (with fp8 storage) reached the folder's plain model, which refused fp8 products
    # without fp8 storage: the two-GPU 63-s part with fp8 products stopped before any stage
    args = stage_chain.parse_args(["--workdir", str(tmp_path), "--preset", "tiny", "--device", "cpu",
                                   "--durations", "3", "--set", "model.frozen_weights=fp8",
                                   "--set", "model.fp8_matmul=true"])
    folder = stage_chain.make_weights(args, tmp_path) / "transformer"
    assert (folder / "config.json").is_file()


def test_fp8_stored_model_is_not_written_as_a_diffusers_folder(tmp_path):
    from tttvideo.config.loader import load_config
    from tttvideo.models import build_model
    from tttvideo.models.cogvideox.weights import save_diffusers_folder

    cfg = load_config(stage_chain.stage_config(63), ["model.preset=tiny"])
    cfg.model.pretrained_path = ""
    assert cfg.model.frozen_weights == "fp8"
    with pytest.raises(ValueError, match="frozen_weights = 'dtype'"):
        save_diffusers_folder(build_model(cfg, torch.device("cpu")), tmp_path / "transformer")
    assert not (tmp_path / "transformer").exists()


def test_failure_keeps_tttvs_sentences_not_torchruns_rules(tmp_path):
    log = tmp_path / "stage.log"
    log.write_text("W1127 warning\ntttv train: error on rank 1: /w does not fit the model\nTraceback (most recent)\n"
                   "ChildFailedError:\n============================================================\n")
    assert stage_chain.failure(log) == ["tttv train: error on rank 1: /w does not fit the model"]
    log.write_text("tttv train: warning: took over a stale lock\n[rank0]:   File x.py\n[rank0]: safetensors."
                   "_safetensors_rust.SafetensorError: Error while serializing: I/O error\n"
                   "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n=====\n")
    assert stage_chain.failure(log) == ["[rank0]: safetensors._safetensors_rust.SafetensorError: Error while "
                                        "serializing: I/O error"]
    log.write_text("something broke\n------\n=====\n")
    assert stage_chain.failure(log) == ["something broke"]
    assert stage_chain.failure(tmp_path / "none.log") == ["no log"]


def test_a_chain_run_in_parts_merges_into_one_file(tmp_path):
    out = tmp_path / "chain.json"
    head = {"benchmark": "stage_chain", "device": "NVIDIA H200", "gpus": 2, "preset": "cogvideox-5b"}
    first = {**head, "git_commit": "aaa", "overrides": [],
             "stages": [{"duration_s": 3, "median_step_s": 8.0}, {"duration_s": 63, "error": ["out of memory"]}],
             "samples": []}
    out.write_text(json.dumps(first))
    second = {**head, "git_commit": "bbb", "overrides": ["x=1"],
              "stages": [{"duration_s": 63, "median_step_s": 131.7, "git_commit": "bbb"}],
              "samples": [{"duration_s": 63, "layout": "1", "git_commit": "bbb"}]}
    merged = stage_chain.merged(out, second)
    assert [(r["duration_s"], r["git_commit"]) for r in merged["stages"]] == [(3, "aaa"), (63, "bbb")]
    assert merged["stages"][0]["overrides"] == [] and merged["git_commit"] == "bbb"
    assert merged["samples"] == second["samples"]
    # another config at a length already held (e.g. --configs '{stage}-{gpus}gpu-141gb.toml') is a row beside it
    out.write_text(json.dumps({**head, "git_commit": "ccc", "overrides": [], "samples": [], "stages": [
        {"duration_s": 63, "config": "stage5-63s-2gpu.toml", "median_step_s": 131.7}]}))
    third = {**head, "git_commit": "ddd", "overrides": [], "samples": [], "stages": [
        {"duration_s": 63, "config": "stage5-63s-2gpu-141gb.toml", "median_step_s": 113.0}]}
    assert [r["config"] for r in stage_chain.merged(out, third)["stages"]] == [
        "stage5-63s-2gpu-141gb.toml", "stage5-63s-2gpu.toml"]
    rerun = {**third, "stages": [{**third["stages"][0], "config": "stage5-63s-2gpu.toml"}]}
    assert [r["median_step_s"] for r in stage_chain.merged(out, rerun)["stages"]] == [113.0]
    # another machine's file is replaced, not merged
    other = {**second, "device": "NVIDIA H100 80GB HBM3"}
    assert stage_chain.merged(out, other)["stages"] == second["stages"]


def test_steady_step_time_leaves_out_the_first_step_of_every_launch(tmp_path):
    """A launch's first step compiles (87 s against 8 s at 3 s on two H200s). A stage killed after its step-1
    checkpoint and resumed there has two first steps, 1 and 2: with --last-steps 2 no steady step is left (the two-GPU
    3-s row recorded its resumed launch's first step, 25.5 s, as its step time)."""
    metrics = [{"step": s, "step_time": t} for s, t in ((1, 87.0), (2, 25.5), (3, 8.0))]
    log = tmp_path / "resume.log"
    log.write_text("resumed from /tmp/x/checkpoints/step-000001 at step 1 (data position 2)\n")
    assert [m["step"] for m in stage_chain.steady_steps(metrics, log)] == [3]
    assert stage_chain.steady_steps(metrics[:2], log) == []
    assert [m["step"] for m in stage_chain.steady_steps(metrics, None)] == [2, 3]
    steps = [{**m, "memory_gib": 20.0, "loss": 1.0} for m in metrics[:2]]
    by_role = {"rank 0": {"peak_gib": 30.0, "resident_max_gib": 29.0, "at_s": 12.0}}
    launch = type("Launch", (), {"host_peak": 30.0, "gpu_peak": [21.0], "host_by_role": by_role})()
    row = stage_chain.stage_row(steps, stage_chain.steady_steps(steps, log), [launch])
    assert row["median_step_s"] is None and row["first_step_s"] == 87.0
    assert row["host_by_process"] == [by_role]


def test_sample_layouts_combine_sp_and_split_guidance_on_four_gpus():
    layouts = {name: (gpus, sets) for name, gpus, sets in stage_chain.sample_layouts(4, 48)}
    assert set(layouts) == {"1", "sp4", "cfg2", "sp2cfg2"}
    assert layouts["sp2cfg2"] == (4, ["parallel.sp=2", "sample.split_guidance=true"])
    assert [name for name, _, _ in stage_chain.sample_layouts(2, 48)] == ["1", "sp2", "cfg2"]
    assert [name for name, _, _ in stage_chain.sample_layouts(1, 48)] == ["1"]


def test_a_failed_nvidia_smi_reading_keeps_the_gpus_peak():
    # the four-GPU 63-s run recorded 4 MiB per GPU (the idle GPUs after the launch) where the ranks had held ~60 GiB:
    # one empty reading (nvidia-smi timing out on the loaded host) replaced the peak
    from benchmarks.launch_watch import higher_of

    peak = higher_of([], [0.1, 0.1])
    peak = higher_of(peak, [60.0, 58.0])
    peak = higher_of(peak, [])
    assert higher_of(peak, [0.1, 0.1]) == [60.0, 58.0]


def test_several_config_patterns_take_the_first_file_that_exists():
    # the fastest 80-GB chain: whole blocks where a stage ships them (3-30 s), every sub-module at 63 s
    args = stage_chain.parse_args(["--workdir", "/tmp/x", "--configs",
                                   "configs/cogvideox-5b/{stage}-{gpus}gpu-wholeblock.toml",
                                   "configs/cogvideox-5b/{stage}-{gpus}gpu.toml", "--durations", "3", "63"])
    assert [stage_chain.stage_config(d, 1, args.configs).name for d in args.durations] == [
        "stage1-3s-1gpu-wholeblock.toml", "stage5-63s-1gpu.toml"]
    assert stage_chain.stage_config(63, 2, ["configs/cogvideox-5b/{stage}-{gpus}gpu-141gb.toml",
                                            "configs/cogvideox-5b/{stage}-{gpus}gpu.toml"]).name == \
        "stage5-63s-2gpu-141gb.toml"
    # no file of any pattern: the first, so that loading it names what is missing
    missing = stage_chain.stage_config(63, 1, ["configs/cogvideox-5b/{stage}-{gpus}gpu-wholeblock.toml"])
    assert missing.name == "stage5-63s-1gpu-wholeblock.toml" and not missing.exists()


def test_cap_at_plan_runs_the_stage_under_its_predicted_reserve(tmp_path, monkeypatch):
    """--cap-at-plan: each stage's launches get memory.max_gpu_gib = the predicted reserved peak x (1 + margin); a
    stage with no prediction stops the chain with a sentence, and a cap of the user's own is refused."""
    launched = []

    class Launch:  # a launch that fails at once: run_stage records it and returns
        def __init__(self, cmd, log, cwd):
            launched.append(cmd)
            self.log = open(log, "w")

        def wait(self, until=None):
            return 1

    monkeypatch.setattr(stage_chain, "Watched", Launch)
    monkeypatch.setattr(stage_chain, "make_cache", lambda args, work, duration: work / "manifest.jsonl")
    monkeypatch.setattr(stage_chain, "predicted", lambda args, duration: {"predicted_reserved_gib": 40.0})
    args = stage_chain.parse_args(["--workdir", str(tmp_path), "--preset", "tiny", "--device", "cpu",
                                   "--cap-at-plan", "0.05", "--durations", "3"])
    row = stage_chain.run_stage(args, tmp_path, 3, ["train.init_from=\"\""], kill=False)
    assert row["cap_gib"] == 42.0 and row["exit_code"] == 1 and "error" in row and row["status"] == "failed"
    assert "memory.max_gpu_gib=42.0" in launched[0]
    monkeypatch.setattr(stage_chain, "predicted", lambda args, duration: {})
    with pytest.raises(SystemExit, match="--cap-at-plan: the planner predicts no reserved peak for stage1-3s-1gpu"):
        stage_chain.run_stage(args, tmp_path, 3, [], kill=False)
    assert len(launched) == 1  # nothing launched without a cap to run under
    for bad in (["--cap-at-plan", "0.05", "--set", "memory.max_gpu_gib=70"], ["--cap-at-plan", "-0.1"]):
        with pytest.raises(SystemExit):
            stage_chain.parse_args(["--workdir", str(tmp_path), *bad])


def test_results_name_keeps_capped_runs_apart():
    def name(*flags):
        return stage_chain.results_name(stage_chain.parse_args(["--workdir", "/tmp/x", *flags]), "NVIDIA H200")

    assert name() == "stage_chain_h200"
    assert name("--gpus", "4") == "stage_chain_4gpu_h200"
    # under the plan's cap the reserved peaks are bounded by it: not rows of the free chain's file
    assert name("--cap-at-plan", "0.05") == "stage_chain_capped_h200"
    assert name("--cap-at-plan", "0.05", "--gpus", "2") == "stage_chain_capped_2gpu_h200"
    # stages from the base weights are no chain: not rows of the chain's file either (under a cap, the capped file's)
    assert name("--from-base") == "stage_chain_from_base_h200"
    assert name("--from-base", "--cap-at-plan", "0.05") == "stage_chain_capped_h200"
    assert stage_chain.results_name(stage_chain.parse_args(["--workdir", "/tmp/x"]), "NVIDIA H100 80GB HBM3") == \
        "stage_chain_h100"


def test_from_base_starts_every_stage_from_the_base_weights_and_goes_on_past_a_failure(tmp_path, monkeypatch):
    """--from-base: each stage is launched with the base folder and no init_from, and a stage that fails (here the
    first, as one out of memory under --cap-at-plan would) does not end the chain; without it the chain stops there
    and a later stage starts from the one before."""
    calls = []

    def fake_stage(args, work, duration, start, kill, previous=None, base=None):
        calls.append((duration, list(start), previous))
        if duration == 3:
            return {"duration_s": 3, "config": "stage1-3s-1gpu.toml", "exit_code": 1, "error": ["out of memory"]}
        return {"duration_s": duration, "config": f"stage-{duration}s", "exit_code": 0, "median_step_s": 1.0,
                "peak_allocated_gib": 1.0, "peak_reserved_gib": 1.0, "peak_gpu_used_gib": [], "peak_host_gib": 1.0,
                "checkpoint_gib": 0.1, "checkpoint_save_s": 0.1}

    monkeypatch.setattr(stage_chain, "inputs_made_apart", lambda args, work: work / "weights")
    monkeypatch.setattr(stage_chain, "run_stage", fake_stage)

    def chain(out, *flags):
        return stage_chain.main(["--workdir", str(tmp_path), "--preset", "tiny", "--device", "cpu", "--no-kill",
                                 "--no-sample", "--out", str(tmp_path / out), *flags])

    assert chain("from-base.json", "--durations", "3", "9", "18", "--from-base") == 1  # a stage failed
    base = [f"model.pretrained_path={tmp_path / 'weights'}", 'train.init_from=""']
    assert [(d, start) for d, start, _ in calls] == [(3, base), (9, base), (18, base)]
    rows = json.loads((tmp_path / "from-base.json").read_text())["stages"]
    assert [r["duration_s"] for r in rows] == [3, 9, 18] and all(r["from_base"] for r in rows)
    calls.clear()
    assert chain("chained.json", "--durations", "9", "18") == 0
    assert [d for d, _, _ in calls] == [9, 18] and calls[1][1] == [f"train.init_from={tmp_path / 'stage-9s'}"]
    calls.clear()
    assert chain("stopped.json", "--durations", "3", "9", "18") == 1
    assert [d for d, _, _ in calls] == [3]  # chained: the failure ends it


def test_a_launch_that_ran_out_of_gpu_memory_is_told_from_other_failures():
    from tttvideo.memory.guard.oom import OUT_OF_GPU_MEMORY

    assert stage_chain.ran_out_of_memory([f"tttv train: error: {OUT_OF_GPU_MEMORY} in the forward of step 1"])
    assert stage_chain.ran_out_of_memory(["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB"])
    assert not stage_chain.ran_out_of_memory(["tttv train: error: no manifest"])


def test_the_base_weights_go_once_stage_2_runs_unless_something_later_reads_them(tmp_path):
    def later(*flags):
        return stage_chain.base_read_later(stage_chain.parse_args(["--workdir", str(tmp_path), *flags]))

    assert not later()  # CogVideoX's stages 2-5 start from the stage before, the sample from stage 5
    assert later("--sample-config", "configs/cogvideox-5b/sample-63s.toml")
    assert later("--from-base")
    assert later("--preset", "wan-tiny", "--configs", "configs/wan2.1-1.3b/{stage}-24gb.toml")  # its stages name it
    # a first stage with fp8-stored frozen weights: its partial checkpoints take them from the base
    assert later("--set", "model.frozen_weights=fp8", "--set", "model.adapter=qkvo")
    assert not later("--durations", "9", "18")


def test_chain_disk_counts_what_each_stage_holds_and_refuses_a_disk_too_small(tmp_path, monkeypatch, capsys):
    """The one-GPU whole-block chain on the H100 (stage_chain_wholeblock_h100.json): at the 63-s stage the disk holds
    the 18-s checkpoint (the fp8 30-s stage's frozen layers), the 30-s one (the fp8 63-s stage's) and the 63-s
    stage's two (killed in step 2: the newest beside the one being written); the base weights went at stage 2.
    That run filled a 64-GiB disk with the base weights still there; the chain now starts only when it fits."""
    from tttvideo.memory.guard.disk import CheckpointDisk

    gib = 2**30
    each = {3: 27.15, 9: 19.61, 18: 19.61, 30: 12.2, 63: 12.2}
    def fake_disk(args, duration, steps, every):
        return CheckpointDisk(int(each[duration] * gib), 0, 0, 0, min(2, steps // every), duration in (30, 63))

    monkeypatch.setattr(stage_chain_stages, "stage_disk", fake_disk)
    # the configs that run: whole blocks at 3-30 s (the 30-s one with fp8 frozen weights), then the 63-s one (fp8)
    chain = ["--workdir", str(tmp_path), "--configs", "configs/cogvideox-5b/{stage}-{gpus}gpu-wholeblock.toml",
             "configs/cogvideox-5b/{stage}-{gpus}gpu.toml"]
    args = stage_chain.parse_args([*chain, "--steps", "1", "--last-steps", "2"])
    held = dict(stage_chain_stages.chain_disk(args, int(10.4 * gib)))
    assert held[3] == pytest.approx((27.15 + 10.4) * gib, rel=1e-9)
    assert held[9] == pytest.approx(19.61 * gib, rel=1e-9)  # stage 1's checkpoints and the base weights gone
    assert held[30] == pytest.approx((19.61 + 12.2) * gib, rel=1e-9)
    assert held[63] == pytest.approx((19.61 + 12.2 + 2 * 12.2) * gib, rel=1e-9)
    keep = dict(stage_chain_stages.chain_disk(stage_chain.parse_args([*chain, "--keep-stages"]), 0))
    assert keep[63] == pytest.approx((27.15 + 19.61 + 19.61 + 12.2 + 2 * 12.2) * gib, rel=1e-9)

    free = {"bytes": int(50 * gib)}
    monkeypatch.setattr("tttvideo.outputs.free_bytes", lambda folder: free["bytes"])
    with pytest.raises(SystemExit, match="needs up to 56.2 GiB of disk .* has 50.0 GiB"):
        stage_chain.check_chain_disk(args, tmp_path)
    free["bytes"] = int(60 * gib)
    said = stage_chain.check_chain_disk(args, tmp_path)
    assert said["disk_needed_gib"] == pytest.approx(56.21) and "at the 63-s stage" in capsys.readouterr().out
    free["bytes"] = int(50 * gib)
    ignore = stage_chain.parse_args([*chain, "--steps", "1", "--last-steps", "2", "--ignore-disk"])
    assert stage_chain.check_chain_disk(ignore, tmp_path)["disk_gib"] == pytest.approx(50.0)


def test_the_cards_memory_comes_from_nvidia_smi_not_from_cuda_in_the_launcher(monkeypatch):
    """stage_chain records the card's memory without starting CUDA in its own process (a context there would hold
    GPU memory beside the launches it measures): nvidia-smi's memory.total of the first GPU, in GiB; None without
    nvidia-smi."""
    import subprocess

    import launch_watch

    asked = []

    def smi(cmd, **kwargs):
        asked.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="81559\n81559\n", stderr="")

    monkeypatch.setattr(launch_watch.subprocess, "run", smi)
    assert launch_watch.gpu_total_gib() == pytest.approx(81559 / 1024)
    assert asked[0][:2] == ["nvidia-smi", "--query-gpu=memory.total"]

    def missing(cmd, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(launch_watch.subprocess, "run", missing)
    assert launch_watch.gpu_total_gib() is None and launch_watch.gpu_name() is None
