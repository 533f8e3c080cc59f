"""benchmarks/long_range.py end to end on CPU with the tiny model: every variant (TTT-MLP, TTT-Linear, none, full
attention, Mamba 2, Gated DeltaNet; the last two on their plain PyTorch recurrence, since flash-linear-attention's
kernels need CUDA) trains a few steps on the long-range set (in the benchmark's process, or two at a time in their
own processes), samples held-out stories and is scored by the probe, which is checked live first; the JSON, the
table and the plot come out, a rerun resumes instead of retraining, and a rerun of other settings is refused."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.benchmark_scripts import load_benchmark

SMOKE = ["--durations", "6s", "--seeds", "0", "--steps", "2", "--eval-videos", "2", "--set", "sample.steps=2",
         "--set", "train.cpu_threads=1", "--set", "data.demo_videos=4"]


def benchmark():
    return load_benchmark("long_range")


def test_every_variant_is_trained_sampled_and_scored(tmp_path, capsys):
    lr = benchmark()
    out = tmp_path / "lr.json"
    args = [*SMOKE, "--out", str(out), "--work", str(tmp_path / "work")]
    in_process = ["ttt-mlp", "ttt-linear", "full-attention", "mamba2"]
    assert lr.main([*args, "--variants", ",".join(in_process)]) == 0
    # the other two at once, each in its own process; the four above are held already
    assert lr.main([*args, "--jobs", "2"]) == 0
    result = json.loads(out.read_text())
    assert result["probe"] == {"6s": {"kept": 1.0, "forgotten": 0.0}}  # the probe is live
    assert result["chance"] == pytest.approx(1 / 6)
    assert sorted(r["variant"] for r in result["runs"]) == sorted(lr.VARIANTS)
    for r in result["runs"]:
        assert r["steps"] == 2 and r["eval_videos"] == 2 and r["median_step_s"] > 0
        assert r["concurrent_jobs"] == (1 if r["variant"] in in_process else 2)
        assert len(r["accuracy_by_distance"]) == 1 and 0.0 <= r["accuracy"] <= 1.0  # 6 s: one later scene
        assert 0.0 <= r["first_scene_colour"] <= 1.0
        assert (r["long_range_params"] == 0) == (r["variant"] == "none")
    printed = capsys.readouterr().out
    assert all(f"| 6s | {v} |" in printed for v in lr.VARIANTS)
    if importlib.util.find_spec("matplotlib"):
        assert out.with_suffix(".png").stat().st_size > 0
    # the --jobs processes wrote their one-run files and nothing else
    assert sorted(p.suffix for p in (tmp_path / "work" / "parts").iterdir()) == [".json", ".json", ".log", ".log"]
    # a rerun holds every run already: it trains nothing and keeps the results
    assert lr.main(args) == 0
    assert json.loads(out.read_text())["runs"] == result["runs"]
    assert "seed 0: accuracy" not in capsys.readouterr().out
    # other settings are other runs: the same JSON refuses them instead of mixing them in
    with pytest.raises(SystemExit, match="holds runs made with"):
        lr.main([*args[:5], "3", *args[6:]])
    assert "mamba2's recurrence: PyTorch reference" in printed
    # --report: the table and plot again from the file alone, every run in it, nothing trained
    out.with_suffix(".png").unlink(missing_ok=True)
    assert lr.main(["--report", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert all(f"| 6s | {v} |" in printed for v in lr.VARIANTS) and "(6 runs)" in printed
    assert json.loads(out.read_text())["runs"] == result["runs"]
    if importlib.util.find_spec("matplotlib"):
        assert out.with_suffix(".png").stat().st_size > 0
    with pytest.raises(SystemExit, match="does not exist"):
        lr.main(["--report", "--out", str(tmp_path / "missing.json")])


def test_a_duration_without_a_later_scene_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        benchmark().main(["--durations", "3s", "--out", str(tmp_path / "x.json")])
