"""benchmarks/model_step.py --yardstick diffusers on CPU with the tiny preset: our forward and training step and
diffusers' CogVideoXTransformer3DModel of the same preset, timed in one run on the same latents; the JSON holds both
and the ratios."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_scripts import load_benchmark

pytest.importorskip("diffusers")

pytestmark = pytest.mark.usefixtures("one_thread")

SMOKE = ["--preset", "tiny", "--device", "cpu", "--dtype", "fp32", "--height", "64", "--width", "96",
         "--text-tokens", "8", "--durations", "3", "--steps", "1", "--warmup", "0", "--yardstick", "diffusers"]


def model_step_module():
    return load_benchmark("model_step")


@pytest.mark.parametrize("ttt", ["true", "false"])
def test_yardstick_is_timed_beside_ours_at_the_same_shape(tmp_path, capsys, ttt):
    out = tmp_path / "x.json"
    assert model_step_module().main([*SMOKE, "--set", f"model.use_ttt={ttt}", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["model"]["use_ttt"] == (ttt == "true")
    (row,) = result["results"]
    assert row["forward_s"] > 0 and row["median_step_s"] > 0
    y = row["yardstick"]
    assert y["name"] == "diffusers CogVideoXTransformer3DModel" and y["version"]
    assert y["forward_s"] > 0 and y["train_step_s"] > 0
    # 3 s = one segment: the same latents [1, 13, 16, 8, 12] and the same 8 text tokens, so the same 320 tokens
    assert y["latents_shape"] == row["latents_shape"] == [1, 13, 16, 8, 12] == y["output_shape"]
    assert y["text_shape"] == [1, 8, 64] and row["text_shape"] == [1, 1, 8, 64]
    assert y["tokens"] == row["tokens"] == 320
    # qkvo: the attention trains, and the backward reached all of it through the checkpointed blocks
    assert 0 < y["trainable_params"] == y["params_with_grad"] < y["params"]
    assert y["vs_ours"]["forward"] == pytest.approx(y["forward_s"] / row["forward_s"])
    assert y["vs_ours"]["train_step"] == pytest.approx(y["train_step_s"] / row["median_step_s"])
    table = capsys.readouterr().out
    assert f"TTT {'on' if ttt == 'true' else 'off'}) against diffusers CogVideoXTransformer3DModel" in table


def test_without_the_option_nothing_is_added():
    args = model_step_module().parse_args(SMOKE[:-2])
    assert args.yardstick is None and not args.forward
