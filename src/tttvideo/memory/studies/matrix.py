"""`tttv profile --matrix FILE`: profile variants of one config side by side, each in its own process.

A matrix file is TOML:

    config = "../base.toml"     # base config, relative to this file
    phase = "train"             # train | sample (a variant may override)
    steps = 1
    timeout_s = 1800            # per variant

    [[variant]]
    name = "bf16"
    set = ["model.dtype=bf16"]

    [[variant]]
    name = "wan, fp16"
    config = "wan21/fp16.toml"  # a variant may bring its own config file (one file per variant)

Each variant runs `python -m tttvideo profile CONFIG --phase P --steps N --set ... --out OUT/<name>` in a fresh
process, so one variant's peaks, allocator cache and CUDA context never leak into the next. The child writes its
report (summary.json included) even when it runs out of memory, recording where; a child that fails in any other way
becomes a row with its exit code and last error line. The matrix itself never fails because a variant did. The
folder gets matrix.json (every row), and matrix.md / matrix.html / matrix.png (`matrix_report`: the table, the
variants ranked by peak and by step time, bars of both).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tttvideo.errors import UserError
from tttvideo.memory.profile.drivers import EXIT_OOM, PHASES
from tttvideo.memory.studies.matrix_report import write_matrix_report
from tttvideo.memory.profile.report import fmt_bytes

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROW_FILE = "row.json"

__all__ = ["EXIT_OOM", "Matrix", "MatrixRow", "Variant", "load_matrix", "print_matrix", "run_matrix"]


@dataclass
class Variant:
    name: str
    overrides: list[str] = field(default_factory=list)
    phase: str = "train"
    steps: int = 1
    config: Path | None = None  # its own config file, instead of the matrix's


@dataclass
class Matrix:
    path: Path
    config: Path | None
    variants: list[Variant]
    timeout_s: float = 1800.0
    device: str = "auto"


@dataclass
class MatrixRow:
    variant: str
    status: str  # ok, oom, error, crashed, timeout
    exit_code: int | None
    seconds: float
    note: str  # OOM location or last error line
    out_dir: str
    summary: dict[str, Any] | None = None


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "variant"


def load_matrix(path: str | Path) -> Matrix:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"matrix file {path} does not exist; see configs/profile/matrix-example.toml")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"{path} is not valid TOML ({err}); fix the line it names") from None
    known = {"config", "phase", "steps", "timeout_s", "device", "variant"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UserError(f"{path}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
    cfg_path = _config_path(path, data.get("config"), "config")
    phase = str(data.get("phase", "train"))
    steps = data.get("steps", 1)
    raw = data.get("variant")
    if not isinstance(raw, list) or not raw:
        raise UserError(f"{path}: no [[variant]] tables; add at least one with a name and a set = [...] list")
    variants, seen = [], set()
    for i, v in enumerate(raw):
        if not isinstance(v, dict) or "name" not in v:
            raise UserError(f"{path}: variant #{i + 1} has no name; every [[variant]] needs name = \"...\"")
        extra = sorted(set(v) - {"name", "set", "phase", "steps", "config"})
        if extra:
            raise UserError(f"{path}: variant {v['name']!r} has unknown key(s) {', '.join(extra)}; "
                            "allowed: name, set, phase, steps, config")
        name = str(v["name"])
        if _slug(name) in seen:
            raise UserError(f"{path}: two variants are named {name!r} (or the same once made a folder name)")
        seen.add(_slug(name))
        sets = v.get("set", [])
        if not isinstance(sets, list) or not all(isinstance(s, str) and "=" in s for s in sets):
            raise UserError(f"{path}: variant {name!r}: set must be a list of \"section.key=value\" strings")
        vphase = str(v.get("phase", phase))
        if vphase not in PHASES:
            raise UserError(f"{path}: variant {name!r}: phase {vphase!r} is not one of {', '.join(PHASES)}")
        vsteps = v.get("steps", steps)
        if not isinstance(vsteps, int) or vsteps < 1:
            raise UserError(f"{path}: variant {name!r}: steps must be a positive integer, got {vsteps!r}")
        variants.append(Variant(name, list(sets), vphase, vsteps,
                                _config_path(path, v.get("config"), f"variant {name!r}: config")))
    timeout = data.get("timeout_s", 1800)
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise UserError(f"{path}: timeout_s must be a positive number of seconds, got {timeout!r}")
    return Matrix(path, cfg_path, variants, float(timeout), str(data.get("device", "auto")))


def _config_path(matrix: Path, value: object, what: str) -> Path | None:
    if not value:
        return None
    resolved = (matrix.parent / str(value)).resolve()
    if not resolved.is_file():
        raise UserError(f"{matrix}: {what} = {value!r} resolves to {resolved}, which does not exist "
                        "(paths are relative to the matrix file)")
    return resolved


def gpus_needed(m: Matrix, v: Variant) -> int:
    """Processes (one GPU each) the variant runs on: a diffusers pipeline's context-parallel degree, else 1."""
    from tttvideo.memory.studies.pipeline_config import is_pipeline_profile, load_pipeline_profile

    config = v.config or m.config
    if config is None or not is_pipeline_profile(config):
        return 1
    try:
        return load_pipeline_profile(config, v.overrides).context_parallel
    except UserError:
        return 1  # the child says what is wrong with the file, as a row


