"""Device selection shared by every command."""

from __future__ import annotations

import torch

from tttvideo.errors import UserError


def resolve_device(name: str, field: str = "device") -> torch.device:
    """'auto' -> cuda when visible, else cpu; asking for cuda without one is a one-sentence error naming `field`
    (the config key or flag the value came from)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"{field} is {name!r} but no CUDA device is visible; use 'cpu' or 'auto'")
    return torch.device(name)
