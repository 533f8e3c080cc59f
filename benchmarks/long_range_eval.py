"""The held-out half of benchmarks/long_range.py: the stories every run samples, the probe's live check, and the
sampling of a run's stories as batches.

A run's stories are sampled several at a time: one forward of the model per solver step for a batch of stories
(guidance batched as well) instead of one per story. At the benchmark's sizes a forward is launch-bound, so this
cuts a run's sampling by about the batch size; each story keeps its own initial noise (its seed, drawn as the
sampler draws it), and the latents equal the sampler's story by story (tests/test_long_range_benchmark.py)."""

from __future__ import annotations

import statistics

EVAL_SEED = 9_000  # the held-out stories: another generator stream than any training set's


def eval_stories(segments: int, count: int):
    """`count` long-range stories of `segments` scenes, the same for every variant and seed."""
    import numpy as np

    from tttvideo.data.demo import long_range_video
    from tttvideo.sample.scenes import Scene, Story

    rng = np.random.Generator(np.random.PCG64(EVAL_SEED + segments))
    videos = [long_range_video(rng, segments) for _ in range(count)]
    # each story its own noise: with one seed for all, a model that knows nothing of the colour draws the same ones
    # in every story, and every such variant scores the same
    stories = [Story(name=f"eval-{i:03d}", source="benchmarks/long_range.py",
                     scenes=[Scene(**scene) for scene in v.story()], seed=EVAL_SEED + i) for i, v in enumerate(videos)]
    return videos, stories


def probe_check(cfg, videos) -> dict:
    """The probe on the held-out stories' own latents (kept) and on the same stories with every later scene in
    another colour (forgotten): 1.0 and 0.0 when it reads what it should."""
    import torch

    from tttvideo.data.demo import forgotten_colour, render_video
    from tttvideo.data.demo_score import latent_frames, score_persistence
    from tttvideo.layout import VideoLayout
    from tttvideo.models.backbone import get_preset

    layout = VideoLayout.from_config(cfg.layout, cfg.ttt)
    channels = get_preset(cfg.model.preset).in_channels
    kept, lost = [], []
    for v in videos:
        captions = [s.caption for s in v.scenes]
        for video, into in ((v, kept), (forgotten_colour(v), lost)):
            frames = latent_frames(torch.from_numpy(render_video(video, layout, channels)).permute(1, 0, 2, 3))
            into.append(score_persistence(frames, captions).accuracy)
    return {"kept": statistics.mean(kept), "forgotten": statistics.mean(lost)}


def denoise_batch(model, layout, conds: list, unconds: list, sample_cfg, seeds: list[int], device):
    """`tttvideo.sample.guidance.denoise` for several stories of one layout at once: clean latents [n, T, C, h, w]
    (float32, CPU), story i from its text (conds[i] / unconds[i]: [segments, tokens, dim]) and seeds[i]'s noise.
    A deterministic solver only (the stochastic one draws its noise per story between steps)."""
    import torch

    from tttvideo.models.backbone import backbone_of
    from tttvideo.sample.guidance import GuidanceSchedule, GuidedPrediction
    from tttvideo.sample.solvers import make_solver

    spec = model.spec
    solver = make_solver(sample_cfg.solver, backbone_of(spec).objective.schedule(), sample_cfg.steps)
    if solver.stochastic:
        raise SystemExit(f"sample.solver = {sample_cfg.solver!r} draws noise per story at every step; the "
                         f"benchmark samples stories in batches with a deterministic solver (ddim)")
    shape = (1, layout.latent_frames, spec.in_channels, layout.latent_height, layout.latent_width)
    # as denoise draws it: each story's first draw from a CPU generator of its seed
    x = torch.cat([torch.randn(shape, generator=torch.Generator(device="cpu").manual_seed(int(s)),
                               dtype=torch.float32) for s in seeds]).to(device)
    scales = GuidanceSchedule(sample_cfg.cfg_schedule, sample_cfg.cfg, sample_cfg.cfg_start,
                              sample_cfg.cfg_ramp_exp).scales(len(solver.timesteps))
    dtype = next(model.parameters()).dtype
    predict = GuidedPrediction(model, layout, torch.stack(conds).to(device=device, dtype=dtype),
                               torch.stack(unconds).to(device=device, dtype=dtype), batched=sample_cfg.cfg_batched,
                               fall_back_on_oom=True)
    with torch.no_grad():
        for i, t in enumerate(solver.timesteps):
            x = solver.step(i, x, predict(x, t, scales[i]))
    return x.cpu()


def sample_batched(cfg, stories: list, checkpoint, device, batch: int) -> list:
    """Clean latents [T, C, h, w] of every story (one layout: same scene count), `batch` stories per forward, from
    the model of `checkpoint` (a run folder)."""
    import torch

    from tttvideo.models.backbone import get_preset
    from tttvideo.sample.model import load_model
    from tttvideo.sample.pipeline import encode_stories, story_layouts

    layouts = story_layouts(cfg, stories)
    if len({(lay.num_segments, lay.total_tokens) for lay in layouts}) != 1:
        raise ValueError("sample_batched takes stories of one layout (one duration)")
    texts, _ = encode_stories(cfg, stories, layouts, get_preset(cfg.model.preset).text_embed_dim, device)
    out = []
    with load_model(cfg, checkpoint, device) as loaded:
        for start in range(0, len(stories), batch):
            part = slice(start, start + batch)
            latents = denoise_batch(loaded.model, layouts[0], [c for c, _ in texts[part]],
                                    [u for _, u in texts[part]], cfg.sample, [s.seed for s in stories[part]], device)
            out += list(latents)
        del loaded
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out
