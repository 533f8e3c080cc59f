"""Loading a checkpoint never runs code from it (issue 42, docs/security.md): the training state round-trips through
state.safetensors bit for bit; a state.pt of an earlier version resumes (converted once); crafted pickles (a
state.pt, DCP's .metadata, a DCP value) whose loading would create a marker file are refused with one sentence
naming the file and --trust-checkpoint, and the marker never appears; with the flag the trusted path reads them; a
manifest or DCP metadata naming a file outside its folder is refused."""

from __future__ import annotations

import json
import pickle
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tttvideo import runs
from tttvideo.cli import main
from tttvideo.config.loader import load_config
from tttvideo.errors import UserError
from tttvideo.train import checkpoint
from tttvideo.train.statefile import STATE_KEY, read_state, write_state

from tests.cli_errors import one_error_line

pytestmark = pytest.mark.usefixtures("one_thread")

DEMO = str(Path(__file__).parents[1] / "configs" / "demo.toml")
CHEAP = ["layout.duration=3s", "train.batch_size=1", "data.demo_videos=3", "data.demo_text_encoder=table",
         "train.steps=2", "train.checkpoint_every=1", "train.keep_checkpoints=2", "train.log_every=1",
         "train.sample_at_end=false", "train.tensorboard=false", "train.warmup_steps=1", "train.cpu_threads=1"]


def train_argv(out: Path, *flags: str) -> list[str]:
    every = (*CHEAP, f"train.output_dir={out}", f"data.demo_dir={out.parent / 'data'}")
    return ["train", DEMO, *[x for s in every for x in ("--set", s)], *flags]


def touch_and_return(marker: str, value: object) -> object:
    """What the crafted pickles call when loaded: creates `marker` (the stand-in for any code), returns `value`."""
    Path(marker).touch()
    return value


class Payload:
    """Pickles as a call of touch_and_return(marker, value): loading it creates the marker file."""

    def __init__(self, marker: Path, value: object = None):
        self.marker, self.value = str(marker), value

    def __reduce__(self):
        return touch_and_return, (self.marker, self.value)


class PathTouch:
    """Pickles as Path(marker).touch(): a method of an allowed class (pathlib.Path)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 2-step run of the tiny model with checkpoints at steps 1 and 2, made once."""
    out = tmp_path_factory.mktemp("trained") / "run"
    assert main(train_argv(out)) == 0
    return out


@pytest.fixture
def run_copy(trained, tmp_path) -> Path:
    """A copy of the trained run stopped after step 1 (step 2 removed), its demo set beside it."""
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    shutil.copytree(trained.parent / "data", tmp_path / "data")
    shutil.rmtree(copy / "checkpoints/step-000002")
    return copy


def rewrite_manifest(folder: Path) -> None:
    """The manifest of `folder` made to match its files again (as if the checkpoint had been written so)."""
    old = json.loads((folder / "manifest.json").read_text())
    checkpoint.write_manifest(folder, old["step"], old["meta"])


def as_old_checkpoint(folder: Path, wrap=None) -> Path:
    """Checkpoint `folder` as an earlier version wrote it: state.pt by torch.save (its state passed through `wrap`
    first, e.g. into a Payload), listed in the manifest."""
    state = checkpoint.load_state(folder)
    (folder / "state.safetensors").unlink()
    torch.save(wrap(state) if wrap else state, folder / "state.pt")
    rewrite_manifest(folder)
    return folder / "state.pt"


