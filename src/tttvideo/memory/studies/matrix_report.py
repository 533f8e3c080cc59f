"""The side-by-side report of a memory matrix: the full table, the variants ranked by peak and by step time, and a
bar chart of both (matrix.md, matrix.html, matrix.png in the matrix's output folder)."""

from __future__ import annotations

import html
from pathlib import Path
from typing import TYPE_CHECKING

from tttvideo.memory.profile.report import fmt_bytes

if TYPE_CHECKING:
    from tttvideo.memory.studies.matrix import MatrixRow


def _peak(r: MatrixRow) -> int | None:
    return ((r.summary or {}).get("totals") or {}).get("peak_allocated") if r.status == "ok" else None


def _step(r: MatrixRow) -> float | None:
    steps = (r.summary or {}).get("step_seconds") or []
    return steps[-1] if r.status == "ok" and steps else None


def rankings(rows: list[MatrixRow]) -> dict[str, list[tuple[str, str]]]:
    """(variant, figure) best first, by peak allocated and by the last step's seconds; the variants without the
    figure (out of memory, failed) last, with their status."""
    out = {}
    for key, value, fmt in (("peak", _peak, fmt_bytes), ("step time", _step, lambda x: f"{x:.2f} s")):
        have = sorted((r for r in rows if value(r) is not None), key=value)
        out[key] = [(r.variant, fmt(value(r))) for r in have] + [(r.variant, r.status) for r in rows
                                                                  if value(r) is None]
    return out


def bar_chart(rows: list[MatrixRow], path: Path) -> None:
    from tttvideo.memory.profile.plots import pyplot

    plt = pyplot()
    names = [r.variant for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * len(rows) + 1.5), sharey=True)
    for ax, value, title, scale in ((axes[0], _peak, "peak allocated (GiB)", 2**30),
                                    (axes[1], _step, "last step (s)", 1.0)):
        vals = [(value(r) or 0) / scale for r in rows]
        bars = ax.barh(range(len(rows)), vals, color=["tab:blue" if value(r) is not None else "lightgray"
                                                      for r in rows])
        for bar, r in zip(bars, rows):
            if value(r) is None:
                ax.text(0, bar.get_y() + bar.get_height() / 2, f" {r.status}", va="center", fontsize=8)
        ax.set_title(title)
    axes[0].set_yticks(range(len(rows)), names, fontsize=8)
    axes[0].invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_matrix_report(rows: list[MatrixRow], cols: list[str], table: list[list[str]], out: Path,
                        title: str) -> None:
    ranks = rankings(rows)
    md = [f"# {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(r) + " |" for r in table]
    for key, ranked in ranks.items():
        md += ["", f"## Ranked by {key}", "", f"| # | variant | {key} |", "|---|---|---|"]
        md += [f"| {i + 1} | {name} | {fig} |" for i, (name, fig) in enumerate(ranked)]
    (out / "matrix.md").write_text("\n".join(md) + "\n")
    png = out / "matrix.png"
    bar_chart(rows, png)

    def table_html(head: list[str], body: list[list[str]]) -> str:
        cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
        lines = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in body)
        return f"<table><tr>{cells}</tr>{lines}</table>"

    parts = [f"<h1>{html.escape(title)}</h1>", f'<img src="{png.name}" alt="peaks and step times">',
             table_html(cols, table)]
    for key, ranked in ranks.items():
        parts += [f"<h2>Ranked by {html.escape(key)}</h2>",
                  table_html(["#", "variant", key], [[str(i + 1), n, f] for i, (n, f) in enumerate(ranked)])]
    style = "table{border-collapse:collapse;font:13px sans-serif}td,th{border:1px solid #ccc;padding:2px 6px}"
    (out / "matrix.html").write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
                                     f"</title><style>{style}</style></head><body>{''.join(parts)}</body></html>\n")
