"""Results files of measurements (the benchmarks in benchmarks/, their profiles and reports).

Each is written atomically (`tttvideo.outputs.atomic_target`: a temporary name renamed over the final one),
so a benchmark killed mid-write, or a machine taken back, leaves the last whole file, never a truncated one that the
next run's merge would fail to read. Where $OUT is set (the lent GPU machines return only what is under it), a copy
goes there as well, under the file's own name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tttvideo.outputs import atomic_target


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_target(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def save_text(path: str | Path, text: str) -> Path:
    """Write `text` to `path` atomically (folders created) and copy it to $OUT when set; returns the path."""
    path = Path(path)
    _write(path, text)
    out_dir = os.environ.get("OUT")
    if out_dir:
        copy = Path(out_dir) / path.name
        if copy.resolve() != path.resolve():
            _write(copy, text)
    return path


def save_json(path: str | Path, data: Any) -> Path:
    """`data` as indented JSON (one space a level, a final newline), through `save_text`."""
    return save_text(path, json.dumps(data, indent=1) + "\n")
