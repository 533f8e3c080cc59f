"""The summary, table and figures of benchmarks/long_range.py's results: per duration and row (a layer of the main
table or an ablation of TTT-MLP), the accuracy as mean and 95 % t-interval over seeds, per scene distance and
overall, the first-scene control, the loss curve's end (did it converge?), step time, memory and the long-range
layer's parameters per block; the accuracy by scene distance and the loss curves as plots."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

# two-sided 95 % quantiles of Student's t by degrees of freedom (n seeds - 1); beyond the table, the normal's
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def label_seconds(label: str) -> int:
    """A run's duration label ("9s", as the benchmark writes it) in seconds: the sort key of rows and panels."""
    return int(label.rstrip("s"))


def merge_runs(held: dict, other: dict, settings: dict, other_settings: dict, name: str,
               across_devices: bool = False) -> tuple[int, int]:
    """Add to the results `held` the runs of `other` (the file `name`) that it lacks; returns (added, already held:
    `held`'s kept). Refused (ValueError) unless both ran the same settings with the same torch and probe verdict, and
    on the same device unless `across_devices`: the accuracies of one setting are one table on any GPU, its step
    times only on one (`summarize` takes a row's step from the file's own device). Each added run keeps the commit
    and the device it was made on."""
    if other.get("torch") != held.get("torch"):
        raise ValueError(f"{name} ran on torch {other.get('torch')!r}, this file on {held.get('torch')!r}: not one "
                         f"table")
    if other.get("device") != held.get("device") and not across_devices:
        raise ValueError(f"{name} ran on device {other.get('device')!r}, this file on {held.get('device')!r}: not "
                         f"one table of step times (--across-devices joins their accuracies, each row's step "
                         f"time staying this file's device's)")
    if other_settings != settings:
        raise ValueError(f"{name} holds runs made with {other_settings}, this file {settings}: not one table")
    probes = held.setdefault("probe", {})
    for duration, verdict in other.get("probe", {}).items():
        if probes.setdefault(duration, verdict) != verdict:
            raise ValueError(f"{name}'s probe at {duration} was {verdict}, this file's {probes[duration]}")
    for run in held.setdefault("runs", []):
        run.setdefault("device", held.get("device"))
    have = {(r["variant"], r["duration"], r["seed"]) for r in held["runs"]}
    added = 0
    for run in other.get("runs", []):
        key = (run["variant"], run["duration"], run["seed"])
        if key not in have:
            held["runs"].append({**run, "git_commit": run.get("git_commit", other.get("git_commit")),
                                 "device": run.get("device", other.get("device"))})
            have.add(key)
            added += 1
    held["failed"] = [f for f in held.get("failed", []) if (f["variant"], f["duration"], f["seed"]) not in have]
    return added, len(other.get("runs", [])) - added


