"""Checkpoints of a multi-process run, through torch.distributed.checkpoint (DCP).

The folder is the one-process checkpoint's (`tttvideo.train.checkpoint`): assembled in a temporary folder beside
the final one, its manifest written last, renamed into place by rank 0, pruned to the newest `keep`. It holds:

- `dcp/`: the optimizer state as every rank's shards (`get_optimizer_state_dict`, keyed by parameter name), which
  DCP can load into any other sharding: a run saved on N processes resumes on M, and on one process (DCP then
  reads every shard into the whole state, no process group needed); and the model's buffers (the codes and
  scales of fp8-stored frozen layers, which model.safetensors does not hold), so that a resume needs no other
  checkpoint;
- `model.safetensors`: the whole model's parameters, gathered to rank 0, so that `tttv sample`, `train.init_from`
  and every tool that reads a checkpoint's weights use it as they use a one-process one. A resume reads it into
  the model before FSDP shards it (`holds_model_state` false): the parameters are written once (their shards in
  dcp/ beside it made a two-GPU checkpoint of the 3-s stage 40.6 GiB against 27.2 on one GPU). A checkpoint whose
  dcp/ holds the model's shards too (written before) loads them from there;
- `state.safetensors` (rank 0): step, data position, scheduler, scaler, RNG and noise-generator states, counters;
  every rank holds the same ones (they draw the same random numbers), so rank 0's are every rank's;
- `config.toml` and `manifest.json` (with every file under `dcp/`).

Reading runs no code from the files. DCP's metadata file (`dcp/.metadata`) is a pickle, and DCP reads the
non-tensor values of the state (the optimizer's hyperparameters) with torch's full unpickler; here the metadata goes
through `SafeUnpickler`, which builds only the types a DCP metadata file holds (its dataclasses, torch.Size, dtypes,
paths), and the values through torch's weights-only unpickler (the tensors already do). A file that names anything
else is refused with a sentence naming it and --trust-checkpoint, which reads it with DCP's own reader (for a
checkpoint of a torch version whose metadata holds other types, from a source the user trusts).
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict, set_state_dict)

from tttvideo.errors import UserError
from tttvideo.parallel.launch import SharedError
from tttvideo.runs import TRUST_FLAG, is_inside_name
from tttvideo.train.checkpoint import publish_checkpoint, staging_folder
from tttvideo.train.statefile import refused_global

if TYPE_CHECKING:
    from tttvideo.models.backbone import BackboneConfig
    from tttvideo.models.backbone import Backbone
    from tttvideo.train.distributed import TrainRanks
    from tttvideo.train.ema import WeightAverage

DCP_DIR = "dcp"
BUFFERS = "buffers"  # dcp/'s key of the model's buffers


def is_sharded_checkpoint(folder: Path) -> bool:
    """Whether checkpoint `folder` was written by a multi-process run (its model and optimizer are in `dcp/`)."""
    return (Path(folder) / DCP_DIR / ".metadata").is_file()


class _WholeWeights:
    """The gathered state dict in the shape `tttvideo.models.save_checkpoint` reads a model in (named parameters,
    spec, use_ttt, sequence_layer): the sharded model's own parameters are DTensors."""

    def __init__(self, model: Backbone, tensors: dict[str, torch.Tensor]):
        self.spec: BackboneConfig = model.spec
        self.use_ttt: bool = model.use_ttt
        self.sequence_layer: str = model.sequence_layer
        # the sharded model's modules, so that save_checkpoint sees its fp8 layers (whose codes are buffers, not
        # saved) and marks the file partial: without it a file of an fp8-frozen run was taken as whole, and
        # sampling or init_from left the frozen layers as built, uninitialised
        self.modules = model.modules
        names = {n for n, _ in model.named_parameters()}
        self._tensors = {n: t for n, t in tensors.items() if n in names}

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._tensors.items())


def save_sharded_checkpoint(output_dir: str | Path, step: int, model: Backbone,
                            optimizer: torch.optim.Optimizer, state: dict[str, Any], config_text: str, keep: int,
                            meta: dict[str, Any], trained_duration_s: int | None, ranks: TrainRanks,
                            ema: WeightAverage | None = None) -> Path:
    """Write checkpoint `step` from every rank (a collective: all ranks call it) and return its folder; `ema`, the
    average of the sharded weights, gathered and written whole as a one-process run writes it."""
    with ranks.phase("checkpoint save", step - 1, slow=True):  # the watch counts steps from 0, as the loop
        tmp = ranks.on_main(lambda: staging_folder(output_dir, step))
        buffers = _buffers(model)
        dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer), **({BUFFERS: buffers} if buffers else {})},
                 checkpoint_id=tmp / DCP_DIR)
        whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        average = ema.whole(keep=ranks.is_main) if ema is not None else None
        return ranks.on_main(lambda: publish_checkpoint(output_dir, step, _WholeWeights(model, whole), state,
                                                        config_text, keep, meta, trained_duration_s, tmp,
                                                        ema=average))


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's persistent buffers by state-dict name (FSDP2 leaves them whole on every rank)."""
    names = {name for name, _ in model.named_buffers()}
    return {k: v for k, v in get_model_state_dict(model).items() if k in names}


