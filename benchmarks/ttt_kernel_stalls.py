"""Where the TTT-MLP scan kernels' warps wait: Nsight Compute's warp-state sampling of each kernel, by stall reason
and by source line, so a kernel change can be aimed at what holds a step up.

    python3 benchmarks/ttt_kernel_stalls.py [--out DIR]          # a GPU whose counters ncu can read (Firecracker)
    python3 benchmarks/ttt_kernel_stalls.py --workload train     # the process ncu profiles (the driver starts it)

For each kernel of the 3-s shape (B=1, 48 heads of 64, 18,048 tokens, bf16, checkpoint group 16) the driver runs
`ncu` on this script's workload once, profiling one launch of that kernel in the second iteration (the first
compiles and warms): the training forward, a full group's recompute, output path, reverse and d K; and the sampling
forward at a guided step's 96 streams and mini-batch 16. ncu runs each kernel alone (its kernel replay serialises
them), so the slowdown of kernels sharing SMs in the backward's three streams is not in these figures.

Each report is read with ncu's Python report interface (`ncu_report`, from the ncu install's extras/python): the
kernel's duration, issue-slot use and warp cycles per issued instruction, the sampled warp states summed over the
kernel by reason, and the same samples by source line (Triton's line info maps SASS to the kernel's Python source);
ncu's exported source page adds each busy instruction's SASS and the samples by the waiting instruction's opcode.
Writes ttt_kernel_stalls_<gpu>.json (device, torch, Triton, ncu, commit, the tables) to --out, the reports and
ncu's CSV pages as ttt_kernel_stalls_reports.tar.gz, and prints the tables last. `--clock-control none`: the
clocks are left as the machine runs them (METHOD.md of the lent machines).
"""

from __future__ import annotations

import argparse
import csv
import functools
import glob
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
B, H, L, D, GROUP = 1, 48, 18048, 64, 16
TRAIN_MB, SAMPLE_MB, SAMPLE_BATCH = 64, 16, 2
# (label, workload, kernel function, which launch of it to profile: index into that kernel's launches)
N_GROUPS = math.ceil(L // TRAIN_MB / GROUP)  # 18 checkpoint groups of the training scan
MID = N_GROUPS // 2  # a full group in the middle of the backward (groups run last to first)
PROFILES = [
    ("training forward", "train", "_mlp_fwd_kernel", 1 + N_GROUPS),  # iteration 1: forward + one recompute a group
    ("recompute (one group)", "train", "_mlp_fwd_kernel", 1 + N_GROUPS + 1 + MID),
    ("output path (one group)", "train", "_output_path_kernel", N_GROUPS + MID),
    ("reverse (one group)", "train", "_reverse_kernel", N_GROUPS + MID),
    ("d K (one group)", "train", "_dk_kernel", N_GROUPS + MID),
    ("sampling forward, 96 streams, mini-batch 16", "sample", "_mlp_fwd_kernel", 1),
]
SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "SchedulerStats", "WarpStateStats", "SourceCounters",
            "InstructionStats")
STALL_PREFIX = "smsp__pcsamp_warps_issue_stalled_"
# scalar metrics read off each report (present in the sections above)
SCALARS = {
    "duration_us": ("gpu__time_duration.sum", 1e-3),
    "issue_active_pct": ("smsp__issue_active.avg.pct_of_peak_sustained_active", 1.0),
    "warp_cycles_per_issue": ("smsp__average_warp_latency_per_inst_issued.ratio", 1.0),
    "registers_per_thread": ("launch__registers_per_thread", 1.0),
    "grid_size": ("launch__grid_size", 1.0),
    "block_size": ("launch__block_size", 1.0),
    "sm_throughput_pct": ("sm__throughput.avg.pct_of_peak_sustained_elapsed", 1.0),
    "memory_throughput_pct": ("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed", 1.0),
    "shared_memory_config_size": ("launch__shared_mem_config_size", 1.0),  # in the unit ncu_report gives
}


# ---------------------------------------------------------------------------------------------------- workloads