def child_command(m: Matrix, v: Variant, out_dir: Path) -> list[str]:
    from tttvideo.memory.studies.pipeline_config import is_pipeline_profile

    procs = gpus_needed(m, v)
    cmd = [sys.executable, "-m", "tttvideo", "profile"]
    if procs > 1:
        cmd[1:2] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}", "-m"]
    config = v.config or m.config
    if config is not None:
        cmd.append(str(config))
    if config is None or not is_pipeline_profile(config):  # a diffusers pipeline has no train / sample choice
        cmd += ["--phase", v.phase]
    cmd += ["--steps", str(v.steps), "--out", str(out_dir), "--device", m.device]
    for s in v.overrides:
        cmd += ["--set", s]
    return cmd


def _last_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    said = [ln for ln in lines if re.match(r"tttv \w+: error", ln)]  # torchrun's own summary comes after it
    line = (said or lines)[-1][:300] if lines else ""
    return re.sub(r"^tttv \w+: error: ", "", line)  # the CLI's prefix says nothing the row does not


def run_variant(m: Matrix, v: Variant, out_root: Path, gpus: list[str] | None = None) -> MatrixRow:
    """One variant in its own process (torchrun's, for a context-parallel pipeline), on `gpus` when given (its
    CUDA_VISIBLE_DEVICES); the row is also written to the variant's folder (row.json, for `--resume`)."""
    out_dir = out_root / _slug(v.name)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary_path = out_dir / "summary.json"
    summary_path.unlink(missing_ok=True)  # a stale summary from an earlier run must not pass for this one
    (out_dir / ROW_FILE).unlink(missing_ok=True)
    t0 = time.perf_counter()
    cmd = child_command(m, v, out_dir)
    env = None
    if gpus is not None:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(gpus)}
    (out_dir / "command.txt").write_text(
        (f"CUDA_VISIBLE_DEVICES={','.join(gpus)} " if gpus is not None else "") + " ".join(cmd) + "\n")
    try:
        with (out_dir / "stdout.log").open("w") as out, (out_dir / "stderr.log").open("w") as err:
            proc = subprocess.run(cmd, stdout=out, stderr=err, timeout=m.timeout_s, env=env)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        code = None
    row = _row(v, code, time.perf_counter() - t0, out_dir, m.timeout_s)
    (out_dir / ROW_FILE).write_text(json.dumps(asdict(row), indent=1, default=str))
    return row


def _row(v: Variant, code: int | None, seconds: float, out_dir: Path, timeout_s: float) -> MatrixRow:
    summary_path = out_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    stderr = (out_dir / "stderr.log").read_text(errors="replace")
    if code is None:
        return MatrixRow(v.name, "timeout", None, seconds, f"killed after {timeout_s:.0f} s", str(out_dir), summary)
    if summary is not None and summary.get("status") == "oom":
        where = (summary.get("oom") or {}).get("location", "unknown place")
        return MatrixRow(v.name, "oom", code, seconds, f"OOM in {where}", str(out_dir), summary)
    if code == 0 and summary is not None:
        return MatrixRow(v.name, "ok", 0, seconds, "", str(out_dir), summary)
    status = "error" if code == 2 else "crashed"
    return MatrixRow(v.name, status, code, seconds, _last_error_line(stderr) or f"exit code {code}", str(out_dir),
                     summary)


