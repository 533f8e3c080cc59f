"""tttvideo.results: the benchmarks' JSON writer (atomic, copied to $OUT on a lent GPU machine)."""

import json
import os

import pytest

from tttvideo import results


def test_save_json_writes_whole_file_and_no_temporary(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    path = results.save_json(tmp_path / "deep" / "speed_h100.json", {"rows": [1, 2], "device": "x"})
    assert json.loads(path.read_text()) == {"rows": [1, 2], "device": "x"}
    assert path.read_text().endswith("}\n")
    assert sorted(p.name for p in path.parent.iterdir()) == ["speed_h100.json"]


def test_save_json_copies_to_out(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("OUT", str(out))
    results.save_json(tmp_path / "results" / "a.json", {"a": 1})
    assert json.loads((out / "a.json").read_text()) == {"a": 1}
    # a file written into $OUT itself is written once (ttt_kernel.py's default folder is $OUT)
    results.save_text(out / "b.md", "table\n")
    assert (out / "b.md").read_text() == "table\n"
    assert sorted(p.name for p in out.iterdir()) == ["a.json", "b.md"]


def test_failed_write_keeps_the_previous_file(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    path = results.save_json(tmp_path / "r.json", {"run": 1})
    with pytest.raises(TypeError):
        results.save_json(path, {"run": object()})  # not JSON: fails before anything is written
    assert json.loads(path.read_text()) == {"run": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    assert not any(name.endswith(".tmp") for name in os.listdir(tmp_path))
