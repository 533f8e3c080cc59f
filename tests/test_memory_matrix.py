"""`tttv profile` end to end on the tiny model (CPU), the OOM path of a profile, and a matrix whose variants succeed,
run out of memory and fail, each its own row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tttvideo.cli import main
from tttvideo.config.loader import load_config
from tttvideo.errors import UserError
from tttvideo.memory.studies.matrix import load_matrix, matrix_table
from tttvideo.memory.profile.report import REPORT_FILES

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "configs" / "base.toml"
# The tiny preset at a layout small enough for a CPU test: 32x48 px -> 2x3 tokens per latent frame, 8 text tokens.
TINY = ["model.preset=tiny", "layout.height=32", "layout.width=48", "layout.text_tokens=8", "train.precision=fp32"]


def _overcommit_refuses_huge() -> bool:
    """The OOM variant asks the host for terabytes; only safe where the kernel refuses that at once."""
    try:
        return Path("/proc/sys/vm/overcommit_memory").read_text().strip() in ("0", "2")
    except OSError:
        return False


def test_example_matrix_parses_and_its_overrides_are_valid_config():
    m = load_matrix(ROOT / "configs" / "profile" / "matrix-example.toml")
    assert m.config == BASE.resolve() and len(m.variants) >= 5
    for v in m.variants:
        load_config(m.config, v.overrides)  # raises ConfigError on an unknown key or bad value


def test_matrix_file_errors_are_sentences(tmp_path):
    bad = tmp_path / "m.toml"
    bad.write_text('config = "nope.toml"\n[[variant]]\nname = "a"\n')
    with pytest.raises(UserError, match="does not exist"):
        load_matrix(bad)
    bad.write_text(f'config = "{BASE}"\n[[variant]]\nname = "a"\nset = ["x"]\n')
    with pytest.raises(UserError, match="section.key=value"):
        load_matrix(bad)


def test_profile_oom_is_recorded_with_its_place(tmp_path, monkeypatch):
    """Inside the child: an OOM in block 1's forward gives exit status 3 and a complete report saying where."""
    import torch
    from torch import nn

    from tttvideo.memory.profile import drivers

    class Boom(nn.Module):
        def forward(self, x):
            raise MemoryError("scripted: cannot allocate")

    def fake_train(cfg, prof, steps, device):
        blocks = [nn.Linear(4, 4), Boom()]
        prof.attach_block_hooks(blocks)
        with prof.phase("forward", step=0):
            h = torch.randn(2, 4)
            for b in blocks:
                h = b(h)

    monkeypatch.setitem(drivers.DRIVERS, "train", fake_train)
    summary, code = drivers.profile(load_config(None), "train", 1, tmp_path / "r", device="cpu")
    assert code == drivers.EXIT_OOM
    assert summary["status"] == "oom" and summary["oom"]["location"] == "forward of block 1"
    assert all((tmp_path / "r" / f).is_file() for f in REPORT_FILES)
    assert "OOM" in (tmp_path / "r" / "report.html").read_text()


def test_matrix_rows_for_ok_oom_and_failing_variants(tmp_path, capsys):
    variants = [("tiny ok", TINY), ("broken", TINY + ["model.preset=no-such-model"])]
    if _overcommit_refuses_huge():
        # A batch of 10^9 clips: the input latents alone are ~5 TB, refused by the host allocator at once.
        variants.append(("too big", TINY + ["train.batch_size=1000000000"]))
    lines = [f'config = "{BASE}"', 'phase = "train"', "steps = 1", 'device = "cpu"']
    for name, sets in variants:
        lines += ["[[variant]]", f'name = "{name}"', "set = [" + ", ".join(f'"{s}"' for s in sets) + "]"]
    # a variant with its own config file: a diffusers pipeline profile with a typo, refused before anything loads
    (tmp_path / "pipeline-typo.toml").write_text("[pipeline]\nname = 'wan2.1-t2v-1.3b'\nprecison = 'fp16'\n")
    lines += ["[[variant]]", 'name = "own file"', 'config = "pipeline-typo.toml"']
    mfile = tmp_path / "matrix.toml"
    mfile.write_text("\n".join(lines) + "\n")

    out = tmp_path / "out"
    assert main(["profile", "--matrix", str(mfile), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for name, _ in variants:
        assert name in printed

    data = json.loads((out / "matrix.json").read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == {name for name, _ in variants} | {"own file"}
    own = rows.pop("own file")
    assert own["status"] == "error" and "precison" in own["note"]
    assert (out / "matrix.html").is_file() and (out / "matrix.png").is_file()
    ok = rows["tiny ok"]
    assert ok["status"] == "ok" and ok["exit_code"] == 0
    assert [p["name"] for p in ok["summary"]["phases"]] == ["forward", "backward", "optimizer step"]
    assert {(b["name"], b["direction"]) for b in ok["summary"]["blocks"]} >= {("block 0", "forward"),
                                                                             ("block 1", "backward")}
    assert all((out / "tiny-ok" / f).is_file() for f in REPORT_FILES)
    broken = rows["broken"]
    assert broken["status"] == "error" and broken["exit_code"] == 2 and "no-such-model" in broken["note"]
    if "too big" in rows:
        big = rows["too big"]
        assert big["status"] == "oom" and big["exit_code"] == 3
        assert big["note"] == "OOM in load of inputs (cached latents + text features)"
    table = (out / "matrix.md").read_text()
    assert all(name in table for name, _ in variants) and "act. forward" in table


def test_matrix_table_shows_a_crashed_variant(tmp_path):
    from tttvideo.memory.studies.matrix import MatrixRow

    rows = [MatrixRow("crashy", "crashed", -11, 1.0, "Segmentation fault", str(tmp_path))]
    cols, table = matrix_table(rows)
    assert table[0][0] == "crashy" and table[0][1] == "crashed" and table[0][-1] == "Segmentation fault"
    assert len(table[0]) == len(cols)
