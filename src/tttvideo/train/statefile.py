"""The training state on disk (a checkpoint's state.safetensors): optimizer, LR scheduler, grad scaler, RNG and
noise-generator states, step, data position and counters. Every tensor is a safetensors tensor and everything else
is JSON in the file's metadata, so reading a state back builds data and nothing else: a state someone sent us
cannot run code (torch.save's pickle runs whatever callable a crafted file names).

JSON lacks some of what the state holds; each is written as an object with one "$" key:

    {"$tensor": "t12"}                   a tensor of the file, by its name
    {"$tuple": [...]}                    a tuple (the Python RNG state, AdamW's betas)
    {"$dict": [[key, value], ...]}       a dict whose keys are not all strings (optimizer state by parameter index)
    {"$ndarray": {dtype, shape, data}}   a numeric numpy array (numpy's RNG state)
    {"$dtype": "bfloat16"}               a torch dtype
    {"$subclass": {type, tensors, attrs, size, stride}}   an allow-listed tensor subclass, by its inner tensors

A plain object never has a key starting with "$" (such a dict is written as "$dict"), so reading is unambiguous.
The tensor subclasses are those of torchao's 8-bit AdamW state (`tttvideo.train.optim`), rebuilt with their own
`__tensor_unflatten__` from plain tensors; a file naming any other type is refused.

Checkpoints of earlier versions hold state.pt (torch.save). `read_legacy_state` reads one with torch's weights-only
unpickler and the numpy types of the RNG state allowed, which builds data only too; a file that needs more is read
with the full unpickler only when the user passes --trust-checkpoint.
"""

from __future__ import annotations

import importlib
import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tttvideo.errors import UserError
from tttvideo.runs import TRUST_FLAG

STATE_KEY = "tttvideo.training_state"  # the safetensors metadata entry holding the JSON
STATE_FORMAT = "1"

# tensor subclasses a state may hold, by module and class name: torchao's 8-bit optimizer state
SUBCLASSES = {
    "torchao.optim.subclass_8bit.OptimState8bit": ("torchao.optim.subclass_8bit", "OptimState8bit"),
}


class StateFormatError(ValueError):
    """The JSON of a state file is not one `write_state` writes."""


# ---------------------------------------------------------------------------------------------------- writing
class _Encoder:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._storages: set[tuple[str, int]] = set()

    def tensor(self, t: torch.Tensor) -> dict[str, str]:
        name = f"t{len(self.tensors)}"
        t = t.detach()
        if t.numel():
            # safetensors refuses two tensors on one storage; a view of another state tensor is copied
            where = (str(t.device), t.untyped_storage().data_ptr())
            if where in self._storages:
                t = t.clone()
            self._storages.add((str(t.device), t.untyped_storage().data_ptr()))
        self.tensors[name] = t.contiguous()
        return {"$tensor": name}

    def encode(self, x: Any) -> Any:
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, torch.Tensor):
            if type(x) in (torch.Tensor, torch.nn.Parameter):
                return self.tensor(x)
            return self.subclass(x)
        if isinstance(x, tuple):
            return {"$tuple": [self.encode(v) for v in x]}
        if isinstance(x, list):
            return [self.encode(v) for v in x]
        if isinstance(x, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in x):
                return {k: self.encode(v) for k, v in x.items()}
            return {"$dict": [[self.encode(k), self.encode(v)] for k, v in x.items()]}
        if isinstance(x, np.ndarray) and x.dtype.kind in "biuf":
            return {"$ndarray": {"dtype": x.dtype.str, "shape": list(x.shape), "data": x.ravel().tolist()}}
        if isinstance(x, torch.dtype):
            return {"$dtype": str(x).removeprefix("torch.")}
        raise TypeError(f"the training state holds a {type(x).__module__}.{type(x).__qualname__}, which "
                        f"state.safetensors cannot store")

    def subclass(self, t: torch.Tensor) -> dict[str, Any]:
        name = f"{type(t).__module__}.{type(t).__qualname__}"
        if name not in SUBCLASSES:
            raise TypeError(f"the training state holds a tensor of type {name}, which state.safetensors cannot store "
                            f"(allowed subclasses: {', '.join(SUBCLASSES)})")
        inner, attrs = t.__tensor_flatten__()  # type: ignore[attr-defined]
        return {"$subclass": {"type": name, "tensors": {n: self.encode(getattr(t, n)) for n in inner},
                              "attrs": self.encode(attrs), "size": list(t.shape), "stride": list(t.stride())}}


