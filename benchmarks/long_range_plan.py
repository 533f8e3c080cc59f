"""The run plan of benchmarks/long_range.py: which runs are left (seed by seed), what each costs in wall time (the
held runs' median for a row and duration it holds, else a factor model fitted to the default config on an H200), how
they pack onto --jobs slots, and which of them --budget-s lets start."""

from __future__ import annotations

import heapq
import statistics
import time

# The run plan: a run's wall time = PLAN_STARTUP_S + row factor x (segments / 3) x --plan-step-s x (training steps +
# PLAN_SAMPLE_STEP x solver steps of its batches of held-out stories). Fitted to the default config's runs of seed 0
# on one NVIDIA H200 (commit 740823e, --jobs 3, 1000 steps of batch 16, 64 stories of 20 solver steps 32 at a time;
# wall s per run at 9 s: none 107, full attention 117, Mamba 2 177, Gated DeltaNet 206, TTT-Linear 229, TTT-MLP 472,
# in two launches of three; at 18 s with 2 jobs none 141, full attention 159). More jobs do not finish more: the
# 250-step runs of commit 4847a47 with 8 jobs took 0.50 s a step on the mean where 3 jobs take 0.18 (the processes
# time-slice the GPU).
# Start-up: a run spent 9-11 s outside its training and sampling (process, imports, scoring) and 9-19 s of its
# training outside its median steps (data set, model, compile warm-up) where the row has no TTT kernels.
PLAN_STARTUP_S = 30.0
# a solver step of a batch of 32 held-out stories (one forward, guidance batched), in training steps: the runs above
# sampled for 3-8 s each (40 forwards), which this prices at 3-17 s
PLAN_SAMPLE_STEP = 1.0
# a row's seconds per step relative to the mean of the main rows' at 9 s (--plan-step-s, 0.18 s there): per row the
# run's (wall - start-up) / (segments / 3) / (1000 + 40) step-equivalents, fitted to the default config's 1000-step
# runs of seed 0 at 9 s on an H200 with 3 jobs (commit 740823e: none 0.074 s, full attention 0.084, Mamba 2 0.141,
# Gated DeltaNet 0.169, TTT-Linear 0.191, TTT-MLP 0.425; Mamba 2 and Gated DeltaNet on the PyTorch recurrence, fla
# not installed). TTT-MLP's includes its kernels' warm-up (its 1000 training steps took 454 s, 302 s of them at the
# median step). Its ablations not measured at 1000 steps are priced as TTT-MLP; the reference learning-rate layout
# runs the PyTorch scan, one step per mini-batch (not measured: 3x the Triton scan's, as the first plan assumed).
# The 18-s runs of none and full attention took 0.72 and 0.74 of the segment scaling (2 jobs): the plan errs long.
PLAN_ROW_STEP = {"none": 0.41, "full-attention": 0.46, "mamba2": 0.78, "gated-deltanet": 0.94, "ttt-linear": 1.06,
                 "ttt-mlp": 2.35, "ttt-mlp-eta-reference": 7.1, "ttt-linear-eta-reference": 3.2}


def num_segments(cfg) -> int:
    from tttvideo.layout import VideoLayout

    return VideoLayout.from_config(cfg.layout, cfg.ttt).num_segments


def plan_runs(variants: list[str], durations: str, seeds: str, ablations: list[str], ablation_durations: str,
              ablation_seeds: str, done: set) -> list[tuple[str, str, int]]:
    """The runs to make, seed by seed (each seed's main rows at every duration, then its ablations): a table cut
    short holds whole comparisons over fewer seeds, not some rows over every seed."""
    main = {int(s) for s in seeds.split(",") if s}
    abl = {int(s) for s in ablation_seeds.split(",") if s} if ablations else set()
    plan = []
    for seed in sorted(main | abl):
        if seed in main:
            plan += [(v, d, seed) for d in durations.split(",") for v in variants]
        if seed in abl:
            plan += [(a, d, seed) for d in ablation_durations.split(",") for a in ablations]
    return [run for run in plan if run not in done]


