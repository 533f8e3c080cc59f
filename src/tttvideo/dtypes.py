"""The dtype names configs and flags use ("fp32", "bf16", "fp16") and the torch dtypes they stand for."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """"bf16" -> torch.bfloat16; a torch.dtype passes through. Config values are checked against the schema's
    choices before they get here, so an unknown name is a programming error."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r}; one of {', '.join(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bf16"."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"{dtype} has no config name; one of {', '.join(DTYPES)}")


def sampling_dtype(model_dtype: str, sample_dtype: str, cuda: bool) -> str:
    """The dtype the sampler builds the model in: `sample.dtype`, where "auto" is bf16 on a CUDA device for a
    model.dtype of fp32 (the stage configs' master weights; the sampler runs no autocast, so fp32 weights make every
    product fp32: a 63-s Wan guided step took 292 s in fp32 against 41 s in bf16 on an H200) and model.dtype
    otherwise (a CPU keeps it: the tests and the demo compare fp32 results)."""
    if sample_dtype != "auto":
        return sample_dtype
    return "bf16" if cuda and model_dtype == "fp32" else model_dtype
