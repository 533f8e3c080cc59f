"""The report folder of one profile: events.json, summary.json, summary.md, summary.csv, three PNGs and report.html.

Tables are built once (`tables(summary)`) and rendered three ways, so markdown, CSV and HTML never disagree.
"""

from __future__ import annotations

import base64
import csv
import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tttvideo.memory.profile.analysis import Summary, summarize
from tttvideo.memory.profile.events import GIB, MIB, Recording

REPORT_FILES = ("events.json", "summary.json", "summary.md", "summary.csv", "timeline.png", "components.png",
                "blocks.png", "report.html")


def fmt_bytes(n: int | float | None) -> str:
    if n is None:
        return "n/a"
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / MIB:.1f} MiB"


@dataclass
class Table:
    """One table: `rows` hold display strings, `raw` the same rows with bytes as ints for the CSV."""

    key: str
    title: str
    columns: list[str]
    rows: list[list[str]]
    raw: list[list[Any]]


def _table(key: str, title: str, columns: list[str], raw: list[list[Any]], byte_cols: set[int]) -> Table:
    rows = [[fmt_bytes(v) if i in byte_cols else ("" if v is None else str(v)) for i, v in enumerate(r)] for r in raw]
    return Table(key, title, columns, rows, raw)


def tables(s: Summary) -> list[Table]:
    out = []
    t, f = s.totals, s.fragmentation
    unit = s.labels.get("unit", "memory")
    totals = [
        ["peak allocated", t.peak_allocated],
        ["peak reserved", t.peak_reserved],
        ["final allocated", t.final_allocated],
        ["final reserved", t.final_reserved],
        ["base memory (sum of components)", t.base_total],
        ["outside PyTorch, final (driver used - reserved)", t.outside_torch_final],
        ["outside PyTorch, max", t.outside_torch_max],
        ["driver used, max", t.driver_peak],
        ["device total", t.device_total],
    ]
    out.append(_table("totals", f"Totals ({unit})", ["quantity", "bytes"], totals, {1}))
    out.append(_table(
        "components", "Base memory per component (allocated after load - before)",
        ["component", "measured", "counted", "transient during load"],
        [[c.name, c.measured, c.counted, c.load_peak] for c in s.components], {1, 2, 3}))
    out.append(_table(
        "phases", "Activation memory per phase (peak inside - allocated at entry; max over steps)",
        ["phase", "runs", "activation peak", "at step", "entry", "peak allocated", "peak reserved", "retained",
         "seconds"],
        [[p.name, p.occurrences, p.activation_peak, p.peak_step, p.entry, p.peak_allocated, p.peak_reserved,
          p.retained, f"{p.seconds:.3f}"] for p in s.phases], {2, 4, 5, 6, 7}))
    out.append(_table(
        "blocks", "Activation memory per block (max over calls)",
        ["block", "direction", "calls", "activation peak", "retained", "seconds"],
        [[b.name, b.direction, b.occurrences, b.activation_peak, b.retained, f"{b.seconds:.4f}"] for b in s.blocks],
        {3, 4}))
    if s.marks:
        out.append(_table("marks", "Allocated at marks", ["mark", "allocated"],
                          [[k, v] for k, v in s.marks.items()], {1}))
    na = s.backend == "cpu"
    frag = [
        ["peak reserved - peak allocated", None if na else f.at_peak],
        ["reserved - allocated, max", None if na else f.max],
        ["reserved - allocated, mean", None if na else int(f.mean)],
        ["reserved - allocated, std (fluctuation)", None if na else int(f.std)],
        ["inactive split bytes, max", f.inactive_split_max],
        ["inactive split bytes, final", f.inactive_split_final],
    ]
    out.append(_table("fragmentation", "Fragmentation" + (" (n/a on CPU: no allocator cache)" if na else ""),
                      ["quantity", "bytes"], frag, {1}))
    counters = [
        ["max (reserved - allocated) / reserved", "n/a" if na else f"{f.max_ratio:.3f}"],
        ["allocator retries (cudaMalloc retried after freeing cache)", "n/a" if f.alloc_retries is None
         else f.alloc_retries],
        ["OOMs", "n/a" if f.num_ooms is None else f.num_ooms],
    ]
    out.append(_table("counters", "Allocator counters", ["quantity", "value"], counters, set()))
    return out