def workload(name: str) -> None:
    """Two iterations of the scan the profiles name: the training forward + backward, or the sampling forward."""
    import torch

    from tttvideo.ttt import triton_mlp
    from tttvideo.ttt.testing import make_inputs

    if name == "train":
        x = [t.detach() for t in make_inputs("mlp", B, H, L, D, TRAIN_MB, seed=0)]
        dout = torch.randn_like(x[0])
        for _ in range(2):
            _, ck = triton_mlp.mlp_forward(*x, TRAIN_MB, GROUP, True)
            triton_mlp.mlp_backward(dout, *x[:6], ck, TRAIN_MB, GROUP)
            torch.cuda.synchronize()
    elif name == "sample":
        x = [t.detach() for t in make_inputs("mlp", SAMPLE_BATCH, H, L, D, SAMPLE_MB, seed=0)]
        for _ in range(2):
            triton_mlp.mlp_forward(*x, SAMPLE_MB, GROUP, False)
            torch.cuda.synchronize()
    else:
        raise SystemExit(f"unknown workload {name!r}: use train or sample")


# ---------------------------------------------------------------------------------------------------- ncu driver

def ncu_path() -> str:
    found = shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))), None)
    if not found:
        raise SystemExit("ncu (Nsight Compute) is not on PATH nor under /opt/nvidia/nsight-compute: install it, or "
                         "run this on a machine that has it")
    return found


def report_module(ncu: str):
    """ncu's Python report interface (extras/python of the Nsight Compute install; `ncu` on PATH is often a
    wrapper in CUDA's bin/), or None: then only the reports and their CSV pages are kept."""
    base = Path(os.path.realpath(ncu)).parent
    cands = [base / "extras" / "python", *base.parent.glob("nsight-compute*/extras/python"),
             *Path("/opt/nvidia").glob("nsight-compute/*/extras/python"),
             *Path("/usr/local").glob("cuda*/nsight-compute*/extras/python")]
    for cand in cands:
        if (cand / "ncu_report.py").exists():
            sys.path.insert(0, str(cand))
            import ncu_report  # type: ignore[import-not-found]
            return ncu_report
    print(f"ncu_report.py not found (looked in {', '.join(map(str, cands))}): keeping the reports only", flush=True)
    return None


def profile(ncu: str, label: str, work: str, kernel: str, skip: int, out: Path, log) -> Path:
    rep = out / (label.split(" (")[0].split(",")[0].replace(" ", "_") + "_" + work)
    cmd = [ncu, "--clock-control", "none", "--target-processes", "all", "-k", f"regex:^{kernel}$",
           "--launch-skip", str(skip), "--launch-count", "1", "--import-source", "yes", "-f", "-o", str(rep)]
    for s in SECTIONS:
        cmd += ["--section", s]
    cmd += [sys.executable, str(Path(__file__).resolve()), "--workload", work]
    print(f"[{label}] {' '.join(cmd[:12])} ...", flush=True)
    try:  # a kernel that spun forever under replay must not hold up the others
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"ncu ran past 300 s for {label}") from e
    log.write(f"### {label}\n{' '.join(cmd)}\nrc={res.returncode}\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}\n")
    path = rep.with_suffix(".ncu-rep")
    if res.returncode != 0 or not path.exists():
        raise RuntimeError(f"ncu failed for {label} (rc {res.returncode}): {res.stderr[-1500:] or res.stdout[-1500:]}")
    for page, extra in (("raw", []), ("details", []), ("source", ["--print-source", "sass"])):
        exp = subprocess.run([ncu, "-i", str(path), "--csv", "--page", page, *extra], capture_output=True, text=True)
        (out / f"{path.stem}.{page}.csv").write_text(exp.stdout if exp.returncode == 0 else exp.stderr)
    return path


def _metric(action, name: str):
    try:
        return action.metric_by_name(name)
    except Exception:  # noqa: BLE001 - absent metrics raise or return None depending on the ncu version
        return None


