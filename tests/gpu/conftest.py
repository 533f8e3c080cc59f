"""Every test under tests/gpu carries the `gpu` marker (registered in pyproject.toml): `pytest -m gpu` runs them on a
device, `pytest -m "not gpu"` leaves them out. Each file still skips itself where there is no CUDA device."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    # a conftest's collection hook sees the whole session's items: mark only those collected from this folder
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.gpu)
