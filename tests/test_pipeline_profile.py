"""`tttv profile` on diffusers pipelines (tttvideo.memory.studies.pipelines): tiny random Wan2.1 and CogVideoX
pipelines give a complete report, a local pipeline folder loads, the variant files of the studies load, a failing
variant is a one-sentence error (a matrix row), and the matrix report ranks its rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tttvideo.memory.studies.pipeline_config import PIPELINE_NAMES, is_pipeline_profile, load_pipeline_profile

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
TINY = ["pipeline.tiny=true", "pipeline.height=32", "pipeline.width=32", "pipeline.frames=9",
        "pipeline.text_tokens=8"]


def tiny(name: str, *extra: str):
    return load_pipeline_profile(None, [f"pipeline.name={name}", *TINY, *extra])


@pytest.mark.parametrize("name", PIPELINE_NAMES)
def test_tiny_pipeline_gives_a_complete_report(tmp_path, name):
    from tttvideo.memory.studies.pipelines import profile_pipeline

    traced = name.startswith("wan")  # torch.profiler's first start costs ~10 s on 2 cores: one pipeline traces
    summary, code = profile_pipeline(tiny(name), 2, tmp_path, device="cpu", trace=traced)
    assert code == 0 and summary["status"] == "ok"
    components = [c["name"] for c in summary["components"]]
    assert [c.split(" (")[0] for c in components] == ["text encoder", "VAE", "transformer"]
    assert all("random weights" in c for c in components)
    phases = {p["name"]: p["occurrences"] for p in summary["phases"]}
    # Wan runs the conditional and the unconditional pass one after the other, CogVideoX batches them
    calls = 4 if name.startswith("wan") else 2
    assert phases == {"text encoding": 1, "denoise": 1, "transformer forward": calls, "VAE decode": 1}
    assert {b["name"] for b in summary["blocks"]} == {"block 0", "block 1"}
    assert all(b["occurrences"] == calls for b in summary["blocks"])
    assert len(summary["step_seconds"]) == 2 and all(s > 0 for s in summary["step_seconds"])
    assert summary["meta"]["video_shape"] == [1, 9, 3, 32, 32]
    assert summary["meta"]["pipeline"]["name"] == name
    for f in ("report.html", "summary.md", "summary.csv", "events.json", "timeline.png", "components.png"):
        assert (tmp_path / f).is_file(), f
    if not traced:
        return
    assert (tmp_path / "trace.json").is_file() and (tmp_path / "trace_top.md").is_file()
    top = json.loads((tmp_path / "trace_top.json").read_text())
    assert top["by_time"] and top["by_memory"]
    assert not any(".py(" in r["operator"] for r in top["by_time"])  # operators, not the Python frames of stacks


def test_memory_switches_run_and_show_as_components(tmp_path):
    from tttvideo.memory.studies.pipelines import profile_pipeline

    pc = tiny("wan2.1-t2v-1.3b", "pipeline.loading=blockwise", "pipeline.text_encoder_device=cpu",
              "pipeline.offload=group", "pipeline.vae_tiling=true", "pipeline.fp8_weights=true")
    summary, code = profile_pipeline(pc, 1, tmp_path, device="cpu")
    assert code == 0
    names = [c["name"] for c in summary["components"]]
    assert "text encoder (umT5-XXL, random weights, on CPU)" in names
    assert "transformer weights to fp8 (layerwise casting)" in names and "offload hooks (group)" in names


def test_local_pipeline_folder_loads_its_weights(tmp_path):
    import torch

    from tttvideo.memory.studies.pipelines import PIPELINES, build_pipeline
    from tttvideo.memory.profile.profiler import MemoryProfiler

    torch.manual_seed(0)
    factories = PIPELINES["wan2.1-t2v-1.3b"].build(True)
    saved = {}
    for part in ("text_encoder", "vae", "transformer"):
        saved[part] = factories[part]()
        saved[part].save_pretrained(tmp_path / part)
    pc = tiny("wan2.1-t2v-1.3b", f"pipeline.weights={tmp_path}", "pipeline.precision=fp32")
    pipe, text_encoder = build_pipeline(pc, MemoryProfiler.disabled(), torch.device("cpu"))
    for part, loaded in (("text_encoder", text_encoder), ("vae", pipe.vae), ("transformer", pipe.transformer)):
        want = saved[part].state_dict()
        got = loaded.state_dict()
        assert want.keys() == got.keys(), part
        assert all(torch.equal(want[k], got[k]) for k in want), part
    missing = load_pipeline_profile(None, [f"pipeline.weights={tmp_path / 'nowhere'}", *TINY])
    from tttvideo.errors import UserError

    with pytest.raises(UserError, match="has no text_encoder/ folder"):
        build_pipeline(missing, MemoryProfiler.disabled(), torch.device("cpu"))


def test_study_variant_files_load():
    from tttvideo.memory.studies.matrix import child_command, load_matrix

    for study, count in (("wan21", 16), ("cogvideox5b-diffusers", 6)):
        m = load_matrix(ROOT / "configs" / "profile" / study / "matrix.toml")
        assert len(m.variants) == count and m.config is None
        for v in m.variants:
            assert v.config is not None and is_pipeline_profile(v.config)
            load_pipeline_profile(v.config)
            cmd = child_command(m, v, Path("out"))
            assert str(v.config) in cmd and "--phase" not in cmd  # a pipeline has no train / sample choice
            parallel = load_pipeline_profile(v.config).context_parallel > 1
            assert ("torch.distributed.run" in cmd) == parallel, v.name
            assert ("--nproc_per_node=2" in cmd) == parallel
    smallest = load_pipeline_profile(ROOT / "configs/profile/wan21/smallest.toml")
    assert (smallest.text_encoder_device, smallest.offload, smallest.fp8_weights, smallest.frames) == \
        ("cpu", "group", True, 81)


def test_bad_pipeline_variant_is_one_sentence(tmp_path, capsys):
    from tttvideo.cli import main

    bad = tmp_path / "bad.toml"
    bad.write_text("[pipeline]\nname = 'wan2.1-t2v-1.3b'\ntiny = true\nheight = 32\nwidth = 32\nframes = 9\n"
                   "text_tokens = 8\nattention_backend = 'no-such-backend'\n")
    assert main(["profile", str(bad), "--steps", "1", "--device", "cpu", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("tttv profile: error: pipeline.attention_backend = 'no-such-backend'")
    assert main(["profile", "--pipeline", "wan2.1-t2v-1.3b", "--phase", "train", "--out", str(tmp_path / "t")]) == 2
    assert "inference only" in capsys.readouterr().err


def test_matrix_report_ranks_by_peak_and_time(tmp_path):
    from tttvideo.memory.studies.matrix import MatrixRow, matrix_table
    from tttvideo.memory.studies.matrix_report import rankings, write_matrix_report

    def row(name, status, peak=None, step=None):
        summary = None if peak is None else {"totals": {"peak_allocated": peak}, "step_seconds": [9.0, step]}
        return MatrixRow(name, status, 0, 1.0, "", str(tmp_path), summary)

    rows = [row("a", "ok", 3 * 2**30, 2.0), row("b", "oom"), row("c", "ok", 2 * 2**30, 5.0), row("d", "error")]
    ranks = rankings(rows)
    assert [n for n, _ in ranks["peak"]] == ["c", "a", "b", "d"] and ranks["peak"][2] == ("b", "oom")
    assert [n for n, _ in ranks["step time"]] == ["a", "c", "b", "d"]
    cols, table = matrix_table(rows)
    write_matrix_report(rows, cols, table, tmp_path, "test matrix")
    md = (tmp_path / "matrix.md").read_text()
    assert "## Ranked by peak" in md and "## Ranked by step time" in md
    assert (tmp_path / "matrix.png").stat().st_size > 0 and "<img" in (tmp_path / "matrix.html").read_text()


def test_context_parallel_variant_equals_one_process_and_resumes(tmp_path, capsys, monkeypatch):
    """A matrix over two 'GPUs' (gloo on the CPU): a one-GPU variant (a config mistake: it fails at once, sparing
    the test a child's 30-s diffusers import) takes GPU 0, the context-parallel Wan variant waits for both and runs
    as two torchrun processes; its video equals the one-process run's; --resume keeps the finished row and reruns
    the failed one."""
    from tttvideo.cli import main
    from tttvideo.memory.studies.pipelines import profile_pipeline

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the children: two ranks on a 2-core CI machine
    (tmp_path / "tiny.toml").write_text("[pipeline]\nname = 'wan2.1-t2v-1.3b'\ntiny = true\nheight = 32\nwidth = 32\n"
                                        "frames = 9\ntext_tokens = 8\nprecision = 'fp32'\n")
    (tmp_path / "cp.toml").write_text("include = 'tiny.toml'\n[pipeline]\ncontext_parallel = 2\n")
    (tmp_path / "typo.toml").write_text("include = 'tiny.toml'\n[pipeline]\nprecison = 'fp16'\n")
    (tmp_path / "m.toml").write_text('steps = 1\ndevice = "cpu"\n[[variant]]\nname = "typo"\nconfig = "typo.toml"\n'
                                     '[[variant]]\nname = "cp"\nconfig = "cp.toml"\n')
    out = tmp_path / "out"
    args = ["profile", "--matrix", str(tmp_path / "m.toml"), "--out", str(out), "--gpus", "0,1"]
    assert main(args) == 0
    rows = {r["variant"]: r for r in json.loads((out / "matrix.json").read_text())["rows"]}
    assert rows["typo"]["status"] == "error" and "precison" in rows["typo"]["note"]
    assert rows["cp"]["status"] == "ok", rows["cp"]
    assert (out / "typo" / "command.txt").read_text().startswith("CUDA_VISIBLE_DEVICES=0 ")
    assert (out / "cp" / "command.txt").read_text().startswith("CUDA_VISIBLE_DEVICES=0,1 ")
    cp = rows["cp"]["summary"]["meta"]
    assert "Ulysses over 2" in cp["context_parallel"] and (out / "cp" / "rank1" / "summary.json").is_file()
    assert any("context parallelism" in c["name"] for c in rows["cp"]["summary"]["components"])
    one, _ = profile_pipeline(tiny("wan2.1-t2v-1.3b", "pipeline.precision=fp32"), 1, tmp_path / "one", device="cpu")
    for key in ("mean", "std"):  # fp32: the all-to-alls move values, they do not change them
        assert cp["video_stats"][key] == pytest.approx(one["meta"]["video_stats"][key], rel=1e-5, abs=1e-6)
    capsys.readouterr()
    assert main(args + ["--resume"]) == 0
    err = capsys.readouterr().err
    assert "cp: kept (ok) from the earlier run" in err and "typo on GPU 0" in err


def test_context_parallel_mistakes_are_sentences(tmp_path, capsys):
    from tttvideo.cli import main

    base = ["profile", "--steps", "1", "--device", "cpu", "--set", "pipeline.tiny=true"]
    assert main([*base, "--pipeline", "cogvideox-5b-diffusers", "--set", "pipeline.context_parallel=2",
                 "--out", str(tmp_path / "a")]) == 2
    assert "no context-parallel plan for cogvideox-5b-diffusers" in capsys.readouterr().err
    assert main([*base, "--pipeline", "wan2.1-t2v-1.3b", "--set", "pipeline.context_parallel=2",
                 "--out", str(tmp_path / "b")]) == 2
    assert "needs as many processes: torchrun --nproc_per_node 2" in capsys.readouterr().err
    assert main([*base, "--pipeline", "wan2.1-t2v-1.3b", "--gpus", "0"]) == 2
    assert "go with --matrix" in capsys.readouterr().err


@pytest.mark.parametrize("name", PIPELINE_NAMES)
def test_blockwise_build_keeps_shared_weights_shared(name):
    """T5's token embedding is one tensor under two names (`shared`, `encoder.embed_tokens`): the module-by-module
    build makes it once, so blockwise loading holds the same bytes as a whole build."""
    import torch

    from tttvideo.memory.studies.pipelines import PIPELINES, _materialize, _on_meta

    factory = PIPELINES[name].build(True)["text_encoder"]
    model = _on_meta(factory, torch.float32)
    _materialize(model, torch.device("cpu"))
    assert model.shared.weight is model.encoder.embed_tokens.weight
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    whole = factory()
    size = lambda m: sum(p.numel() for p in m.parameters())  # parameters() counts a shared tensor once
    assert size(model) == size(whole)
    assert len(model.state_dict()) == len(whole.state_dict())
    assert all(p.std() > 0 for p in model.parameters() if p.dim() >= 2)  # filled, not left empty


@pytest.mark.parametrize("tiny_run", [False, True])
def test_a_full_size_pipeline_on_the_cpu_is_warned_before_it_builds(monkeypatch, caplog, tmp_path, tiny_run):
    """A full-size pipeline profiled on the CPU runs for hours: a warning names the size and the quick way out
    before anything is built; a tiny one runs without it."""
    import tttvideo.memory.profile.drivers as drivers
    from tttvideo.memory.studies.pipelines import profile_pipeline

    monkeypatch.setattr(drivers, "run_profiled", lambda *a, **k: ({"status": "ok"}, 0))  # build nothing
    pc = tiny("wan2.1-t2v-1.3b") if tiny_run else load_pipeline_profile(None, ["pipeline.name=wan2.1-t2v-1.3b"])
    with caplog.at_level("WARNING", logger="tttvideo"):
        assert profile_pipeline(pc, 1, tmp_path, device="cpu")[1] == 0
    said = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert ("480x832, 81 frames on the CPU" in said and "pipeline.tiny=true" in said) is not tiny_run
    assert bool(said) is not tiny_run


def test_the_tiny_wan_transformer_takes_the_published_video_size():
    """pipeline.tiny = true keeps the published 480 x 832 x 81 video unless told otherwise: the tiny transformer's
    rotary table must cover its latent grid (52 patches across), or diffusers fails in the first forward."""
    import torch

    from tttvideo.memory.studies.pipelines import PIPELINES

    dit = PIPELINES["wan2.1-t2v-1.3b"].build(True)["transformer"]()
    latents = torch.zeros(1, 16, 1, 480 // 8, 832 // 8)  # one latent frame of the published size
    with torch.no_grad():
        out = dit(latents, timestep=torch.tensor([1]), encoder_hidden_states=torch.zeros(1, 4, 32)).sample
    assert out.shape == latents.shape
