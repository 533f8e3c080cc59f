"""The scripts under benchmarks/ loaded afresh by path, for the tests that run them on the CPU (each test gets its own
copy of the module, so that what one test changes in it another does not see)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py, executed afresh as a module named `name`."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there while the class is made
    spec.loader.exec_module(module)
    return module