def estimate_run_s(cfg, steps: int, step_s: float, eval_videos: int, eval_batch: int, segments: int,
                   row: str) -> float:
    """The run plan's seconds for one run: start-up, the training steps, the sampling (a solver step of a batch of
    stories priced as a training step); a step costs in proportion to the video's segments (the default config's
    18-s runs took 1.2-2.4x the wall time of its 9-s ones on the H200; after start-up 1.4-2.9x,
    2.2x on the mean)."""
    scale = segments / 3 * PLAN_ROW_STEP.get(row, PLAN_ROW_STEP["ttt-mlp"])
    forwards = -(-eval_videos // eval_batch) * cfg.sample.steps
    return PLAN_STARTUP_S + scale * step_s * (steps + PLAN_SAMPLE_STEP * forwards)


def held_run_s(runs: list[dict], jobs: int) -> dict[tuple[str, str], float]:
    """(row, duration) -> the median wall time (s) of the held runs of it made with `jobs` runs at once: what the
    plan prices such a run at. A run's time depends on what shares the device (seed 1's 18-s TTT-MLP run took
    1,106 s beside TTT-Linear and Gated DeltaNet, seed 0's 904 s beside lighter rows), which the row factors,
    fitted to one seed's mix, do not see."""
    walls: dict[tuple[str, str], list[float]] = {}
    for r in runs:
        if r.get("concurrent_jobs") == jobs and r.get("wall_s"):
            walls.setdefault((r["variant"], r["duration"]), []).append(float(r["wall_s"]))
    return {key: statistics.median(w) for key, w in walls.items()}


def print_plan(pending: list[tuple[str, str, int]], runs: list[dict], args, steps: int, cfg) -> dict:
    """What will run and how long it should take, before anything trains; returns each run's estimate (s): the
    median of the held runs of its row and duration made with as many jobs, else the factor model."""
    from tttvideo.config.loader import load_config

    if not pending:
        print(f"run plan: nothing to train ({len(runs)} runs held in {args.out})")
        return {}
    segments = {d: num_segments(load_config(args.config, [f"layout.duration={d}"] + args.overrides))
                for d in {d for _, d, _ in pending}}
    measured = held_run_s(runs, args.jobs)
    runs_s = [measured.get((v, d)) or estimate_run_s(cfg, steps, args.plan_step_s, args.eval_videos,
                                                     args.eval_batch, segments[d], v)
              for v, d, _ in pending]
    priced = sum((v, d) in measured for v, d, _ in pending)
    # the runs in their order on the slots (--jobs a GPU), each started when a slot frees: the last to end sets the
    # total
    total = max(end for _, end in pack(runs_s, slots(args)))
    by_row: dict[str, int] = {}
    for v, _, _ in pending:
        by_row[v] = by_row.get(v, 0) + 1
    budget = ""
    if args.budget_s:  # the budget's rule by the plan: a freed slot takes the first run that ends within it
        within = [span for span in pack(runs_s, slots(args), args.budget_s) if span]
        budget = (f"; --budget-s {args.budget_s:.0f} starts no run past it: by the plan, {len(within)} of the "
                  f"{len(pending)} runs, in {max((end for _, end in within), default=0):.0f} s")
    pricing = f"at a step of {args.plan_step_s} s (--plan-step-s, the main rows' mean at 9 s)"
    held_median = f"at the median of the held runs of their row and duration with {args.jobs} jobs"
    if priced == len(pending):
        pricing = f"each {held_median}"
    elif priced:
        pricing = f"{priced} of them {held_median}, the rest {pricing}"
    gpus = getattr(args, "gpus", 1)
    at_once = f"{args.jobs} at once" + (f" on each of {gpus} GPUs" if gpus > 1 else "")
    print(f"run plan: {len(pending)} runs ({len(runs)} held already), {at_once}, {steps} steps of batch "
          f"{cfg.train.batch_size} each, {args.eval_videos} stories of {cfg.sample.steps} denoising steps sampled "
          f"{args.eval_batch} at a time; a run {min(runs_s):.0f}-{max(runs_s):.0f} s, {pricing}: about {total:.0f} s "
          f"({total / 60:.1f} min) in all" + budget, flush=True)
    print("  runs per row: " + ", ".join(f"{v} {n}" for v, n in by_row.items()), flush=True)
    over = [(s, f"{d} {v}") for (v, d, _), s in zip(pending, runs_s) if args.budget_s and s > args.budget_s]
    if over:
        s, name = max(over)
        print(f"  {len(over)} run(s) planned longer than --budget-s {args.budget_s:.0f} (the longest: {name}, "
              f"{s:.0f} s): such a run starts only if the runs before it beat their plan by that much, in no "
              f"rerun with this budget otherwise (a larger --budget-s or fewer --steps)", flush=True)
    return dict(zip(pending, runs_s))


def slots(args) -> int:
    """Runs at once: --jobs on each of --gpus GPUs."""
    return args.jobs * getattr(args, "gpus", 1)


def pack(runs_s: list[float], jobs: int, budget_s: float = 0.0) -> list[tuple[float, float] | None]:
    """Start and end (s) of each run on `jobs` slots: when a slot frees it takes the first run in order that ends
    within `budget_s` (0: any, so all start in order); None for a run that never starts."""
    slots = [0.0] * max(1, jobs)
    spans: list[tuple[float, float] | None] = [None] * len(runs_s)
    queue = list(range(len(runs_s)))
    while queue and slots:
        t = heapq.heappop(slots)
        fit = next((i for i in queue if not budget_s or t + runs_s[i] <= budget_s), None)
        if fit is None:  # the other slots free later still: this one stays idle
            continue
        queue.remove(fit)
        spans[fit] = (t, t + runs_s[fit])
        heapq.heappush(slots, t + runs_s[fit])
    return spans


def fits_budget(args, start: float, planned: float, ratios: list[float]) -> bool:
    """Whether a run planned to take `planned` seconds, started now, ends within --budget-s: its plan scaled by
    the slowest of the last finished runs (as many as run at once) wall time over their plan's (the plan alone before
    any)."""
    if not args.budget_s:
        return True
    expected = planned * (max(ratios[-slots(args):]) if ratios else 1.0)
    return time.perf_counter() - start + expected <= args.budget_s