def assert_same_end(run: Path, reference: Path) -> None:
    a = load_file(str(run / "checkpoints/step-000002/model.safetensors"))
    b = load_file(str(reference / "checkpoints/step-000002/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = (checkpoint.load_state(r / "checkpoints/step-000002") for r in (run, reference))
    for i, st in sa["optimizer"]["state"].items():
        assert all(torch.equal(st[k], sb["optimizer"]["state"][i][k]) for k in ("exp_avg", "exp_avg_sq", "step"))


def assert_identical(a: object, b: object, where: str = "state") -> None:
    """Same types and values all the way down; tensors and arrays bitwise, NaN equal to NaN."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, float) and a != a:
        assert b != b, where
    else:
        assert a == b, where


# ---------------------------------------------------------------------------------------------------- state file
def test_state_file_round_trips_every_kind_of_value_bitwise(tmp_path):
    random.seed(3)
    np.random.seed(4)
    base = torch.randn(6, generator=torch.Generator().manual_seed(5))
    state = {
        "python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
        "by_index": {0: {"step": torch.tensor(3.0), "exp_avg": base}, 7: {"view": base[2:4]}},  # a view of base
        "groups": [{"betas": (0.9, 0.95), "lr": 1 / 3, "fused": None, "name": "ssm", "params": [0, 7]}],
        "odd keys": {"$tensor": 1, "plain": True}, "bf16": base.bfloat16(), "dtype": torch.bfloat16,
        "losses": [float("nan"), float("inf"), 0.1 + 0.2], "big": 2**70, "empty": torch.zeros(0, 3),
    }
    back = read_state(write_state(state, tmp_path / "state.safetensors"))
    assert_identical(back, state)
    random.setstate(back["python"])
    np.random.set_state(back["numpy"])  # the RNG states are accepted as they come back


def test_state_file_refuses_what_it_cannot_store_or_does_not_know(tmp_path):
    with pytest.raises(TypeError, match="Payload"):
        write_state({"x": Payload(tmp_path / "never")}, tmp_path / "a.safetensors")
    # a state file naming a tensor type outside the allow-list: refused before any import
    crafted = tmp_path / "state.safetensors"
    tree = {"$subclass": {"type": "subprocess.Popen", "tensors": {}, "attrs": [], "size": [], "stride": []}}
    save_file({"t0": torch.zeros(1)}, str(crafted), metadata={STATE_KEY: json.dumps({"x": tree})})
    with pytest.raises(UserError, match=r"state\.safetensors holds a training state this version cannot read .*"
                                        r"'subprocess\.Popen', which is not one of"):
        read_state(crafted)
    save_file({}, str(crafted), metadata={STATE_KEY: json.dumps({"x": {"$tensor": "t9"}})})
    with pytest.raises(UserError, match="names a tensor 't9' the file does not hold"):
        read_state(crafted)


# ---------------------------------------------------------------------------------------------------- state.pt
def test_old_state_pt_resumes_bitwise_and_is_converted_once(run_copy, trained, capsys):
    step1 = run_copy / "checkpoints/step-000001"
    as_old_checkpoint(step1)
    assert main(train_argv(run_copy, "--resume")) == 0
    assert not (step1 / "state.pt").exists() and (step1 / "state.safetensors").is_file()
    assert set(json.loads((step1 / "manifest.json").read_text())["files"]) == {
        "model.safetensors", "state.safetensors", "config.toml"}
    assert runs.verify_checkpoint(step1) == ""
    assert_same_end(run_copy, trained)


def test_crafted_state_pt_is_refused_and_read_only_with_the_flag(run_copy, trained, tmp_path, capsys):
    marker = tmp_path / "state-pt-ran"
    state_pt = as_old_checkpoint(run_copy / "checkpoints/step-000001", lambda state: Payload(marker, state))
    line = one_error_line(capsys, train_argv(run_copy, "--resume"), str(state_pt), "--trust-checkpoint",
                          "touch_and_return")
    assert line.startswith("tttv train: error: ")
    assert not marker.exists() and state_pt.is_file()  # nothing ran, nothing converted

    # the user trusts the file: it is unpickled (the marker shows it ran), converted once, and the run resumes
    assert main(train_argv(run_copy, "--resume", "--trust-checkpoint")) == 0
    assert marker.exists() and not state_pt.exists() and runs.verify_checkpoint(state_pt.parent) == ""
    assert_same_end(run_copy, trained)


# ---------------------------------------------------------------------------------------------------- DCP
def test_crafted_dcp_metadata_is_refused_on_resume(run_copy, tmp_path, capsys):
    marker = tmp_path / "dcp-metadata-ran"
    folder = run_copy / "checkpoints/step-000001"
    (folder / "dcp").mkdir()
    (folder / "dcp/.metadata").write_bytes(pickle.dumps(Payload(marker)))
    rewrite_manifest(folder)  # the manifest vouches for the file: intact is not safe
    one_error_line(capsys, train_argv(run_copy, "--resume"), str(folder / "dcp/.metadata"),
                   "'tests.test_security.touch_and_return'", "--trust-checkpoint")
    assert not marker.exists()


def sharded_checkpoint(folder: Path, lr: object = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A one-process DCP checkpoint in `folder`/dcp of the tiny model and its AdamW after one step; `lr` replaces
    the first group's learning rate in what is saved (a crafted value)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tttvideo.models import build_model
    from tttvideo.train.optim import build_optimizer

    cfg = load_config(DEMO, CHEAP)
    torch.manual_seed(0)
    model = build_model(cfg)
    optimizer = build_optimizer(model, cfg.train)
    for p in model.parameters():
        p.grad = torch.randn_like(p) if p.requires_grad else None
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if lr is not None:
        optim_sd["param_groups"][0]["lr"] = lr
    with warnings.catch_warnings():  # DCP says it assumes one process is meant: it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=folder / "dcp", no_dist=True)
    return model, optimizer


def fresh(seed: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from tttvideo.models import build_model
    from tttvideo.train.optim import build_optimizer

    cfg = load_config(DEMO, CHEAP)
    torch.manual_seed(seed)
    model = build_model(cfg)
    return model, build_optimizer(model, cfg.train)


def test_dcp_loads_without_unpickling_and_refuses_crafted_values(tmp_path):
    from tttvideo.train.dcp import load_sharded_checkpoint, read_dcp_metadata

    saved, saved_opt = sharded_checkpoint(tmp_path / "good")
    model, optimizer = fresh()
    load_sharded_checkpoint(tmp_path / "good", model, optimizer)
    for (name, a), b in zip(saved.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
    assert_identical(optimizer.state_dict(), saved_opt.state_dict())

    # a value of the state that unpickles into a call: refused, naming the folder and the value
    marker = tmp_path / "dcp-value-ran"
    sharded_checkpoint(tmp_path / "crafted", lr=Payload(marker, 1e-3))
    with pytest.raises(UserError, match=r"crafted/dcp \(its value optimizer\.param_groups\.\S+\.lr\) names "
                                        r"'tests\.test_security\.touch_and_return'.*--trust-checkpoint"):
        load_sharded_checkpoint(tmp_path / "crafted", *fresh())
    assert not marker.exists()
    model, optimizer = fresh()
    load_sharded_checkpoint(tmp_path / "crafted", model, optimizer, trust=True)
    assert marker.exists() and optimizer.param_groups[0]["lr"] == 1e-3

    # pathlib's classes are allowed (DCP records its checkpoint's path), their methods are not: protocol 4 names
    # Path.touch as ("pathlib", "Path.touch")
    touch = tmp_path / "touched-by-metadata"
    crafted = tmp_path / "crafted/dcp/.metadata"
    crafted.write_bytes(pickle.dumps(PathTouch(touch), protocol=4))
    with pytest.raises(UserError, match=r"names 'pathlib\.Path\.touch', which .* --trust-checkpoint"):
        read_dcp_metadata(crafted)
    assert not touch.exists()

    # metadata that points DCP at a data file outside its folder
    metadata = read_dcp_metadata(tmp_path / "good/dcp/.metadata")
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../outside.distcp"
    (tmp_path / "good/dcp/.metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UserError, match="names data files outside its folder"):
        load_sharded_checkpoint(tmp_path / "good", *fresh())


# ---------------------------------------------------------------------------------------------------- manifest
def test_checkpoint_without_manifest_checks_the_header_of_either_state_file(trained, tmp_path):
    folder = tmp_path / "legacy"
    shutil.copytree(trained / "checkpoints/step-000001", folder)
    (folder / "manifest.json").unlink()
    assert runs.verify_checkpoint(folder) == ""
    as_old = folder / "state.pt"
    torch.save(checkpoint.load_state(folder), as_old)
    (folder / "state.safetensors").unlink()
    assert runs.state_file(folder) == as_old and runs.verify_checkpoint(folder) == ""
    with open(as_old, "r+b") as f:
        f.truncate(1000)
    assert runs.verify_checkpoint(folder).startswith("state.pt: unreadable")


def test_manifest_naming_a_file_outside_the_checkpoint_is_refused(trained, tmp_path):
    outside = tmp_path / "secret.txt"
    outside.write_text("not for the manifest")
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    folder = run / "checkpoints/step-000002"
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["../../../secret.txt"] = {"size": outside.stat().st_size, "sha256": runs.file_digest(outside)}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert runs.verify_checkpoint(folder) == (
        "manifest.json: unreadable (it names '../../../secret.txt', a path outside the checkpoint folder)")
    assert runs.newest_intact_checkpoint(run, warn_once=False) == run / "checkpoints/step-000001"