def finished_row(v: Variant, out_root: Path) -> MatrixRow | None:
    """The row an earlier run of this matrix left for `v` if it finished (ok or out of memory), else None."""
    path = out_root / _slug(v.name) / ROW_FILE
    try:
        row = MatrixRow(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return row if row.variant == v.name and row.status in ("ok", "oom") else None


def run_matrix(m: Matrix, out_root: str | Path, progress: Any = None, gpus: list[str] | None = None,
               resume: bool = False) -> list[MatrixRow]:
    """Every variant, in file order; with `gpus` (CUDA device ids) as many at once as there are free GPUs, each
    on its own (a context-parallel variant waits for as many as it needs). With `resume`, a variant whose row an
    earlier run left finished is kept, not rerun."""
    out_root = Path(out_root)
    out_root.mkdir(parents=True, exist_ok=True)
    rows: list[MatrixRow | None] = [None] * len(m.variants)
    free = list(gpus) if gpus is not None else None
    ready = threading.Condition()

    def run_on(i: int, v: Variant, mine: list[str] | None) -> None:
        try:
            rows[i] = run_variant(m, v, out_root, mine)
        except Exception as exc:  # noqa: BLE001 - a thread's failure is the variant's row, not a lost one
            rows[i] = MatrixRow(v.name, "crashed", None, 0.0, f"{type(exc).__name__}: {exc}",
                                str(out_root / _slug(v.name)))
        finally:
            with ready:
                if free is not None and mine is not None:
                    free.extend(mine)
                    free.sort(key=int)
                ready.notify_all()

    threads = []
    for i, v in enumerate(m.variants):
        what = " ".join(([v.config.name] if v.config else []) + v.overrides) or "(base config)"
        if resume and (kept := finished_row(v, out_root)) is not None:
            rows[i] = kept
            if progress is not None:
                progress(f"[{i + 1}/{len(m.variants)}] {v.name}: kept ({kept.status}) from the earlier run")
            continue
        if free is None:
            if progress is not None:
                progress(f"[{i + 1}/{len(m.variants)}] {v.name}: {what}")
            rows[i] = run_variant(m, v, out_root)
            continue
        need = gpus_needed(m, v)
        if need > len(gpus or []):
            rows[i] = MatrixRow(v.name, "error", None, 0.0, f"needs {need} GPUs; --gpus lists {len(gpus or [])}",
                                str(out_root / _slug(v.name)))
            continue
        with ready:
            ready.wait_for(lambda: len(free) >= need)
            mine, free[:] = free[:need], free[need:]
        if progress is not None:
            progress(f"[{i + 1}/{len(m.variants)}] {v.name} on GPU {','.join(mine)}: {what}")
        t = threading.Thread(target=run_on, args=(i, v, mine), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    rows = [r for r in rows if r is not None]
    (out_root / "matrix.json").write_text(json.dumps(
        {"matrix": str(m.path), "config": str(m.config) if m.config else None,
         "variants": [asdict(v) for v in m.variants], "rows": [asdict(r) for r in rows]}, indent=1, default=str))
    cols, table = matrix_table(rows)
    write_matrix_report(rows, cols, table, out_root, f"memory matrix: {m.path.name}")
    return rows


def _phase_names(rows: list[MatrixRow]) -> list[str]:
    names: list[str] = []
    for r in rows:
        for p in (r.summary or {}).get("phases", []):
            if p["name"] not in names:
                names.append(p["name"])
    return names


def matrix_table(rows: list[MatrixRow]) -> tuple[list[str], list[list[str]]]:
    """Columns and display rows: one row per variant, whatever happened to it."""
    phase_names = _phase_names(rows)
    cols = ["variant", "status", "peak allocated", "peak reserved", "base", *[f"act. {p}" for p in phase_names],
            "frag. at peak", "outside torch", "retries", "last step s", "seconds", "note"]
    out = []
    for r in rows:
        s = r.summary or {}
        t = s.get("totals", {})
        f = s.get("fragmentation", {})
        phases = {p["name"]: p for p in s.get("phases", [])}
        cpu = s.get("backend") == "cpu"
        out.append([
            r.variant, r.status,
            fmt_bytes(t.get("peak_allocated")) if t else "",
            fmt_bytes(t.get("peak_reserved")) if t and not cpu else ("n/a" if t else ""),
            fmt_bytes(t.get("base_total")) if t else "",
            *[fmt_bytes(phases[p]["activation_peak"]) if p in phases else "" for p in phase_names],
            fmt_bytes(f.get("at_peak")) if f and not cpu else ("n/a" if f else ""),
            fmt_bytes(t.get("outside_torch_max")) if t.get("outside_torch_max") is not None else "",
            "" if f.get("alloc_retries") is None else str(f.get("alloc_retries")),
            f"{s['step_seconds'][-1]:.2f}" if s.get("step_seconds") else "",
            f"{r.seconds:.1f}", r.note,
        ])
    return cols, out


def print_matrix(rows: list[MatrixRow], title: str = "memory matrix") -> None:
    from rich.console import Console
    from rich.table import Table

    cols, table = matrix_table(rows)
    # Columns no variant has a figure for (the allocator's on CPU) only take width.
    keep = [i for i, c in enumerate(cols)
            if c in ("variant", "status", "note") or any(r[i] not in ("", "n/a") for r in table)]
    t = Table(title=title)
    for i in keep:
        c = cols[i]
        if c in ("variant", "note"):
            t.add_column(c, overflow="fold", ratio=2 if c == "note" else 1)
        else:
            t.add_column(c, justify="left" if c == "status" else "right", no_wrap=True)
    for r, display in zip(rows, table, strict=True):
        style = {"ok": None, "oom": "yellow"}.get(r.status, "red")
        t.add_row(*[display[i] for i in keep], style=style)
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # a log file has no width; do not fold the table to 80 columns
    console.print(t)