def t95(df: int) -> float:
    """The 97.5 % quantile of Student's t with `df` degrees of freedom (the nearest tabled df at or below it)."""
    if df < 1:
        return math.nan
    return T95[max(k for k in T95 if k <= df)] if df <= 30 else 1.960


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % t-interval over seeds (nan for one seed: no interval from one value)."""
    m = statistics.mean(values)
    if len(values) < 2:
        return m, math.nan
    return m, t95(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def summarize(runs: list[dict], order: list[str] | None = None, device: str | None = None) -> list[dict]:
    """One row per duration and variant (row name), over the seeds the runs hold, in `order` of the row names.
    `device`: the results file's; a row's step time is the median of its runs there (a run without a device ran
    there), or of all its runs, with `step_device` naming theirs, where none did."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["duration"], r["variant"]), []).append(r)
    rank = {name: i for i, name in enumerate(order or [])}
    keys = sorted(groups, key=lambda k: (label_seconds(k[0]), rank.get(k[1], len(rank)), k[1]))
    rows = []
    for duration, variant in keys:
        rs = sorted(groups[(duration, variant)], key=lambda r: r["seed"])
        acc, ci = mean_ci([r["accuracy"] for r in rs])
        kept = [retention(r) for r in rs]
        kept_mean, kept_ci = mean_ci(kept) if not any(math.isnan(k) for k in kept) else (math.nan, math.nan)
        by = list(zip(*(r["accuracy_by_distance"] for r in rs)))
        by_ci = [mean_ci(list(d)) for d in by]
        peaks = [r["peak_allocated_gib"] for r in rs if r.get("peak_allocated_gib") is not None]
        curves = [r["loss_curve"]["mean_loss"] for r in rs if r.get("loss_curve")]
        curve = [statistics.mean(c[i] for c in curves) for i in range(min(map(len, curves)))] if curves else []
        timed = [r for r in rs if r.get("device", device) == device] or rs
        step_device = timed[0].get("device", device)
        rows.append({"duration": duration, "duration_s": label_seconds(duration), "variant": variant,
                     "seeds": [r["seed"] for r in rs],
                     "accuracy": acc, "accuracy_ci95": ci,
                     "accuracy_sd": statistics.stdev([r["accuracy"] for r in rs]) if len(rs) > 1 else 0.0,
                     "accuracy_per_seed": [r["accuracy"] for r in rs],
                     "accuracy_by_distance": [m for m, _ in by_ci], "accuracy_by_distance_ci95": [h for _, h in by_ci],
                     "first_scene_colour": statistics.mean(r.get("first_scene_colour", math.nan) for r in rs),
                     "retention": kept_mean, "retention_ci95": kept_ci, "retention_per_seed": kept,
                     "loss_curve_every": rs[0]["loss_curve"]["every"] if curves else None, "loss_curve": curve,
                     "final_loss": curve[-1] if curve else statistics.mean(r["last_loss"] for r in rs),
                     "loss_change_last": loss_change(curve),
                     "median_step_s": statistics.median(r["median_step_s"] for r in timed),
                     "step_runs": len(timed), "step_device": step_device,
                     "peak_allocated_gib": max(peaks) if peaks else None,
                     "long_range_params": rs[0]["long_range_params"],
                     "layer_params_per_block": rs[0].get("layer_params_per_block"),
                     "recurrence": rs[0].get("recurrence")})
    return rows


def retention(run: dict) -> float:
    """How much of what a run shows on the first scene it keeps on the later ones: later-scene accuracy over its
    first-scene control (nan without a control). It separates forgetting (local attention alone: about 0.3 at 18 s)
    from not learning the captions at all (a run at 0.5 on both scenes keeps all it has)."""
    first = run.get("first_scene_colour")
    return run["accuracy"] / first if first else math.nan


def loss_change(curve: list[float]) -> float | None:
    """Relative change of the mean loss from the curve's second-to-last window to its last: near 0 = flat (the run
    converged at its learning rate schedule's end), clearly negative = still falling when it stopped."""
    if len(curve) < 2 or not curve[-2]:
        return None
    return curve[-1] / curve[-2] - 1.0


def fmt_ci(mean: float, half: float) -> str:
    return f"{mean:.2f}" if math.isnan(half) else f"{mean:.2f} ± {half:.2f}"


def table(rows: list[dict], chance: float, described: dict[str, str], failed: list[dict] | None = None,
          device: str | None = None) -> str:
    """The markdown table: one line per duration and row; `described` says what each row changes; a step time from
    another device than the file's (`device`) is marked."""
    lines = [f"chance = {chance:.2f}; ± = half-width of the 95 % t-interval of the mean over seeds", "",
             "| video | row | what it is | later scenes (mean ± 95% CI) | seeds | "
             "by scene distance +1, +2, ... (mean) | "
             "first scene (control) | kept (later / first) | final loss (change over the last window) | step (s) | "
             "peak GiB | layer params per block |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        by = ", ".join(f"{m:.2f}" for m in r["accuracy_by_distance"])  # their intervals: the JSON and the plot
        peak = f"{r['peak_allocated_gib']:.2f}" if r["peak_allocated_gib"] else "-"
        change = f" ({r['loss_change_last'] * 100:+.1f} %)" if r.get("loss_change_last") is not None else ""
        per_block = r.get("layer_params_per_block")
        params = f"{per_block:,}" if per_block is not None else f"{r['long_range_params']:,} (all blocks)"
        elsewhere = " *" if device and r.get("step_device", device) != device else ""
        lines.append(f"| {r['duration']} | {r['variant']} | {described.get(r['variant'], '')} | "
                     f"{fmt_ci(r['accuracy'], r['accuracy_ci95'])} | {len(r['seeds'])} | {by} | "
                     f"{r['first_scene_colour']:.2f} | {fmt_ci(r['retention'], r['retention_ci95'])} | "
                     f"{r['final_loss']:.4f}{change} | {r['median_step_s']:.3f}{elsewhere} | "
                     f"{peak} | {params} |")
    away = sorted({r["step_device"] for r in rows if device and r.get("step_device", device) != device})
    if away:
        lines += ["", f"* step time of runs on {', '.join(away)}: the row has no run on {device}"]
    notes = {r["variant"]: r["recurrence"] for r in rows if r.get("recurrence") not in (None, "fla")}
    if notes:
        lines += [""] + [f"{variant}'s recurrence: {how}" for variant, how in notes.items()]
    if failed:
        lines += ["", f"{len(failed)} run(s) failed (not in the table; a rerun tries them again):"]
        lines += [f"- {f['duration']} {f['variant']} seed {f['seed']}: {f['error']}" for f in failed]
    return "\n".join(lines)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'tttvideo[report]'): no plot", file=sys.stderr)
        return None
    return plt


