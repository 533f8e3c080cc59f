"""`tttv convert --from ttt-video-dit`: a reference-system checkpoint as one of our run folders.

The run folder holds one checkpoint, step 0, laid out as `tttv train` writes them (`tttvideo.runs`):
model.safetensors in our names and shapes, the config (the detected preset and TTT kind, and
`ttt.eta_layout = "reference"`, the learning-rate layout the weights were trained with), a state.safetensors that
marks the checkpoint as imported (it has no optimizer to resume), and the manifest, written last. The folder is
assembled under a temporary name beside RUN and renamed into place, so it appears whole or not at all.

`tttv sample --checkpoint RUN` samples from it; `tttv train` continues from it with `train.init_from = RUN` (a new
optimizer), best with RUN's config.toml as the config, so that the eta layout and sizes carry over.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from tttvideo.config.loader import dump_toml
from tttvideo.config.schema import Config
from tttvideo.convert import ttt_video_dit as ref
from tttvideo.convert.sources import Checkpoint, open_checkpoint
from tttvideo.errors import UserError
from tttvideo.models import PRESETS, CogVideoXTTT, ModelSpec, save_checkpoint
from tttvideo.runs import CONFIG_FILE, MODEL_FILE, STATE_FILE, checkpoint_root
from tttvideo.train.statefile import write_state
from tttvideo.ttt.eta_layout import REFERENCE

IMPORTED_KEY = "imported"  # in state.safetensors: what the checkpoint was imported from (no training state to resume)


@dataclasses.dataclass
class _Weights:
    """What `save_checkpoint` reads of a model: named parameters, spec, use_ttt, sequence_layer."""

    spec: ModelSpec
    tensors: dict[str, torch.Tensor]
    use_ttt: bool = True
    sequence_layer: str = "ttt"

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors.items())


def expected_shapes(spec: ModelSpec, kind: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Reference name -> (our name, the reference's shape) of every parameter of our model of `spec` with TTT of
    `kind` (built on the meta device: no memory)."""
    from tttvideo.config.schema import TTTConfig

    with torch.device("meta"):
        model = CogVideoXTTT(spec, TTTConfig(kind=kind), use_ttt=True)
    ours = {n: tuple(p.shape) for n, p in model.named_parameters()}
    names = {o: r for r, o in ref.name_map(spec.num_layers).items()}
    unmapped = sorted(set(ours) - set(names))
    if unmapped:  # a parameter of ours the map does not cover: a bug here, not a user mistake
        raise RuntimeError(f"no ttt-video-dit name for our parameter(s) {', '.join(unmapped[:5])}")
    return {names[o]: (o, ref.reference_shape(o, shape)) for o, shape in ours.items()}


def _problems(stored: dict[str, tuple[int, ...]], expected: dict[str, tuple[str, tuple[int, ...]]]) -> list[str]:
    """What keeps `stored` (reference name -> shape) from being this model, most telling first."""
    out = [f"key {k!r} is missing" for k in expected if k not in stored]
    out += [f"key {k!r} has shape {list(stored[k])}, expected {list(expected[k][1])}"
            for k in expected if k in stored and stored[k] != expected[k][1]]
    out += [f"key {k!r} is not a parameter of this model" for k in stored if k not in expected]
    return out


def match_preset(ckpt: Checkpoint) -> tuple[ModelSpec, str, dict[str, str], dict[str, tuple[str, tuple[int, ...]]]]:
    """(spec, TTT kind, stored key -> reference name, expected shapes) of the preset the checkpoint's model
    parameters fit exactly; a UserError naming the first key that does not fit the closest preset otherwise."""
    keys = ref.model_keys(list(ckpt.shapes))
    if not keys:
        raise UserError(f"{ckpt.path} holds no parameter of a {ref.SOURCE_NAME} model (no key starts with 'dit.' or "
                        f"'model.dit.'); point at the model checkpoint its training wrote")
    stored_name = ref.strip_prefix(keys)
    stored = {stored_name[k]: ckpt.shapes[k] for k in keys}
    kind = ref.ttt_kind(list(stored))
    best: tuple[int, str, list[str]] | None = None
    for name, spec in PRESETS.items():
        expected = expected_shapes(spec, kind)
        problems = _problems(stored, expected)
        if not problems:
            return spec, kind, stored_name, expected
        if best is None or len(problems) < best[0]:
            best = (len(problems), name, problems)
    assert best is not None
    count, name, problems = best
    more = f" (and {count - 1} more)" if count > 1 else ""
    raise UserError(f"{ckpt.path} does not fit any model preset: {problems[0]}{more} for the closest, "
                    f"{name!r} with TTT-{kind}; convert a complete {ref.SOURCE_NAME} model checkpoint of one of "
                    f"{', '.join(PRESETS)}")


def convert_ttt_video_dit(source: str | Path, out: str | Path, cfg: Config, trust: bool = False,
                          trained_duration_s: int | None = None) -> Path:
    """Write run folder `out` from the reference-system checkpoint `source` (see the module docstring); `cfg` is
    the config to save, whose model and TTT keys are set from the checkpoint. Returns the checkpoint folder."""
    source, out = Path(source), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} already exists and is not empty; give a new folder for the run")
    ckpt = open_checkpoint(source, trust)
    spec, kind, stored_name, expected = match_preset(ckpt)
    tensors = ckpt.read(list(stored_name))
    ours = {}
    for key, tensor in tensors.items():
        our_name = expected[stored_name[key]][0]
        ours[our_name] = ref.to_ours(our_name, tensor).contiguous()

    cfg = copy.deepcopy(cfg)
    cfg.model.preset, cfg.model.pretrained_path = spec.name, ""
    cfg.model.use_ttt, cfg.model.sequence_layer = True, "ttt"
    cfg.ttt.kind, cfg.ttt.eta_layout = kind, REFERENCE
    cfg.train.output_dir = str(out)
    if trained_duration_s is not None:
        cfg.layout.duration = f"{trained_duration_s}s"

    from tttvideo import __version__
    from tttvideo.train.checkpoint import write_manifest

    tmp = out.parent / f".tmp-convert-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    folder = checkpoint_root(tmp) / "step-000000"
    try:
        folder.mkdir(parents=True)
        save_checkpoint(_Weights(spec, ours), folder / MODEL_FILE, trained_duration_s=trained_duration_s)
        write_state({IMPORTED_KEY: {"from": ref.SOURCE_NAME, "source": str(source)}}, folder / STATE_FILE)
        (folder / CONFIG_FILE).write_text(dump_toml(cfg), encoding="utf-8")
        write_manifest(folder, 0, {IMPORTED_KEY: ref.SOURCE_NAME, "source": str(source), "tttvideo": __version__,
                                   "torch": torch.__version__})
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"cannot write the run folder {out} ({err.strerror or err}); give --out a folder on a "
                        f"writable disk with room for the model") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return checkpoint_root(out) / "step-000000"