def read_report(ncu_report, path: Path) -> dict:
    """The one profiled launch of a report: scalars, stall samples by reason, and by source line."""
    ctx = ncu_report.load_report(str(path))
    action = ctx.range_by_idx(0).action_by_idx(0)
    row: dict = {"kernel": action.name()}
    for key, (name, scale) in SCALARS.items():
        m = _metric(action, name)
        if m is not None:
            try:
                row[key] = m.as_double() * scale
            except Exception:  # noqa: BLE001
                pass
    by_reason: dict[str, float] = defaultdict(float)
    by_pc: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for name in action.metric_names():
        if not name.startswith(STALL_PREFIX) or name.endswith("_not_issued"):
            continue
        m = _metric(action, name)
        if m is None or not m.num_instances():
            continue
        reason = name[len(STALL_PREFIX):]
        pcs = m.correlation_ids()
        for i in range(m.num_instances()):
            v = m.value(i)
            by_reason[reason] += v
            by_pc[int(pcs.value(i))][reason] += v
    total = sum(by_reason.values()) or 1.0
    row["samples"] = total
    row["by_reason_pct"] = {r: 100 * v / total for r, v in sorted(by_reason.items(), key=lambda kv: -kv[1]) if v}
    page = source_page(path.with_name(f"{path.stem}.source.csv"))
    sass = {pc: text for pc, (text, _) in page.items()}
    row["by_opcode"] = by_opcode(page)
    lines: dict[tuple[str, int], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    top_pcs = []
    for pc, reasons in by_pc.items():
        try:
            info = action.source_info(pc)
            key = (Path(info.file_name()).name, int(info.line()))
        except Exception:  # noqa: BLE001
            key = ("?", 0)
        for r, v in reasons.items():
            lines[key][r] += v
        top_pcs.append((sum(reasons.values()), pc))
    row["by_line"] = [
        {"file": f, "line": ln, "pct": 100 * sum(rs.values()) / total, "source": _source_line(f, ln),
         "reasons_pct": {r: 100 * v / total for r, v in sorted(rs.items(), key=lambda kv: -kv[1])[:3]}}
        for (f, ln), rs in sorted(lines.items(), key=lambda kv: -sum(kv[1].values()))[:25]]
    row["by_instruction"] = [
        {"pc": hex(pc), "pct": 100 * n / total, "sass": str(sass.get(pc, "")),
         "reasons_pct": {r: 100 * v / total for r, v in sorted(by_pc[pc].items(), key=lambda kv: -kv[1])[:2]}}
        for n, pc in sorted(top_pcs, reverse=True)[:25]]
    return row


def source_page(csv_path: Path) -> dict[int, tuple[str, dict[str, float]]]:
    """ncu's source page as exported (`--page source --print-source sass --csv`): per instruction address, its SASS
    text and its warp samples by stall reason ({} where the page is missing or not in that form)."""
    if not csv_path.exists():
        return {}
    rows = list(csv.reader(csv_path.read_text().splitlines()))
    head = next((i for i, r in enumerate(rows) if r[:2] == ["Address", "Source"]), None)
    if head is None:
        return {}
    names = rows[head]
    reasons = [(i, n[len("stall_"):]) for i, n in enumerate(names) if n.startswith("stall_") and "(" not in n]
    page = {}
    for r in rows[head + 1:]:
        if len(r) < len(names) or not r[0].startswith("0x"):
            continue
        samples = {name: float(r[i]) for i, name in reasons if r[i] not in ("", "-") and float(r[i])}
        page[int(r[0], 16)] = (r[1].strip(), samples)
    return page


def opcode(sass: str) -> str:
    """The instruction's opcode without its predicate and modifiers: "@!P1 STS.128 [R0], R4" -> "STS"."""
    words = [w for w in sass.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else "?"


def by_opcode(page: dict[int, tuple[str, dict[str, float]]], top: int = 15) -> list[dict]:
    """Warp samples by the opcode of the waiting instruction, % of the kernel's samples, with the main reasons: a
    shared-memory store waiting on the long scoreboard is a tile staged for a product waiting for its global load."""
    total = sum(sum(r.values()) for _, r in page.values()) or 1.0
    ops: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for text, reasons in page.values():
        for r, v in reasons.items():
            ops[opcode(text)][r] += v
    ranked = sorted(ops.items(), key=lambda kv: -sum(kv[1].values()))[:top]
    return [{"opcode": op, "pct": 100 * sum(rs.values()) / total,
             "reasons_pct": {r: 100 * v / total for r, v in sorted(rs.items(), key=lambda kv: -kv[1])[:3]}}
            for op, rs in ranked]


@functools.lru_cache(maxsize=None)
def _kernel_source(file: str) -> tuple[str, ...]:
    """The lines of a kernel file of tttvideo/ttt (none for a file elsewhere, such as Triton's own)."""
    path = ROOT / "src" / "tttvideo" / "ttt" / file
    return tuple(path.read_text().splitlines()) if path.is_file() else ()


def _source_line(file: str, line: int) -> str:
    text = _kernel_source(file)
    return text[line - 1].strip() if 0 < line <= len(text) else ""


def print_tables(rows: list[dict]) -> None:
    print("\n| kernel | us | issue active % | warp cycles / issue | top stall reasons (% of samples) |")
    print("|---|---:|---:|---:|---|")
    for r in rows:
        top = ", ".join(f"{k} {v:.0f}" for k, v in list(r.get("by_reason_pct", {}).items())[:5])
        nan = float("nan")
        print(f"| {r['label']} | {r.get('duration_us', nan):.0f} | {r.get('issue_active_pct', nan):.1f}"
              f" | {r.get('warp_cycles_per_issue', nan):.1f} | {top} |")
    for r in rows:
        if r.get("by_opcode"):
            ops = ", ".join(f"{o['opcode']} {o['pct']:.0f}" for o in r["by_opcode"][:6])
            print(f"\n{r['label']}: samples by the waiting instruction's opcode (%): {ops}")
    for r in rows:
        print(f"\n{r['label']}: source lines by share of stall samples")
        for ln in r.get("by_line", [])[:10]:
            why = ", ".join(f"{k} {v:.1f}" for k, v in ln["reasons_pct"].items())
            print(f"  {ln['pct']:5.1f}%  {ln['file']}:{ln['line']:<4} ({why})  {ln['source'][:90]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=("train", "sample"), help="run the scans only (the profiled process)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON and the reports")
    ap.add_argument("--only", nargs="*", default=[], help="profile only the kernels whose label starts so")
    args = ap.parse_args()
    if args.workload:
        workload(args.workload)
        return

    import torch
    import triton

    from tttvideo.memory.profile.profiler import git_commit
    from tttvideo.results import save_json

    ncu = ncu_path()
    ncu_report = report_module(ncu)
    version = subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1:]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ttt_stalls_"))
    rows = []
    with open(work / "ncu.log", "w") as log:
        for label, wl, kernel, skip in PROFILES:
            if args.only and not any(label.startswith(o) for o in args.only):
                continue
            try:
                path = profile(ncu, label, wl, kernel, skip, work, log)
                row = read_report(ncu_report, path) if ncu_report else {"report": path.name}
            except Exception as e:  # noqa: BLE001 - one kernel's failure should not lose the others' tables
                print(f"[{label}] failed: {e}", flush=True)
                row = {"error": str(e)[-2000:]}
            rows.append({"label": label, "workload": wl, "launch_index": skip, **row})
    gpu = torch.cuda.get_device_name(0)
    tag = "h200" if "H200" in gpu else "h100" if "H100" in gpu else gpu.split()[-1].lower()
    res = {"device": gpu, "torch": torch.__version__, "triton": triton.__version__, "ncu": " ".join(version),
           "git_commit": git_commit(),
           "shape": {"B": B, "heads": H, "tokens": L, "head_dim": D, "checkpoint_group": GROUP,
                     "train_mini_batch": TRAIN_MB, "sample_mini_batch": SAMPLE_MB, "sample_batch": SAMPLE_BATCH},
           "what": "warp-state samples of one launch of each TTT-MLP kernel, each run alone under ncu's kernel "
                   "replay; % of the kernel's samples, by reason and by source line", "kernels": rows}
    save_json(out / f"ttt_kernel_stalls_{tag}.json", res)
    with tarfile.open(out / "ttt_kernel_stalls_reports.tar.gz", "w:gz") as tar:
        tar.add(work, arcname="ttt_kernel_stalls_reports")
    print_tables([r for r in rows if "error" not in r])


if __name__ == "__main__":
    main()