def _metadata(folder: Path, trust: bool) -> dcp_metadata.Metadata:
    """DCP's metadata of checkpoint `folder`: through `read_dcp_metadata` (a UserError naming what it refuses), or
    with `trust` (--trust-checkpoint) DCP's own reader."""
    path = Path(folder) / DCP_DIR
    return FileSystemReader(path).read_metadata() if trust else read_dcp_metadata(path / METADATA_FILE)


def _holds_model(metadata: dcp_metadata.Metadata) -> bool:
    return any(key.startswith("model.") for key in metadata.state_dict_metadata)


def holds_model_state(folder: Path, trust: bool = False) -> bool:
    """Whether `dcp/` of checkpoint `folder` holds the model's shards (a checkpoint written before the model went
    into model.safetensors alone). True for metadata that cannot be read safely: `load_sharded_checkpoint` then
    says why."""
    try:
        return _holds_model(_metadata(folder, trust))
    except UserError:
        return True


def _saved_buffers(metadata: dcp_metadata.Metadata, model: torch.nn.Module, folder: Path) -> dict[str, torch.Tensor]:
    """The model's buffers to read from `dcp/` of checkpoint `folder`: those it saved. A model whose frozen layers
    are stored otherwise than when the checkpoint was written: fp8 codes wanted from a bf16 run's checkpoint come from
    its whole model file (read before, quantised as it loads), none to read here; a bf16 model resuming an fp8 run's
    checkpoint would keep its frozen layers as built (the file holds only what the run trained): one sentence."""
    buffers = _buffers(model)
    saved = {k.split(".", 1)[1] for k in metadata.state_dict_metadata if k.startswith(BUFFERS + ".")}
    if saved - set(buffers):
        raise UserError(f"{folder} was written by a run that stored its frozen weights in fp8 "
                        f"(model.frozen_weights = 'fp8'), which this config does not; resume it with that setting, or "
                        f"start a new stage from it with train.init_from = '{folder}'")
    return {k: v for k, v in buffers.items() if k in saved}


def load_sharded_checkpoint(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                            trust: bool = False) -> None:
    """Read `dcp/` of checkpoint `folder` into `optimizer` (and into `model` where it holds the model's shards;
    otherwise the caller read model.safetensors), sharded or not, whatever the number of processes that wrote it
    (a collective when distributed). Nothing is unpickled beyond the allow-lists unless `trust`
    (--trust-checkpoint); a refused file is a UserError naming it (a SharedError under torchrun: every rank reads
    the same file and refuses it)."""
    distributed = torch.distributed.is_initialized()
    path = Path(folder) / DCP_DIR
    try:  # the metadata is read once: for the layout, the buffers and (allow-listed) the reader
        metadata = _metadata(folder, trust)
        with_model = _holds_model(metadata)
        buffers = {} if with_model else _saved_buffers(metadata, model, folder)
    except UserError as err:
        raise (SharedError(str(err)) if distributed else err) from None
    if with_model:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        loaded = {"model": model_sd, "optimizer": optim_sd}
    else:
        loaded = {"optimizer": get_optimizer_state_dict(model, optimizer), **({BUFFERS: buffers} if buffers else {})}
    # the parameters whose state dcp/ holds ("optimizer.state.<name>.<key>"), against those this optimizer has
    saved = {k[len("optimizer.state."):].rsplit(".", 1)[0] for k in metadata.state_dict_metadata
             if k.startswith("optimizer.state.")}
    if saved:
        check_trained_parameters(folder, sorted(saved), sorted(loaded["optimizer"]["state"]))
    reader, planner = ((None, _DeviceLoadPlanner()) if trust
                       else (_SafeReader(path, metadata), _SafeLoadPlanner(path)))
    with warnings.catch_warnings():
        # on one process DCP reads every shard itself, and warns that it assumes this is meant: it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        try:
            dcp.load(loaded, checkpoint_id=path, storage_reader=reader, planner=planner, no_dist=not distributed)
        except CheckpointException:  # a BaseException: what a rank raised, wrapped
            if not isinstance(planner, _SafeLoadPlanner) or planner.refused is None:
                raise
            # the sentence is the planner's
            raise (SharedError if distributed else UserError)(planner.refused) from None
    if with_model:
        set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
    else:
        set_optimizer_state_dict(model, optimizer, loaded["optimizer"])
        if BUFFERS in loaded:
            set_model_state_dict(model, loaded[BUFFERS], options=StateDictOptions(strict=False))


