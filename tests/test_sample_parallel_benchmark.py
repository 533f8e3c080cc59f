"""benchmarks/sample_parallel.py on CPU (gloo) with the tiny model: one torchrun launch per layout (one process,
sp = 2 with two guided passes and with one batch-2 pass, guidance split over 2), each row timed, compared with the
one-process row (speedup, efficiency) and its prediction checked against the one-process prediction; a rerun
launches nothing."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from tests.benchmark_scripts import load_benchmark

if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("one_thread")



def benchmark():
    return load_benchmark("sample_parallel")


def test_layouts_run_under_torchrun_and_match_one_process(tmp_path, capsys):
    bench = benchmark()
    out = tmp_path / "out.json"
    argv = ["--preset", "tiny", "--dtype", "fp32", "--duration", "3s", "--height", "32", "--width", "48",
            "--device", "cpu", "--layouts", "1,sp2,sp2b,cfg2", "--steps", "1", "--work", str(tmp_path / "work"),
            "--out", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["duration_s"] == 3  # the benchmarks' shared keys (peak_allocated_gib: None without a GPU)
    rows = {r["layout"]: r for r in result["rows"]}
    assert all("peak_allocated_gib" in r for r in rows.values())
    assert list(rows) == ["1", "sp2", "sp2b", "cfg2"]
    for name, gpus in (("1", 1), ("sp2", 2), ("sp2b", 2), ("cfg2", 2)):
        r = rows[name]
        assert r["status"] == "ok", r.get("error")
        assert r["gpus"] == gpus and len(r["step_s"]) == 1 and r["median_step_s"] > 0
        assert r["efficiency"] == pytest.approx(r["speedup"] / gpus)
        # the same function on every layout: fp32, only the guidance pair's batch 1 vs batch 2 differs
        assert r["max_rel_diff_vs_1"] < 1e-5
    assert rows["1"]["speedup"] == 1.0 and rows["cfg2"]["split_guidance"] and rows["sp2"]["sp"] == 2
    assert rows["sp2b"]["cfg_batched"] and not rows["sp2"]["cfg_batched"]
    assert "| sp2 | 2 | 2 | 2 passes |" in capsys.readouterr().out

    assert bench.main(argv) == 0  # every layout is held: nothing is launched again
    assert "process(es)" not in capsys.readouterr().out


def test_a_layout_name_that_is_not_one_says_so():
    with pytest.raises(SystemExit, match="is not a layout"):
        benchmark().parse_layout("sp2x")
    assert benchmark().parse_layout("sp2cfg2") == (4, 2, True, False)
    assert benchmark().parse_layout("sp2b") == (2, 2, False, True)
    assert benchmark().parse_layout("1b") == (1, 1, False, True)
    with pytest.raises(SystemExit, match="is not a layout"):
        benchmark().parse_layout("cfg2b")  # a split has no batch-2 pass to make


def test_a_failing_layout_row_says_why(tmp_path, capsys):
    """A rank's exception, not torchrun's summary after it, is what the failed row and the table show."""
    out = tmp_path / "out.json"
    argv = ["--preset", "no-such-preset", "--duration", "3s", "--device", "cpu", "--layouts", "1", "--steps", "1",
            "--work", str(tmp_path / "work"), "--out", str(out)]
    benchmark().main(argv)
    row = json.loads(out.read_text())["rows"][0]
    assert row["status"] == "failed"
    assert "no-such-preset" in row["error"].splitlines()[-1]
    assert "no-such-preset" in capsys.readouterr().out
