"""Typed configs: TOML loading, includes, --set overrides, error messages, TOML dumping and `tttv config`."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

from tttvideo.cli import main
from tttvideo.cli.common import add_config_arguments, config_from_args
from tttvideo.config import Config
from tttvideo.config.loader import (config_to_dict, describe_keys, dump_toml, load_config, save_config)
from tttvideo.config.schema import bounded, choice, listed
from tttvideo.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def error_of(path, overrides=(), **kw) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides), **kw)
    msg = str(info.value)
    assert "\n" not in msg, f"not one line: {msg!r}"
    return msg


# ------------------------------------------------------------------------------------------ a richer test schema
@dataclass
class Item:
    name: str
    weight: float = bounded(1.0, 0.0)


@dataclass
class Inner:
    depth: int = bounded(2, 1, 8)
    tags: list[str] = listed(lambda: ["a"], choices=("a", "b", "c"))


@dataclass
class RichSection:
    flag: bool = False
    count: int = 3
    ratio: float = 0.5
    label: str = "x"
    mode: Literal["fast", "slow"] = "fast"
    maybe: Optional[int] = None
    sizes: list[int] = listed(lambda: [1, 2], lo=0)
    shape: tuple[int, int] = (4, 5)
    items: list[Item] = listed(lambda: [Item("one")])
    inner: Inner = field(default_factory=Inner)


@dataclass
class RichConfig:
    rich: RichSection = field(default_factory=RichSection)
    other: Inner = field(default_factory=Inner)


# ------------------------------------------------------------------------------------------------------ round trip
def test_defaults_round_trip(tmp_path):
    cfg = Config()
    path = save_config(cfg, tmp_path / "run" / "config.toml")
    assert load_config(path) == cfg
    # the dump is real TOML with one table per section
    data = tomllib.loads(path.read_text())
    assert data == config_to_dict(cfg)
    assert set(data) == {f.name for f in dataclasses.fields(Config)}


def test_modified_config_round_trips_exactly(tmp_path):
    cfg = load_config(None, ["ttt.kind=linear", "ttt.base_lr=1e-7", "train.steps=10", "model.use_ttt=false",
                             'train.output_dir="runs/quo\\"te\\\\ tab\\t nl\\n é \\u007f"', "layout.duration=9s",
                             "sample.cfg_start=1.0000000000000002"])
    assert cfg.train.output_dir == 'runs/quo"te\\ tab\t nl\n é \x7f'
    for comments in (False, True):
        path = write(tmp_path / f"c{comments}.toml", dump_toml(cfg, comments=comments))
        assert load_config(path) == cfg


def test_rich_schema_round_trip(tmp_path):
    cfg = load_config(
        write(tmp_path / "r.toml", """