def check_trained_parameters(folder: Path, saved: list, here: list) -> None:
    """The parameters whose optimizer state checkpoint `folder` holds against this optimizer's (the sizes of the
    parameter groups, or the parameters' names): other trainable parameters (another model.adapter, TTT layers on or
    off) cannot take its state. One sentence (every rank reads the same checkpoint: under torchrun rank 0 says it)."""
    if saved == here:
        return

    def count(tensors: list) -> int:
        return sum(tensors) if all(isinstance(n, int) for n in tensors) else len(tensors)

    before, now = count(saved), count(here)
    raise (SharedError if torch.distributed.is_initialized() else UserError)(
        f"{folder} holds the optimizer state of {before} trained tensors, this config trains {now}"
        + (" other ones" if before == now else "") + ": resume with the model settings the run was trained with "
        f"(model.adapter, the TTT layers), or start a new stage from it with train.init_from = '{folder}'")


def load_whole_optimizer_state(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                               whole: dict[str, Any]) -> None:
    """A one-process checkpoint's optimizer state (`whole`: keyed by parameter index, whole tensors, as
    `Optimizer.state_dict` gives it) into this run's optimizer, sharded or not: every rank copies its shard's part of
    each state tensor into the state the optimizer initialises, so the state also passes between train.optimizer
    kinds (AdamW's moments and torchao's 8-bit ones). Parameter i of the saved groups is parameter i of this
    optimizer's (both are built in the model's module order, `tttvideo.train.optim.param_groups`): the groups' sizes
    and every shape must agree. torchao's 8-bit moments are dequantised and quantised again in the shard's blocks of
    256 values, as a run on these processes groups them (a shard under 4096 values keeps plain moments there): the
    state then differs from the saved one by one 8-bit rounding, not more."""
    from tttvideo.parallel.shards import local, local_part

    sharded = get_optimizer_state_dict(model, optimizer)  # initialises the state: every tensor to copy into
    saved_groups, groups = whole["param_groups"], sharded["param_groups"]
    check_trained_parameters(folder, [len(g["params"]) for g in saved_groups], [len(g["params"]) for g in groups])
    for saved_group, group in zip(saved_groups, groups):
        group.update({k: v for k, v in saved_group.items() if k != "params" and k in group})
        for index, name in zip(saved_group["params"], group["params"]):
            saved, state = whole["state"].get(index, {}), sharded["state"].get(name, {})
            if saved and set(saved) != set(state):
                raise SharedError(f"{folder}'s optimizer state of {name} holds {sorted(saved)}, this run's "
                                  f"{sorted(state)}: resume with the train.optimizer the run was trained with")
            for key, value in saved.items():
                target = state[key]
                if type(value) is not torch.Tensor and hasattr(value, "dequantize"):  # torchao's 8-bit moments
                    value = value.dequantize()
                if tuple(value.shape) != tuple(target.shape):
                    raise SharedError(f"{folder}'s optimizer state of {name} has shape {tuple(value.shape)}, this "
                                      f"model's {tuple(target.shape)}: resume with the model settings the run was "
                                      f"trained with")
                with torch.no_grad():
                    local(target).copy_(local_part(value, target).to(target.device))
    set_optimizer_state_dict(model, optimizer, sharded)


# ---------------------------------------------------------------------------------------------------- safe reading
METADATA_FILE = ".metadata"
_PATHS = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}


