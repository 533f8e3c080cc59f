"""The measured rows of benchmarks/plan_accuracy.py: one `Row` per measured setup (its config, overrides, role and
measured peaks and step time), read from the results files that plan_accuracy.py's docstring lists. `RESULTS` is the
folder they are read from (the tests point it at their own files)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
GIB = 2**30
# the block-model setup of benchmarks/model_step.py and benchmarks/memory_techniques.py (their bench_config)
STEP_SETUP = ["model.preset=cogvideox-5b", 'model.pretrained_path=""', "model.dtype=bf16", "model.adapter=qkvo",
              "model.use_ttt=true", "ttt.kind=mlp", "ttt.mini_batch_size=64", "ttt.base_lr=0.1",
              "ttt.scan_checkpoint_group_size=16", "checkpointing.block=true", "checkpointing.group_size=1",
              "layout.height=480", "layout.width=720", "layout.text_tokens=0", "train.precision=fp32",
              "train.batch_size=1", "checkpointing.attention=true", "checkpointing.forward_ttt=true",
              "checkpointing.reverse_ttt=true", "checkpointing.mlp=true", "train.optimizer=adamw8bit"]
SHIPPED_2GPU = re.compile(r"stage\d-\d+s-2gpu\.toml")  # the two-GPU stage configs the FSDP reserve is fitted on
NO_WEIGHTS = ["model.pretrained_path=", "train.init_from=", "memory.max_gpu_gib=0"]
# what the two-GPU chain rows calibrate (`BlockConstants.fsdp_reserved_fraction`), their allocated peaks held out
FSDP_RESERVE = "FSDP reserve (the two-GPU chain rows together)"


@dataclass
class Row:
    name: str
    source: str
    config: str | None  # a config file, or None for STEP_SETUP
    overrides: list[str]
    phase: str
    role: str  # "calibration" or "held out"
    allocated: float | None = None  # GiB measured
    reserved: float | None = None
    host: float | None = None
    step_s: float | None = None  # clean (steady-state) time only
    first_step: bool = False  # measured in a process's first step (no optimizer state before its optimizer step)
    oom_under: float | None = None  # GiB: ran out of memory under this cap
    plan_cap: float | None = None  # GiB: run under this cap, its predicted reserved peak + a margin (stage_chain.py
    # --cap-at-plan); with oom_under set too it ran out of memory there
    calibrates: str = ""  # the constants a calibration row fits
    time_role: str = ""  # where its step time's role differs from its memory's
    predicted: dict = field(default_factory=dict)
    gpus: int = 1  # the launch's GPUs (the memory figures are per GPU, the largest rank's)


# what the whole-block rows fix (`BlockConstants.block_stream_copies` and `block_time`)
WHOLE_BLOCK = "whole blocks: the parts' stream copies and time factor (with the offloaded row)"


def step_rows() -> list[Row]:
    from tttvideo.memory.techniques.common import BLOCK  # whole blocks checkpointed, their four parts not

    rows = []
    offloaded = ["checkpointing.offload_activations=true"]
    # memory_techniques.py's variants that the planner proposes (the ones leaving only some parts unchecked are a
    # policy it does not: they have no row)
    variant = {"kept": [], "nested": ["checkpointing.nested_span=6"], "offloaded": offloaded,
               "offloaded-block": offloaded + list(BLOCK), "kept-block": list(BLOCK)}
    # memory_techniques_h100.json (9 s) calibrates; runs at other lengths (--out memory_techniques_<D>s_h100.json)
    # are held out, their times clean as well; an H200's (memory_techniques_h200.json) is held out, memory only (the
    # costs' step times are an H100's), but for its whole-block row, which with the offloaded row beside it fixes the
    # whole-block constants (their time factor the ratio of the two H200 times, `_with_whole_block`)
    paths = sorted(RESULTS.glob("memory_techniques*_h100.json")) + sorted(RESULTS.glob("memory_techniques*_h200.json"))
    for path in paths:
        mt = json.loads(path.read_text())
        h100 = path.name.endswith("_h100.json")
        role = "calibration" if path.name == "memory_techniques_h100.json" else "held out"
        for r in mt["results"]:
            if "step_s" not in r or r["variant"] not in variant:
                continue
            # the whole-block constants' calibration: the H200's 30-s run (memory_techniques_h200.json); whole-block
            # rows of other runs are held out
            whole = r["variant"] == "offloaded-block" and path.name == "memory_techniques_h200.json"
            name = f"{mt['duration_s']} s, block inputs {r['variant']}"
            name += "" if role == "calibration" else " (2nd step)"
            name += "" if h100 else ", H200: memory only"
            rows.append(Row(name, path.name, None, [f"layout.duration={mt['duration_s']}s", *variant[r["variant"]]],
                            "train", "calibration" if whole else role, r["peak_allocated_gib"],
                            r["peak_reserved_gib"], r["offloaded_gib"], r["step_s"] if h100 else None,
                            calibrates=WHOLE_BLOCK if whole else ""))
    long = json.loads((RESULTS / "model_step_long_h100.json").read_text())
    for r in long["runs"]:
        over = [f"layout.duration={r['duration_s']}s"] + [f"{k}={json.dumps(v)}" for k, v in r["overrides"].items()]
        role = "calibration" if r["duration_s"] == 18 and "offload" in r["setup"] else "held out"
        rows.append(Row(r["setup"], "model_step_long_h100.json", None, over, "train", role, r["peak_allocated_gib"],
                        r["peak_reserved_gib"], r.get("offloaded_gib"), None, first_step=True,
                        calibrates="first step's offload reserve" if role == "calibration" else ""))
    # failures with no result file (issues 34 and 35): 63 s with fp8 frozen weights and every block input kept ran out
    # of memory in forward under a 79.2 GiB cap, and under 137 GiB in the recompute of block 41, 8 GiB short
    for cap in (79.2, 137.0):
        rows.append(Row(f"63 s, fp8 frozen, block inputs kept (OOM under {cap:g} GiB)", "issues 34/35 (no result file)",
                        None, ["layout.duration=63s", "model.frozen_weights=fp8"], "train", "held out",
                        first_step=True, oom_under=cap))
    return rows


def parallel_step_rows() -> list[Row]:
    """model_step.py under torchrun on two H200s (model_step_parallel_h200.json): the runs that record their
    overrides, held out, memory only (their second step: the optimizer state live, the first step's reserve kept),
    the largest rank's peak predicted per GPU."""
    path = RESULTS / "model_step_parallel_h200.json"
    rows = []
    for run in json.loads(path.read_text())["runs"] if path.is_file() else []:
        if "overrides" not in run:
            continue
        r = run["results"][0]
        row = Row(f"{r['duration_s']} s, {run['gpus']} GPUs (FSDP {run['parallel']['dp_shard']}, sp "
                  f"{run['parallel']['sp']}), {run['checkpointing_policy']}, H200: memory only", path.name, None,
                  run["overrides"], "train", "held out", r["peak_allocated_gib"], r["peak_reserved_gib"])
        row.gpus = run["gpus"]
        rows.append(row)
    return rows


def chain_rows() -> list[Row]:
    """The five-stage chain (benchmarks/stage_chain.py): each stage's config as shipped, every row held out. Its
    time is a later step's (no compilation); its memory the process's peak (`tttv train` never resets torch's peak
    statistics), its first step included, as the planner predicts a training process."""
    rows = []
    # stage_chain.py --out ...: other setups (their --set), and --gpus 2 (stage_chain_2gpu_<gpu>.json). An H200 chain
    # holds memory rows only: the step times of the costs are an H100's
    paths = sorted(RESULTS.glob("stage_chain*_h100.json")) + sorted(RESULTS.glob("stage_chain*_h200.json"))
    for path in paths:
        chain = json.loads(path.read_text())
        patterns = chain.get("configs", "configs/cogvideox-5b/{stage}-{gpus}gpu.toml")  # a list from 2026-11-29 on
        if (patterns if isinstance(patterns, str) else patterns[0]).split("/")[1] != "cogvideox-5b":
            continue  # another recipe's chain (stage_chain --configs): its rows name configs outside cogvideox-5b
        gpus = int(chain.get("gpus", 1))
        h100 = path.name.endswith("_h100.json")
        for r in chain["stages"]:
            if "error" in r:
                # a stage that ran out of memory under its planned cap is a plan that said "fits" wrongly; one
                # that ran out of the card's memory must be predicted not to fit the card
                card = _card_gib(chain, r)
                if r.get("status") == "oom" and ("cap_gib" in r or card):
                    row = _stage_row({**r, "peak_allocated_gib": None, "peak_reserved_gib": None}, chain, path,
                                     "cogvideox-5b", "chain ", None)
                    if "cap_gib" in r:
                        row.oom_under = row.plan_cap = r["cap_gib"]
                    else:
                        row.oom_under = card
                        row.name += f" (out of memory on the card, {card:.1f} GiB)"
                    row.gpus = gpus
                    rows.append(row)
                continue
            row = _stage_row(r, chain, path, "cogvideox-5b", "chain ", r["median_step_s"] if h100 else None)
            row.plan_cap = r.get("cap_gib")
            # a stage launched for one step (stage_chain.py --steps 1) is a process's first step: no optimizer
            # state in its backward, predicted so
            row.first_step = r.get("steps") == [1]
            row.name += ", one step" if row.first_step else ""
            row.name += "" if h100 else ", H200: memory only"
            # the two-GPU rows (FSDP, no sp) of the shipped two-GPU configs fix the FSDP reserve together; their
            # allocated peaks stay held out, and other GPU counts' rows (the four-GPU chain) and other configs at a
            # length (e.g. stage5-63s-2gpu-141gb.toml's whole blocks) are held out whole, as are runs under the
            # plan's cap (their reserve is the cap's, not the free run's the fraction is fitted to)
            if gpus == 2 and not _run_overrides(r, chain) and SHIPPED_2GPU.fullmatch(r["config"]) \
                    and "cap_gib" not in r:
                row.role, row.calibrates = "calibration", FSDP_RESERVE
            row.gpus = gpus
            if "superseded" in r:
                # a run whose program had a bug that changed its memory (the reason in the file, and the later runs
                # of the same config that replace it): shown, its step time still held out, its memory in no figure
                row.role, row.time_role = "superseded", "held out"
                row.name += " (memory superseded)"
            rows.append(row)
    return rows


def _run_overrides(r: dict, chain: dict) -> list[str]:
    """The --set overrides a chain stage ran with: each row its own run's (a chain run in parts merges them)."""
    return list(r.get("overrides", chain.get("overrides", [])))


def _card_gib(chain: dict, r: dict) -> float | None:
    """The memory of the card a stage_chain.py run had (GiB): recorded from 2026-12-06 on; before, the capacity that
    torch's out-of-memory message in the stage's error states."""
    if chain.get("gpu_total_gib"):
        return float(chain["gpu_total_gib"])
    found = re.search(r"total capacity of ([0-9.]+) GiB", " ".join(map(str, r.get("error", []))))
    return float(found.group(1)) if found else None


def _stage_row(r: dict, chain: dict, path: Path, recipe: str, prefix: str, step_s: float | None) -> Row:
    """A stage of a stage_chain.py result (`r`, one of `chain`'s stages) as a held-out row: its config as shipped
    (configs/<recipe>/), the overrides its run was given, one video a micro-batch, the process's peaks."""
    sets = _run_overrides(r, chain)
    # stage_chain.py --cap-at-plan: the stage ran under its predicted reserved peak plus a margin, so its reserved
    # peak is the allocator's under that cap (a card no larger than the plan), not what a larger card let it keep
    capped = f", under the plan's cap {r['cap_gib']:.1f} GiB" if "cap_gib" in r else ""
    return Row(f"{prefix}{r['duration_s']} s, {r['config']}" + (f" ({', '.join(sets)})" if sets else "") + capped,
               path.name,
               f"configs/{recipe}/{r['config']}",
               NO_WEIGHTS + [f"layout.duration={r['duration_s']}s", "train.batch_size=1", *sets], "train", "held out",
               r["peak_allocated_gib"], r["peak_reserved_gib"], None, step_s)


# the 63-s 24 GB Wan stage as fit_24gb_wan_h100.json measured it (commit c8307dc), before the window-wise form
WAN_63S_THEN = ["checkpointing.offload_host_gib=14", "checkpointing.nested_span=5",
                "checkpointing.attention_by_window=false", "checkpointing.ttt_chunk_tokens=0",
                "checkpointing.ttt_head_groups=1"]
WINDOW_FORM = "Wan: window-wise form's stream copies"


def wan_rows() -> list[Row]:
    """Wan2.1-1.3B under a 23 GiB cap (benchmarks/fit_24gb.py --backbone wan, `tttv profile --steps 2`: the process's
    peak). Wan's own constants come from these rows: its step time from the 3-s row (the 18-s time held out), its
    stream copies from both (the 3-s peak is 87% weights, gradients and optimizer state, so its activations cannot
    fix a constant alone); an out-of-memory row must be predicted not to fit its cap. The window-wise form's stream
    copies and time factor come from the H200's 63-s row (fit_24gb_wan_h200.json, the stage as shipped); the Wan
    chain's five stages (stage_chain_wan_24gb_h200.json, each config as shipped, the process's peak) are held out.
    The H200's step times are compared in H100 seconds (the costs' times are an H100's), by the ratio of the 3-s
    step on the two, so the chain's 3-s time calibrates that ratio."""
    rows = []
    path = RESULTS / "fit_24gb_wan_h100.json"
    for r in json.loads(path.read_text())["runs"] if path.is_file() else []:
        if r.get("phase") != "train" or r["status"] not in ("ok", "oom"):
            continue
        ok = r["status"] == "ok"
        short = ok and r["duration_s"] == 3
        then = [] if ok else WAN_63S_THEN
        row = Row(f"wan {r['name']}", path.name, r["config"],
                  NO_WEIGHTS + [f"layout.duration={r['duration_s']}s", *then],
                  "train", "calibration" if ok else "held out", r["peak_allocated_gib"] if ok else None,
                  r["peak_reserved_gib"] if ok else None, None, r.get("median_step_s"),
                  calibrates=("Wan: stream copies (with the 18-s row), step time" if short
                              else "Wan: stream copies (with the 3-s row)" if ok else ""),
                  time_role="" if short or not ok else "held out")
        if not ok:
            row.oom_under = r["cap_gib"]
            row.name += " (the config then: no window-wise form)"
        rows.append(row)
    # the H200's times in H100 seconds: the costs' step times are an H100's, and the 3-s step of the same setup took
    # 3.68 s there (fit_24gb_wan_h100.json) against 3.36 s in the H200's chain
    chain_path = RESULTS / "stage_chain_wan_24gb_h200.json"
    chain = json.loads(chain_path.read_text()) if chain_path.is_file() else {"stages": []}
    h100_3s = next((r.step_s for r in rows if r.calibrates.endswith("step time")), None)
    h200_3s = next((r["median_step_s"] for r in chain["stages"] if r["duration_s"] == 3 and r.get("median_step_s")),
                   None)
    to_h100 = h100_3s / h200_3s if h100_3s and h200_3s else None

    def h100_s(run: dict) -> float | None:
        return run["median_step_s"] * to_h100 if to_h100 and run.get("median_step_s") else None

    path = RESULTS / "fit_24gb_wan_h200.json"
    for r in json.loads(path.read_text())["runs"] if path.is_file() else []:
        if r.get("phase") == "train" and r["status"] == "ok" and r["duration_s"] == 63:
            rows.append(Row(f"wan {r['name']}, H200", path.name, r["config"],
                            NO_WEIGHTS + [f"layout.duration={r['duration_s']}s"], "train", "calibration",
                            r["peak_allocated_gib"], r["peak_reserved_gib"], None, h100_s(r),
                            calibrates=WINDOW_FORM))
    for r in chain["stages"]:
        if "error" in r:
            continue
        row = _stage_row(r, chain, chain_path, "wan2.1-1.3b", "wan chain ", h100_s(r))
        row.time_role = "calibration" if r["duration_s"] == 3 else ""
        rows.append(row)
    return rows


def profile_rows() -> list[Row]:
    rows = []
    try:
        from benchmarks.plan_calibration import calibrates, setup_overrides
    except ImportError:  # run as a script: this folder is on sys.path
        from plan_calibration import calibrates, setup_overrides

    cal = json.loads((RESULTS / "plan_calibration_h100.json").read_text())
    for r in cal["setups"]:
        if r["status"] != "ok":
            continue
        rows.append(Row(f"{r['name']} @ {r['duration']}", "plan_calibration_h100.json", r["config"],
                        NO_WEIGHTS + setup_overrides(r) + [f"layout.duration={r['duration']}"] + r["overrides"],
                        r["phase"],
                        "calibration" if calibrates(r) else "held out", r["peak_allocated"] / GIB,
                        r["peak_reserved"] / GIB, None, r["step_seconds"][-1] if r.get("step_seconds") else None))
    check = json.loads((RESULTS / "plan_check_h100.json").read_text())
    for r in check["setups"]:
        over = [f"layout.duration={r['duration']}"] + [f"{k}={json.dumps(v)}" for k, v in r["overrides"].items()]
        cap = r.get("cap_gib") or 0
        row = Row(f"{r['setup']} @ {r['duration']} ({r['role']}, {r['gpu_mem_gib']:.0f} GiB)", "plan_check_h100.json",
                  "configs/cogvideox-5b/24gb-3s.toml", NO_WEIGHTS + over, "train", "held out",
                  r["peak_allocated"] / GIB if r["status"] == "ok" else None,
                  r["peak_reserved"] / GIB if r["status"] == "ok" else None)
        if r["status"] == "oom":
            row.oom_under = cap
        rows.append(row)
    return rows


def cap_check_rows() -> list[Row]:
    """benchmarks/plan_cap_check.py's runs: a setup measured above its prediction, run again under the predicted
    reserved peak + a margin (the same config and overrides), held out, memory only."""
    rows = []
    for path in sorted(RESULTS.glob("plan_cap_check_*.json")):
        for r in json.loads(path.read_text())["rows"]:
            if r["status"] not in ("ok", "oom"):
                continue
            ok = r["status"] == "ok"
            row = Row(f"{r['setup']}, under the plan's cap {r['cap_gib']:g} GiB", path.name, r["config"],
                      r["overrides"], r["phase"], "held out", r["peak_allocated_gib"] if ok else None,
                      r["peak_reserved_gib"] if ok else None, plan_cap=r["cap_gib"])
            row.oom_under = None if ok else r["cap_gib"]
            rows.append(row)
    return rows


def setup_key(row: Row) -> tuple:
    """What makes two rows runs of one setup: config, overrides and phase."""
    return row.config, tuple(row.overrides), row.phase


def capped_runs(rows: list[Row]) -> dict[tuple, list[tuple[float, bool]]]:
    """Every run under the plan's cap by setup: (cap GiB, whether it ran) each."""
    capped: dict[tuple, list[tuple[float, bool]]] = {}
    for r in rows:
        if r.plan_cap is not None:
            capped.setdefault(setup_key(r), []).append((r.plan_cap, r.oom_under is None))
    return capped


def cap_answers(runs: list[tuple[float, bool]], cap: float) -> bool:
    """Whether capped runs of a setup answer a cap of `cap` GiB: one ran under it or a smaller one (so the cap is
    memory enough), or one ran out of memory under it or a larger one (so it is not)."""
    return any(c <= cap if ran else c >= cap for c, ran in runs)


def all_rows() -> list[Row]:
    """Every measured row, in the table's order."""
    return (step_rows() + parallel_step_rows() + profile_rows() + chain_rows() + wan_rows()
            + cap_check_rows())


def config_of(row: Row):
    from tttvideo.config.loader import load_config

    if row.config is None:
        return load_config(None, STEP_SETUP + row.overrides)
    return load_config(ROOT / row.config, row.overrides)