def write_state(state: dict[str, Any], path: str | Path) -> Path:
    """Write the training state `state` to `path` (a safetensors file; the caller makes the write atomic)."""
    from tttvideo.tensorfile import write_safetensors

    encoder = _Encoder()
    tree = encoder.encode(state)
    write_safetensors(encoder.tensors, path, {STATE_KEY: json.dumps(tree), "format": STATE_FORMAT})
    return Path(path)


# ---------------------------------------------------------------------------------------------------- reading
def _decode(x: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(x, list):
        return [_decode(v, tensors) for v in x]
    if not isinstance(x, dict):
        return x
    tags = [k for k in x if k.startswith("$")]
    if not tags:
        return {k: _decode(v, tensors) for k, v in x.items()}
    if len(x) != 1:
        raise StateFormatError(f"an object mixes the tag {tags[0]!r} with other keys")
    tag, value = tags[0], x[tags[0]]
    if tag == "$tensor":
        if not isinstance(value, str) or value not in tensors:
            raise StateFormatError(f"it names a tensor {value!r} the file does not hold")
        return tensors[value]
    if tag == "$tuple":
        return tuple(_decode(_expect(value, list, tag), tensors))
    if tag == "$dict":
        pairs = _expect(value, list, tag)
        if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
            raise StateFormatError("a $dict entry is not a [key, value] pair")
        try:
            return {_decode(k, tensors): _decode(v, tensors) for k, v in pairs}
        except TypeError as err:  # an unhashable key
            raise StateFormatError(f"a $dict key is not hashable ({err})") from None
    if tag == "$ndarray":
        spec = _expect(value, dict, tag)
        try:
            dtype = np.dtype(spec["dtype"])
            if dtype.kind not in "biuf":
                raise StateFormatError(f"an array of dtype {dtype} (only numbers are stored)")
            return np.asarray(spec["data"], dtype=dtype).reshape(spec["shape"])
        except (KeyError, TypeError, ValueError) as err:
            raise StateFormatError(f"a malformed $ndarray ({err})") from None
    if tag == "$dtype":
        dtype = getattr(torch, _expect(value, str, tag), None)
        if not isinstance(dtype, torch.dtype):
            raise StateFormatError(f"{value!r} is not a torch dtype")
        return dtype
    if tag == "$subclass":
        return _subclass(_expect(value, dict, tag), tensors)
    raise StateFormatError(f"unknown tag {tag!r}")


def _expect(value: Any, kind: type, tag: str) -> Any:
    if not isinstance(value, kind):
        raise StateFormatError(f"{tag} holds a {type(value).__name__}, not a {kind.__name__}")
    return value


def _subclass(spec: dict[str, Any], tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    name = spec.get("type")
    if name not in SUBCLASSES:
        raise StateFormatError(f"it names the tensor type {name!r}, which is not one of {', '.join(SUBCLASSES)}")
    module, cls_name = SUBCLASSES[name]
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except ImportError:
        raise UserError(f"the training state holds {cls_name} tensors (train.optimizer = 'adamw8bit'), which need "
                        f"torchao: pip install torchao") from None
    inner = _decode(spec.get("tensors"), tensors)
    if not isinstance(inner, dict) or not all(isinstance(t, torch.Tensor) for t in inner.values()):
        raise StateFormatError(f"the inner tensors of a {cls_name} are malformed")
    attrs = _decode(spec.get("attrs"), tensors)
    try:
        return cls.__tensor_unflatten__(inner, attrs, torch.Size(spec.get("size", ())), tuple(spec.get("stride", ())))
    except (AssertionError, KeyError, TypeError, ValueError, RuntimeError) as err:
        raise StateFormatError(f"a {cls_name} could not be rebuilt ({type(err).__name__}: {err})") from None


def read_state(path: str | Path) -> dict[str, Any]:
    """The training state in `path` (written by `write_state`); a UserError naming the file when it is not one."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as err:  # safetensors has its own error types for damaged headers and short files
        raise UserError(f"{path} is not a readable safetensors file ({err}); resume from another checkpoint") from None
    if STATE_KEY not in meta:
        raise UserError(f"{path} holds no training state (no {STATE_KEY!r} in its metadata); resume from a "
                        f"checkpoint tttv train wrote")
    try:
        state = _decode(json.loads(meta[STATE_KEY]), tensors)
    except (ValueError, RecursionError) as err:  # StateFormatError, json's errors
        raise UserError(f"{path} holds a training state this version cannot read ({err}); resume from a "
                        f"checkpoint tttv train wrote") from None
    if not isinstance(state, dict):
        raise UserError(f"{path} holds a training state this version cannot read (not a dict); resume from a "
                        f"checkpoint tttv train wrote")
    return state


# ---------------------------------------------------------------------------------------------------- state.pt
def _numpy_globals() -> list[Any]:
    """What a torch.save'd numpy array (numpy's RNG state) names, under numpy 2's and numpy 1's module paths."""
    reconstruct = np.core.multiarray._reconstruct if not hasattr(np, "_core") else np._core.multiarray._reconstruct
    found: list[Any] = [np.ndarray, np.dtype, (reconstruct, "numpy.core.multiarray._reconstruct"),
                        (reconstruct, "numpy._core.multiarray._reconstruct")]
    dtypes = getattr(np, "dtypes", None)  # numpy >= 1.25 pickles a dtype by its class
    if dtypes is not None:
        found += [getattr(dtypes, n) for n in ("UInt32DType", "Int64DType", "Float64DType") if hasattr(dtypes, n)]
    return found


def _torchao_globals(path: Path) -> list[Any]:
    """The allow-listed tensor subclasses `path` names (an 8-bit AdamW state), imported so that torch can rebuild
    them; [] when it names none."""
    try:
        named = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # a damaged file: torch.load says what is wrong below
        return []
    found = []
    for name, (module, cls_name) in SUBCLASSES.items():
        if name in named:
            try:
                found.append(getattr(importlib.import_module(module), cls_name))
            except ImportError:
                pass  # the weights-only load then names the type it refused
    return found


def read_legacy_state(path: str | Path, trust: bool) -> dict[str, Any]:
    """A state.pt of an earlier version: read with torch's weights-only unpickler (tensors, Python containers and
    numbers, numpy arrays, torchao's 8-bit state); a file that needs anything else is a UserError naming it and
    TRUST_FLAG, or, with `trust`, read with the full unpickler."""
    path = Path(path)
    try:
        with torch.serialization.safe_globals([*_numpy_globals(), *_torchao_globals(path)]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if not trust:
            named = refused_global(str(err))
            raise UserError(f"{path} is a training state in the old pickle format that names {named}, so reading it "
                            f"could run any code it holds; pass {TRUST_FLAG} only if you trust where it came from "
                            f"(it is then converted to the safe state.safetensors once)") from None
    return torch.load(path, map_location="cpu", weights_only=False)


def refused_global(message: str) -> str:
    """The global torch's weights-only unpickler refused, from its message ("Unsupported global: GLOBAL x.y ...")."""
    for marker in ("GLOBAL ", "global "):
        at = message.find(marker)
        if at >= 0:
            word = message[at + len(marker):].split()[0].strip("'\"`.,;:")
            if word:
                return f"'{word}'"
    return "a type outside the allow-list"