def plot_accuracy(rows: list[dict], chance: float, groups: dict[str, tuple[list[str], list[str]]],
                  path: Path) -> Path | None:
    """Accuracy per scene distance with 95 % intervals: one panel per duration and group of rows (the main table,
    the ablations), each group (its rows, the rows it is shown with) where a row of its own has runs; the
    points of a distance side by side so that the intervals stay apart."""
    plt = _pyplot()
    if plt is None:
        return None
    durations = sorted({r["duration"] for r in rows}, key=label_seconds)
    panels = [(g, d, [r for r in rows if r["duration"] == d and r["variant"] in own + beside])
              for g, (own, beside) in groups.items() for d in durations
              if any(r["duration"] == d and r["variant"] in own for r in rows)]
    cols = len(durations)
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 4.2 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (group, duration, members) in zip(axes.flat, panels):
        for k, r in enumerate(members):
            x = list(range(1, len(r["accuracy_by_distance"]) + 1))
            dodge = 0.3 * (k - (len(members) - 1) / 2) / max(1, len(members))
            err = [0.0 if math.isnan(h) else h for h in r["accuracy_by_distance_ci95"]]
            ax.errorbar([i + dodge for i in x], r["accuracy_by_distance"], yerr=err, marker="o", capsize=2,
                        label=r["variant"])
            ax.set_xticks(x)
        ax.axhline(chance, color="grey", linestyle="--", label="chance")
        ax.set(title=f"{duration}, {group}: first scene's colour kept", xlabel="scenes after the first (3 s each)",
               ylabel="accuracy (mean, 95% CI over seeds)", ylim=(-0.05, 1.05))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_losses(runs: list[dict], path: Path) -> Path | None:
    """Every run's loss curve (mean loss per window of steps), one panel per duration, one colour per row."""
    plt = _pyplot()
    if plt is None:
        return None
    runs = [r for r in runs if r.get("loss_curve")]
    if not runs:
        return None
    durations = sorted({r["duration"] for r in runs}, key=label_seconds)
    names = list(dict.fromkeys(r["variant"] for r in runs))
    colours = plt.get_cmap("tab20")
    fig, axes = plt.subplots(1, len(durations), figsize=(6 * len(durations), 4.5), squeeze=False)
    for ax, duration in zip(axes[0], durations):
        for r in (r for r in runs if r["duration"] == duration):
            every = r["loss_curve"]["every"]
            ys = r["loss_curve"]["mean_loss"]
            i = names.index(r["variant"])
            xs = [min(every * (k + 1), r["steps"]) for k in range(len(ys))]
            first_seed = min(s["seed"] for s in runs if s["variant"] == r["variant"] and s["duration"] == duration)
            ax.plot(xs, ys, color=colours(2 * i % 20 + i // 10 % 2), alpha=0.7, linewidth=1,
                    marker="." if len(ys) < 3 else None, label=r["variant"] if r["seed"] == first_seed else None)
        ax.set(title=f"{duration}: training loss (mean per window, every seed)", xlabel="step",
               ylabel="loss", yscale="log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
