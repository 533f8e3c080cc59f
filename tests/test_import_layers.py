"""No module of tttvideo imports from a layer above its own.

Layers, lowest first; a module may import from its own layer and the ones below it. Every `import` and
`from ... import` counts, wherever it stands: at the top, inside a function, under `if TYPE_CHECKING:` (a type
named from a higher layer is still a dependency on it). Relative imports are resolved against the importing module.

Names are module paths below `tttvideo` ("" is the package itself); the longest entry that is the module or one of
its parents decides its layer, so a package can be split between layers module by module. The package's
`__version__` is metadata that any layer may read.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "tttvideo"
SRC = Path(__file__).resolve().parents[1] / "src" / PACKAGE

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # what every layer may use: errors, config, layout arithmetic, devices and dtypes, the diffusion schedule, and
    # the process-group plumbing the model's layers are handed (the sequence shards, the device mesh, the group
    # start, the launcher and the liveness watch it sets up); the run-folder locks; weight initialisation; the
    # safetensors writer of model and state files; the writer of measurements' results files
    ("base", ("errors", "locks", "outputs", "results", "device", "dtypes", "initializers", "config", "layout", "rope",
              "diffusion", "parallel.sequence", "parallel.mesh", "parallel.group", "parallel.launch",
              "parallel.watchdog", "tensorfile", "ffmpeg")),
    # the long-range layers: TTT and the baselines beside it, which share its gated bidirectional wrapper
    ("ttt", ("ttt", "sequence")),
    # FSDP sharding walks the model's blocks, and the parallel package's __init__ imports it
    ("models", ("models", "parallel", "parallel.fsdp")),
    # reading run folders (the model file, the newest intact checkpoint, what a --checkpoint path names): it reads
    # model files' metadata, and sample and train both use it
    ("runs", ("runs",)),
    ("text", ("text",)),
    ("data", ("data",)),
    # what train and sample call at run time (the allocator cap, the out-of-memory explanation) and the memory
    # techniques they, the planner and the profiler read
    ("memory runtime", ("memory.guard", "memory.techniques")),
    ("sample", ("sample",)),
    ("train", ("train",)),
    # importers of other systems' checkpoints: they write run folders as the trainer does (its manifest writer)
    ("convert", ("convert",)),
    # the planner and the profiler (which drives train and sample); the studies run the profiler over variants and
    # over diffusers' pipelines
    ("memory tools", ("memory", "memory.plan", "memory.profile")),
    ("memory studies", ("memory.studies",)),
    ("api", ("", "api")),
    ("cli", ("cli", "__main__")),
]
RANK = {entry: rank for rank, (_, entries) in enumerate(LAYERS) for entry in entries}


def module_name(path: Path) -> str:
    """src/tttvideo/data/demo.py -> "data.demo"; a package's __init__.py is the package."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int | None:
    """The rank of the longest LAYERS entry that is `module` or a parent package of it; None when none is."""
    parts = module.split(".") if module else []
    for n in range(len(parts), -1, -1):
        rank = RANK.get(".".join(parts[:n]))
        if rank is not None and (n > 0 or not module):
            return rank
    return None