def _md_table(t: Table) -> str:
    lines = [f"### {t.title}", "", "| " + " | ".join(t.columns) + " |", "|" + "---|" * len(t.columns)]
    lines += ["| " + " | ".join(r) + " |" for r in t.rows]
    return "\n".join(lines) + "\n"


def _header_lines(s: Summary) -> list[tuple[str, str]]:
    backend = s.meta.get("backend", {}) if isinstance(s.meta.get("backend"), dict) else {}
    lines = [("status", s.status)]
    if s.oom:
        lines.append(("OOM", f"in {s.oom.get('location')} (step {s.oom.get('step')}): {s.oom.get('error')}"))
    lines += [
        ("backend", f"{s.backend}: {backend.get('device', '')}"),
        ("figures", s.labels.get("unit", "")),
        ("allocated means", s.labels.get("allocated", "")),
        ("reserved means", s.labels.get("reserved", "")),
        ("torch", str(backend.get("torch", ""))),
        ("git commit", str(s.meta.get("git_commit", ""))),
    ]
    for key in ("phase", "config", "overrides", "steps", "note", "device_run"):
        if key in s.meta:
            lines.append((key, str(s.meta[key])))
    return lines


def write_markdown(s: Summary, path: Path) -> None:
    parts = ["# Memory profile", ""]
    parts += [f"- {k}: {v}" for k, v in _header_lines(s)]
    parts.append("")
    parts += [_md_table(t) for t in tables(s)]
    path.write_text("\n".join(parts))


def write_csv(s: Summary, path: Path) -> None:
    """Long format, one number per row: section, name, detail, metric, value (bytes for memory figures)."""
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["section", "name", "detail", "metric", "value", "MiB"])
        for t in tables(s):
            first_value = 2 if t.key == "blocks" else 1
            for raw in t.raw:
                name = raw[0]
                detail = raw[1] if t.key == "blocks" else ""
                for col, value in zip(t.columns[first_value:], raw[first_value:], strict=True):
                    mib = f"{value / MIB:.3f}" if isinstance(value, int) and col not in ("runs", "calls", "at step") \
                        and t.key != "counters" else ""
                    w.writerow([t.key, name, detail, col, "" if value is None else value, mib])


def _html(s: Summary, images: dict[str, Path]) -> str:
    esc = html.escape
    out = ["<!doctype html><html><head><meta charset='utf-8'><title>tttvideo memory profile</title><style>",
           "body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
           "table{border-collapse:collapse;margin:0.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 8px;"
           "text-align:right}td:first-child,th:first-child{text-align:left}img{max-width:100%}"
           ".oom{color:#b00;font-weight:bold}</style></head><body>", "<h1>Memory profile</h1><ul>"]
    for k, v in _header_lines(s):
        cls = " class='oom'" if k == "OOM" else ""
        out.append(f"<li{cls}><b>{esc(k)}</b>: {esc(v)}</li>")
    out.append("</ul>")
    for title, path in images.items():
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        out.append(f"<h2>{esc(title)}</h2><img alt='{esc(title)}' src='data:image/png;base64,{data}'>")
    for t in tables(s):
        out.append(f"<h2>{esc(t.title)}</h2><table><tr>" + "".join(f"<th>{esc(c)}</th>" for c in t.columns) + "</tr>")
        out += ["<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in t.rows]
        out.append("</table>")
    out.append("</body></html>")
    return "\n".join(out)


def write_report(rec: Recording, out_dir: str | Path, *, status: str | None = None) -> dict[str, Path]:
    """Write every report file into `out_dir`; returns name -> path."""
    from tttvideo.memory.profile import plots

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    s = summarize(rec, status=status)
    paths = {name: out / name for name in REPORT_FILES}
    rec.save(paths["events.json"])
    paths["summary.json"].write_text(json.dumps(s.to_dict(), indent=1))
    write_markdown(s, paths["summary.md"])
    write_csv(s, paths["summary.csv"])
    plots.timeline(rec, s, paths["timeline.png"])
    plots.components(s, paths["components.png"])
    plots.blocks(s, paths["blocks.png"])
    images = {"Memory timeline": paths["timeline.png"], "Base memory per component": paths["components.png"],
              "Activation memory per block": paths["blocks.png"]}
    paths["report.html"].write_text(_html(s, images))
    return paths
