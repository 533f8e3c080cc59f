"""benchmarks/fit_24gb.py --backbone wan: every row in its own process with its own host peak, a row that runs out
of memory is a row result and the next row runs, and the results file is rewritten after every row."""

from __future__ import annotations

import json
import sys

from tests.benchmark_scripts import load_benchmark


def test_child_host_peak_and_timeout(tmp_path):
    fit = load_benchmark("fit_24gb")
    touch = "b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096])"
    held = bytearray(1200 * 2**20)  # this process's resident set above 1 GiB: a plain fork + exec would report it
    held[::4096] = b"x" * len(held[::4096])
    code, _, host = fit.run_child([sys.executable, "-c", touch], tmp_path, timeout=60)
    del held
    assert code == 0 and 0.29 < host < 1.0  # that process's own 300 MiB, not this one's
    code, seconds, _ = fit.run_child([sys.executable, "-c", "import time; time.sleep(30)"], tmp_path, timeout=0.5)
    assert code is None and seconds < 10


def test_wan_rows_survive_an_out_of_memory_row_and_are_saved_after_each(tmp_path, monkeypatch):
    fit = load_benchmark("fit_24gb")
    out = tmp_path / "r.json"
    seen = []

    def fake_profile(name, config, phase, steps, overrides, work, timeout):
        assert steps == 2 and "sample.vae_path=" in overrides
        if "63 s" in name and phase == "train":
            return {"status": "oom", "oom": {"location": "backward of block 9"}, "peak_host_gib": 3.0}
        return {"status": "ok", "median_step_s": 1.5, "peak_allocated_gib": 2.0, "peak_reserved_gib": 2.5,
                "peak_host_gib": 3.0}

    monkeypatch.setattr(fit, "profile", fake_profile)
    monkeypatch.setattr(fit, "environment", lambda: {"device": "test", "torch": "t", "git_commit": "c"})
    original = fit.wan_suite

    def counting_suite(args, work, data, save):
        def spy():
            save()
            seen.append(len(json.loads(out.read_text())["runs"]))
        original(args, work, data, spy)

    monkeypatch.setattr(fit, "wan_suite", counting_suite)
    assert fit.main(["--backbone", "wan", "--out", str(out), "--work", str(tmp_path / "work")]) == 0
    assert seen == [1, 2, 3, 4]  # the file after every row
    runs = json.loads(out.read_text())["runs"]
    assert [r["status"] for r in runs] == ["ok", "ok", "oom", "ok"]
    assert [r["duration_s"] for r in runs] == [3, 18, 63, 63]
    assert [r["cap_gib"] for r in runs] == [23.0, 23.0, 23.0, 12.0]
    # a later call for one part keeps the other part's rows
    monkeypatch.setattr(fit, "wan_suite", original)
    assert fit.main(["--backbone", "wan", "--parts", "sample", "--out", str(out), "--work", str(tmp_path)]) == 0
    assert len(json.loads(out.read_text())["runs"]) == 4