def _refusal(path: Path | str, what: str) -> str:
    return (f"{path} names {what}, which a checkpoint's DCP files do not hold, so reading it could run code it "
            f"holds; pass {TRUST_FLAG} only if you trust where the checkpoint came from")


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle named a global outside the allow-list; the message is its name, quoted."""


class SafeUnpickler(pickle.Unpickler):
    """An unpickler that builds only what a DCP metadata file holds: the dataclasses and enums of
    torch.distributed.checkpoint.metadata, DCP's _StorageInfo, torch.Size, torch dtypes, layouts and memory
    formats, and paths. Every other global is refused (pickle's documented way to restrict unpickling: every
    callable an opcode can reach comes through find_class); a dotted name (an attribute of a class) is refused too."""

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name and _allowed(module, name):
            return super().find_class(module, name)
        raise RefusedGlobal(f"'{module}.{name}'")


def _allowed(module: str, name: str) -> bool:
    # looked up in the module's own namespace: getattr could trigger torch's lazy imports of submodules
    if module == "torch":
        return name == "Size" or isinstance(vars(torch).get(name), (torch.dtype, torch.layout, torch.memory_format))
    if module == "torch.serialization":
        return name == "_get_layout"  # a layout by its name, looked up among torch's layouts
    if module == "torch.distributed.checkpoint.metadata":
        found = vars(dcp_metadata).get(name)
        return isinstance(found, type) and found.__module__ == module and (
            dataclasses.is_dataclass(found) or issubclass(found, enum.Enum))
    if module == "torch.distributed.checkpoint.filesystem":
        return name == "_StorageInfo"
    return module == "pathlib" and name in _PATHS


def read_dcp_metadata(path: Path) -> dcp_metadata.Metadata:
    """DCP's metadata file `path`, read with `SafeUnpickler`; its data files must lie beside it. A UserError naming
    the file when it names anything else, or is not a DCP metadata file."""
    try:
        with open(path, "rb") as f:
            metadata = SafeUnpickler(f).load()
    except RefusedGlobal as err:
        raise UserError(_refusal(path, str(err))) from None
    except pickle.UnpicklingError as err:
        raise UserError(f"{path} is not a readable DCP metadata file ({err}); resume from another checkpoint") from None
    except OSError as err:
        raise UserError(f"{path} cannot be read ({err.strerror or err}); resume from another checkpoint") from None
    except Exception as err:  # an allowed type built from arguments it does not take
        raise UserError(f"{path} is not a readable DCP metadata file ({type(err).__name__}: {err}); resume from "
                        f"another checkpoint") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UserError(f"{path} is not a DCP metadata file (it holds a {type(metadata).__name__}); resume from "
                        f"another checkpoint")
    storage = metadata.storage_data
    if not isinstance(storage, dict) or not all(
            isinstance(info, _StorageInfo) and is_inside_name(info.relative_path) and "/" not in info.relative_path
            for info in storage.values()):
        raise UserError(f"{path} names data files outside its folder, which tttv never writes; resume from another "
                        f"checkpoint")
    if metadata.storage_meta is None:
        metadata.storage_meta = dcp_metadata.StorageMeta()
    return metadata


class _SafeReader(FileSystemReader):
    """DCP's file reader with the metadata `read_dcp_metadata` read (DCP's own would unpickle it unrestricted)."""

    def __init__(self, path: Path, metadata: dcp_metadata.Metadata):
        super().__init__(path)
        self._safe_metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        metadata = (self._safe_metadata if rank is None
                    else read_dcp_metadata(Path(self.path) / f"__{rank}{METADATA_FILE}"))
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _DeviceLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, for targets that cannot copy from host memory: DCP reads every tensor into host memory and
    copies it into its target, and a tensor subclass on a GPU may refuse a host source (torchao's 8-bit optimizer
    state quantises a plain source with its code map, which is on the GPU: "found at least two devices"; a
    one-process resume on a GPU of a checkpoint written by two failed so). Such a target is read into a host copy of
    itself (the same subclass: a plain source is quantised there, a quantised one copied code for code), which then
    goes to the target subclass to subclass, as exact as the copy it replaces."""

    def __init__(self) -> None:
        super().__init__()
        self._staged: dict[int, torch.Tensor] = {}

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        target = super().resolve_tensor(read_item)
        if type(target) is torch.Tensor or target.device.type == "cpu":
            return target
        self._staged[id(read_item)] = target
        return target.detach().to("cpu")

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        target = self._staged.pop(id(read_item), None)
        if target is not None:
            target.copy_(tensor)
        super().commit_tensor(read_item, tensor)


class _SafeLoadPlanner(_DeviceLoadPlanner):
    """DCP's load planner, reading the state's non-tensor values (the optimizer's hyperparameters) with torch's
    weights-only unpickler; `refused` holds the sentence for a value it refused."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder
        self.refused: str | None = None

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            self.refused = _refusal(f"{self.folder} (its value {read_item.dest_index.fqn})", refused_global(str(err)))
            raise
        # DefaultLoadPlanner places the value where it belongs; it unpickles again, so it gets our own pickle of
        # what the weights-only read built
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        buffer.seek(0)
        super().load_bytes(read_item, buffer)