[rich]
flag = true
ratio = 2          # an int is accepted for a float
mode = "slow"
maybe = 7
sizes = [0, 5, 9]
shape = [1, 2]
items = [{ name = "a", weight = 0.25 }, { name = "b" }]
[rich.inner]
depth = 8
tags = ["b", "c"]
"""),
        schema=RichConfig,
    )
    assert cfg.rich.ratio == 2.0 and isinstance(cfg.rich.ratio, float)
    assert cfg.rich.items == [Item("a", 0.25), Item("b", 1.0)]
    assert cfg.rich.shape == (1, 2) and cfg.rich.inner == Inner(8, ["b", "c"])
    assert cfg.other == Inner()  # untouched section keeps defaults
    again = load_config(write(tmp_path / "dump.toml", dump_toml(cfg)), schema=RichConfig)
    assert again == cfg
    # None (TOML has no null) is left out of the dump and comes back as the default None
    assert "maybe" not in dump_toml(RichConfig())
    assert load_config(write(tmp_path / "d.toml", dump_toml(RichConfig())), schema=RichConfig) == RichConfig()


def test_rich_schema_errors(tmp_path):
    f = write(tmp_path / "bad.toml", '[rich]\nitems = [{ weight = 1.0 }]\n')
    msg = error_of(f, schema=RichConfig)
    assert "rich.items[0]" in msg and "name" in msg and str(f) in msg
    msg = error_of(write(tmp_path / "b2.toml", '[rich.inner]\ntags = ["a", "z"]\n'), schema=RichConfig)
    assert "rich.inner.tags[1]" in msg and '"z"' in msg and '"a", "b", "c"' in msg
    msg = error_of(write(tmp_path / "b3.toml", "[rich]\nsizes = [1, -1]\n"), schema=RichConfig)
    assert "rich.sizes[1]" in msg and "at least 0" in msg
    msg = error_of(write(tmp_path / "b4.toml", '[rich]\nmode = "medium"\n'), schema=RichConfig)
    assert "rich.mode" in msg and '"fast", "slow"' in msg
    msg = error_of(write(tmp_path / "b5.toml", "[rich]\nshape = [1, 2, 3]\n"), schema=RichConfig)
    assert "rich.shape" in msg and "expected 2 items" in msg
    msg = error_of(write(tmp_path / "b6.toml", "[rich]\nitems = [{ name = 'a', wieght = 1.0 }]\n"),
                   schema=RichConfig)
    assert "rich.items[0].wieght" in msg and "rich.items[0].weight" in msg


def test_base_config_loads_at_defaults():
    assert load_config(REPO / "configs" / "base.toml") == Config()


def test_removed_memory_section_is_a_warning(tmp_path, caplog):
    """Configs saved by earlier versions carry [memory] gpu_memory_gib, which nothing read: they still load."""
    old = write(tmp_path / "old.toml", "[memory]\ngpu_memory_gib = 40.0\n[train]\nsteps = 7\n")
    with caplog.at_level("WARNING"):
        assert load_config(old) == load_config(None, ["train.steps=7"])
        assert load_config(None, ["memory.gpu_memory_gib=1"]) == Config()
    assert [r.getMessage().split(" in ")[0] for r in caplog.records] == ["memory.gpu_memory_gib"] * 2
    assert "ignored" in caplog.records[0].getMessage()


# ------------------------------------------------------------------------------------------------------- overrides
def test_overrides_parse_toml_literals_with_bare_string_fallback(tmp_path):
    f = write(tmp_path / "c.toml", "[train]\nsteps = 5\n")
    cfg = load_config(f, ["ttt.kind=linear", "train.steps=10", "model.use_ttt=false", "layout.duration=9s",
                          "ttt.base_lr=1", "train.output_dir=2024", "model.use_ttt=False", " train.seed = 3 "])
    assert cfg.ttt.kind == "linear"
    assert cfg.train.steps == 10  # --set beats the file
    assert cfg.model.use_ttt is False
    assert cfg.layout.duration == "9s"  # not a TOML literal: a bare string
    assert cfg.ttt.base_lr == 1.0 and isinstance(cfg.ttt.base_lr, float)
    assert cfg.train.output_dir == "2024"  # str field: the text as typed
    assert cfg.train.seed == 3
    # later --set wins; an inline table sets several keys of one section
    cfg = load_config(None, ["train.steps=1", "train.steps=2", 'ttt={kind = "linear", mini_batch_size = 16}'])
    assert (cfg.train.steps, cfg.ttt.kind, cfg.ttt.mini_batch_size) == (2, "linear", 16)
    assert cfg.ttt.base_lr == Config().ttt.base_lr


def test_override_syntax_errors():
    for bad in ["ttt.kind", "=3", "ttt..kind=1", "ttt kind=1"]:
        msg = error_of(None, [bad])
        assert "--set" in msg and "KEY=VALUE" in msg
    msg = error_of(None, ["ttt=3"])
    assert "ttt" in msg and "expected a table of kind" in msg


# ---------------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("where", ["file", "set"])
def test_each_error_names_key_source_and_allowed(tmp_path, where):
    def check(section: str, key: str, literal: str) -> str:
        if where == "file":
            f = write(tmp_path / f"{section}_{key}.toml", f"[{section}]\n{key} = {literal}\n")
            msg = error_of(f)
            assert str(f) in msg
        else:
            msg = error_of(None, [f"{section}.{key}={literal}"])
            assert "--set" in msg
        return msg

    msg = check("ttt", "knd", '"linear"')  # unknown key: valid keys + closest
    assert "ttt.knd" in msg and "did you mean 'ttt.kind'" in msg and "mini_batch_size" in msg
    msg = check("tttt", "kind", '"linear"')  # unknown section
    assert "[tttt]" in msg and "did you mean [ttt]" in msg and "model, layout, ttt" in msg
    msg = check("ttt", "mini_batch_size", '"abc"')  # wrong type
    assert "ttt.mini_batch_size" in msg and "expected int" in msg and "got str 'abc'" in msg and "4096" in msg
    msg = check("ttt", "mini_batch_size", "-1")  # out of range (0 = the kind's default)
    assert "ttt.mini_batch_size" in msg and "out of range" in msg and "from 0 to 4096" in msg
    msg = check("ttt", "kind", '"lineer"')  # not in choices
    assert "ttt.kind" in msg and '"mlp", "linear"' in msg and 'did you mean "linear"' in msg
    msg = check("model", "use_ttt", "1")  # an int is not a bool
    assert "model.use_ttt" in msg and "expected bool" in msg and "got int 1" in msg
    msg = check("train", "steps", "2.5")  # a float is not an int
    assert "train.steps" in msg and "expected int" in msg and "got float 2.5" in msg
    msg = check("train", "seed", "true")  # a bool is not an int (Python's bool subclasses int)
    assert "train.seed" in msg and "expected int" in msg and "got bool true" in msg
    msg = check("ttt", "base_lr", "nan")  # NaN fails every bound
    assert "ttt.base_lr" in msg and "at least 0.0" in msg


def test_file_errors(tmp_path):
    msg = error_of(tmp_path / "missing.toml")
    assert "missing.toml" in msg and "does not exist" in msg
    bad = write(tmp_path / "syntax.toml", "[ttt\nkind = 1\n")
    msg = error_of(bad)
    assert str(bad) in msg and "not valid TOML" in msg and "line 1" in msg
    msg = error_of(write(tmp_path / "inc.toml", "include = 3\n"))
    assert "include" in msg and "inc.toml" in msg and "path string" in msg


# -------------------------------------------------------------------------------------------------------- includes
def test_include_chain_later_keys_win(tmp_path):
    write(tmp_path / "base.toml", '[ttt]\nkind = "linear"\nmini_batch_size = 16\n[train]\nsteps = 100\nseed = 1\n')
    write(tmp_path / "stages" / "mid.toml", 'include = "../base.toml"\n[train]\nsteps = 200\n')
    write(tmp_path / "extra.toml", "[train]\nseed = 7\n")
    stage = write(tmp_path / "stages" / "stage1.toml",
                  'include = ["mid.toml", "../extra.toml"]\n[layout]\nduration = "9s"\n[ttt]\nmini_batch_size = 32\n')
    cfg = load_config(stage, ["train.steps=300"])
    assert cfg.ttt.kind == "linear"  # from base, two levels up
    assert cfg.ttt.mini_batch_size == 32  # the stage overrides base
    assert cfg.train.seed == 7  # the second include overrides the first
    assert cfg.layout.duration == "9s"
    assert cfg.train.steps == 300  # --set last
    assert load_config(stage).train.steps == 200  # mid overrides base


def test_include_errors_name_the_right_file(tmp_path):
    base = write(tmp_path / "base.toml", "[ttt]\nmini_batch_size = -1\n")
    stage = write(tmp_path / "stage.toml", 'include = "base.toml"\n')
    msg = error_of(stage)
    assert str(base) in msg and "ttt.mini_batch_size" in msg
    write(tmp_path / "a.toml", 'include = "b.toml"\n')
    write(tmp_path / "b.toml", 'include = "a.toml"\n')
    msg = error_of(tmp_path / "a.toml")
    assert "include cycle" in msg and "a.toml" in msg and "b.toml" in msg
    msg = error_of(write(tmp_path / "c.toml", 'include = "nope.toml"\n'))
    assert "nope.toml" in msg and "c.toml" in msg and "does not exist" in msg


# ------------------------------------------------------------------------------------------------------ helpers
def test_layout_from_config_sections():
    from tttvideo.layout import VideoLayout

    cfg = load_config(None, ["layout.duration=9s", "ttt.mini_batch_size=16", "layout.height=240",
                             "layout.width=368"])
    lay = VideoLayout.from_config(cfg.layout, cfg.ttt)
    assert lay == VideoLayout.create(duration="9s", height=240, width=368, mini_batch_size=16)
    assert lay.num_segments == 3 and lay.mini_batch_size == 16


def test_describe_keys_covers_every_field():
    keys = {k.key: k for k in describe_keys()}
    defaults = Config()
    expected = set()
    for s in dataclasses.fields(defaults):
        section = getattr(defaults, s.name)
        hints = typing.get_type_hints(type(section))
        for f in dataclasses.fields(section):
            expected.add(f"{s.name}.{f.name}")
            args = typing.get_args(hints[f.name])
            if len(args) == 1 and dataclasses.is_dataclass(args[0]):  # list of tables: element keys as a.b[].c
                expected |= {f"{s.name}.{f.name}[].{g.name}" for g in dataclasses.fields(args[0])}
    assert set(keys) == expected
    assert keys["ttt.kind"].allowed == 'one of "mlp", "linear"' and keys["ttt.kind"].default == '"mlp"'
    assert keys["ttt.mini_batch_size"].type == "int" and "4096" in keys["ttt.mini_batch_size"].allowed
    rich = {k.key for k in describe_keys(RichConfig)}
    assert {"rich.items", "rich.items[].name", "rich.inner.depth", "other.tags"} <= rich


def test_schema_helpers_reject_defaults_outside_their_own_limits():
    with pytest.raises(ValueError):
        choice("c", "a", "b")
    with pytest.raises(ValueError):
        bounded(0, 1, 10)


def test_common_arguments_are_reusable(tmp_path):
    f = write(tmp_path / "c.toml", "[train]\nsteps = 4\n")
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    cfg = config_from_args(parser.parse_args([str(f), "--set", "train.seed=9", "--set", "ttt.kind=linear"]))
    assert (cfg.train.steps, cfg.train.seed, cfg.ttt.kind) == (4, 9, "linear")
    assert config_from_args(parser.parse_args([str(f)])).train.seed == Config().train.seed
    with pytest.raises(SystemExit):  # CONFIG is required by default
        parser.parse_args([])
    optional = argparse.ArgumentParser()
    add_config_arguments(optional, config_required=False)
    assert config_from_args(optional.parse_args([])) == Config()


# ------------------------------------------------------------------------------------------------------------ CLI
def test_cli_config_show_prints_loadable_toml(tmp_path, capsys):
    f = write(tmp_path / "c.toml", '[layout]\nduration = "18s"\n')
    assert main(["config", "show", str(f), "--set", "ttt.kind=linear"]) == 0
    out = capsys.readouterr().out
    assert "[ttt]" in out and 'kind = "linear"' in out
    assert tomllib.loads(out) == config_to_dict(load_config(f, ["ttt.kind=linear"]))
    assert main(["config", "show", "--comments"]) == 0
    out = capsys.readouterr().out
    assert "# inner model: TTT-MLP or TTT-Linear" in out and tomllib.loads(out) == config_to_dict(Config())


def test_cli_config_keys(capsys):
    assert main(["config", "keys", "ttt"]) == 0
    out = capsys.readouterr().out
    assert "ttt.kind" in out and '"mlp", "linear"' in out and "model.preset" not in out
    assert main(["config", "keys"]) == 0
    assert "parallel.tensor_parallel" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needle", [
    (["config", "show", "--set", "ttt.knd=linear"], "did you mean 'ttt.kind'"),
    (["config", "show", "MISSING.toml"], "MISSING.toml does not exist"),
    (["config", "keys", "tt"], "did you mean ttt"),
])
def test_cli_bad_input_exits_2_with_one_line(argv, needle, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tttv config: error: ") and "Traceback" not in captured.err
    assert needle in lines[0]


def test_a_train_config_mistake_is_reported_before_torch_loads():
    """The command line's parsers import no torch (every command registers its parser, so one that did would cost
    every command, `tttv --help` included, the ~2 s of `import torch`), and `tttv train` reads its config before it
    imports the trainer: a mistyped key costs the user the CLI's start-up only (0.2 s against 4.6 s before, on a
    2-core machine). Checked in a fresh process, whose modules show what it loaded."""
    import subprocess
    import sys

    probe = ("import sys\nfrom tttvideo.cli import main\n"
             "code = main(['train', 'configs/demo.toml', '--set', 'sample.nope=1'])\n"
             "print(code, 'tttvideo.train.trainer' in sys.modules, 'torch' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.stdout.split() == ["2", "False", "False"], run.stdout + run.stderr
    assert "tttv train: error: unknown key 'sample.nope'" in run.stderr


def test_sample_input_mistakes_are_reported_before_torch_loads(tmp_path):
    """`tttv sample` in one process checks its inputs (checkpoint path, scenes, --out, config keys) before it imports
    torch and the sampler: each mistake is one sentence after the CLI's start-up (0.3 s against 4.4 s before, on a
    2-core machine). All four in one fresh process, whose modules show that none of them loaded torch."""
    import subprocess
    import sys

    scenes = tmp_path / "story.json"
    scenes.write_text('[{"text": "a red ball"}]')
    cases = [["--checkpoint", str(tmp_path / "missing"), "--scenes", str(scenes), "--out", str(tmp_path / "a.mp4")],
             ["--checkpoint", str(tmp_path), "--scenes", str(tmp_path / "missing.json"), "--out", "a.mp4"],
             ["--checkpoint", str(tmp_path), "--scenes", str(scenes), "--out", str(tmp_path / "story.json" / "x")],
             ["--checkpoint", str(tmp_path), "--scenes", str(scenes), "--out", str(tmp_path / "a.mp4"),
              "--set", "sample.nope=1"]]
    probe = ("import sys\nfrom tttvideo.cli import main\n"
             f"codes = [main(['sample', *argv]) for argv in {cases!r}]\n"
             "print(*codes, 'torch' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.stdout.split() == ["2", "2", "2", "2", "False"], run.stdout + run.stderr
    errors = run.stderr.strip().splitlines()
    assert len(errors) == 4 and all(line.startswith("tttv sample: error: ") for line in errors), run.stderr
    for line, needle in zip(errors, ["missing does not exist", "missing.json does not exist", "--out",
                                     "unknown key 'sample.nope'"]):
        assert needle in line, line


def test_base_toml_lists_every_key():
    """configs/base.toml is the documented reference: every key of every section appears in it."""
    import dataclasses
    import tomllib

    written = tomllib.loads((REPO / "configs" / "base.toml").read_text())
    for section in dataclasses.fields(Config):
        keys = {f.name for f in dataclasses.fields(section.type if isinstance(section.type, type) else
                                                  type(getattr(Config(), section.name)))}
        missing = keys - set(written.get(section.name, {}))
        assert not missing, f"[{section.name}] in configs/base.toml lacks {sorted(missing)}"


def test_choice_fields_are_typed_by_their_allowed_values():
    """A `choice` field's annotation is the Literal of exactly the values the loader accepts (config.schema)."""
    from tttvideo.config import schema

    checked = 0
    for section in dataclasses.fields(schema.Config):
        cls = section.default_factory
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            choices = f.metadata.get("choices")
            if choices and typing.get_origin(hints[f.name]) is not list:
                assert typing.get_origin(hints[f.name]) is typing.Literal, f"{section.name}.{f.name}"
                assert typing.get_args(hints[f.name]) == choices, f"{section.name}.{f.name}"
                checked += 1
    assert checked == 23