def imported_modules(path: Path, module: str, src: Path = SRC) -> list[tuple[int, str]]:
    """(line, module below tttvideo) of every import of a tttvideo module in the file, at any depth."""
    parts = module.split(".") if module else []
    package = parts if path.name == "__init__.py" else parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the importing module's package, one level up per extra dot
                base = [PACKAGE, *package[: len(package) - node.level + 1]]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from pkg import sub` imports the module pkg.sub when there is one, else a name defined in pkg
            targets = [_submodule_or(stem, alias.name, src) for alias in node.names
                       if (stem, alias.name) != (PACKAGE, "__version__")]
        else:
            continue
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                found.append((node.lineno, target[len(PACKAGE) + 1 :]))
    return sorted(set(found))


def _submodule_or(stem: str, name: str, src: Path) -> str:
    if stem == PACKAGE or stem.startswith(PACKAGE + "."):
        rel = Path(*stem.split(".")[1:], name)
        if (src / rel).with_suffix(".py").is_file() or (src / rel / "__init__.py").is_file():
            return f"{stem}.{name}"
    return stem


def _dotted(module: str) -> str:
    return f"{PACKAGE}.{module}" if module else PACKAGE


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def test_every_module_has_a_layer():
    unplaced = sorted(_dotted(m) for m in all_modules() if layer_of(m) is None)
    assert not unplaced, f"modules in no layer (add them to LAYERS deliberately): {unplaced}"


def test_no_import_goes_to_a_higher_layer():
    upward = []
    for module, path in all_modules().items():
        own = layer_of(module)
        if own is None:
            continue
        for line, target in imported_modules(path, module):
            rank = layer_of(target)
            if rank is not None and rank > own:
                upward.append(f"{_dotted(module)} ({LAYERS[own][0]}) line {line} imports {_dotted(target)} "
                              f"({LAYERS[rank][0]})")
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_no_backbone_imports_another():
    """What two backbones share lives beside them in models/ (models.layers, attention, checkpointing...), so a
    backbone's folder never reaches into another's."""
    backbones = {p.parent.name for p in (SRC / "models").glob("*/__init__.py") if p.parent.name != "parallel"}
    crossing = []
    for module, path in all_modules().items():
        parts = _dotted(module).split(".")
        if len(parts) < 3 or parts[1] != "models" or parts[2] not in backbones:
            continue
        for line, target in imported_modules(path, module):
            other = _dotted(target).split(".")
            if len(other) > 2 and other[1] == "models" and other[2] in backbones and other[2] != parts[2]:
                crossing.append(f"{_dotted(module)} line {line} imports {_dotted(target)}")
    assert len(backbones) >= 2 and not crossing, crossing


def test_the_walker_sees_relative_function_level_and_type_checking_imports(tmp_path):
    src = tmp_path / PACKAGE
    (src / "data").mkdir(parents=True)
    (src / "__init__.py").write_text("")
    (src / "data" / "__init__.py").write_text("")
    (src / "data" / "demo.py").write_text("")
    (src / "data" / "x.py").write_text("from . import demo\nfrom ..sample import video\n"
                                       "def f():\n    import tttvideo.train.trainer\n"
                                       "if TYPE_CHECKING:\n    from tttvideo import __version__, cli\n")
    found = imported_modules(src / "data" / "x.py", "data.x", src)
    assert found == [(1, "data.demo"), (2, "sample"), (4, "train.trainer"), (6, "")]
    assert layer_of("data.demo") < layer_of("sample") < layer_of("train.trainer")


def unit_of(module: str) -> str | None:
    """The LAYERS entry that places `module` (the longest that is it or a parent): the unit cycles are counted
    between."""
    parts = module.split(".") if module else []
    for n in range(len(parts), -1, -1):
        entry = ".".join(parts[:n])
        if entry in RANK and (n > 0 or not module):
            return entry
    return None


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of `graph`: its strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def import_cycles(level: str) -> list[list[str]]:
    """Cycles of imports (every import counts, lazy and TYPE_CHECKING ones included) between units ("unit": the
    LAYERS entries, so that memory.guard and memory.profile are apart) or between top-level packages ("package")."""
    graph: dict[str, set[str]] = {}
    for module, path in all_modules().items():
        key = unit_of(module) if level == "unit" else module.split(".")[0]
        for _, target in imported_modules(path, module):
            other = unit_of(target) if level == "unit" else target.split(".")[0]
            if key is not None and other is not None and other != key:
                graph.setdefault(key, set()).add(other)
    return strongly_connected(graph)


# The cycles that remain, each with its reason (docs/design.md, "Import layers", says the same). Between units:
EXPLAINED_UNIT_CYCLES = {
    ("sequence", "ttt"): "one layer, the long-range layers: sequence.build builds TTT's layer (ttt.layer), which is "
                         "a gated bidirectional layer of sequence.bidirectional like the baselines",
}
# Between top-level packages, where a package is split between layers:
EXPLAINED_PACKAGE_CYCLES = {
    ("memory", "sample", "train"): "memory's six subpackages in three layers: memory.guard and "
                                   "memory.techniques below sample and train, which import them; memory.plan, "
                                   "memory.profile and memory.trace above (the profiler drives train's step and "
                                   "sample's denoiser); memory.studies on top",
    ("models", "parallel", "sequence", "ttt"): "parallel.sequence and parallel.mesh are base plumbing the "
                                               "long-range layers are handed; parallel.fsdp walks models' blocks",
}


def test_unit_cycles_are_the_explained_ones():
    assert {tuple(c) for c in import_cycles("unit")} == set(EXPLAINED_UNIT_CYCLES)


def test_package_cycles_are_the_explained_ones():
    assert {tuple(c) for c in import_cycles("package")} == set(EXPLAINED_PACKAGE_CYCLES)


def test_cycle_finder_sees_a_lazy_cycle():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []
