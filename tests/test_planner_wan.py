"""The planner on Wan: its counted parts come from the backbone's preset and layout (width, FFN width, TTT heads,
cross-attended text), the FFN over token chunks shrinks the hidden-layer part by what it leaves out, nested spans of
offloaded inputs are counted, and every constant measured on CogVideoX-5B is said to be extrapolated."""

from __future__ import annotations


from tttvideo.cli import main
from tttvideo.config.loader import load_config
from tttvideo.memory.plan.activations import BlockConstants, Geometry, fits_block_model, train_peak, working_set
from tttvideo.memory.plan.count import Counted

STAGE5 = "configs/wan2.1-1.3b/stage5-63s-24gb.toml"
K = BlockConstants(stream_copies=9.5, saved_extra_per_token=296.0, reserved_fraction=0.07, offload_reserved_units=2.5)
NOTHING = Counted(weights=0, gradients=0, optimizer=0, trainable_params=0, block_weights=0)
SUB_BLOCK = ["checkpointing.attention=true", "checkpointing.forward_ttt=true", "checkpointing.reverse_ttt=true",
             "checkpointing.mlp=true"]


def wan(*extra: str):
    """The 63-s 24 GB stage without the FFN chunks it sets, and `extra`."""
    return load_config(STAGE5, [*SUB_BLOCK, "checkpointing.ffn_chunk_tokens=0", *extra])


def test_geometry_is_read_from_the_wan_preset_and_layout():
    g = Geometry.of(wan())
    # 63 s at 480x832: 394,680 video tokens, no text in the stream; 30 blocks of width 1536, FFN 8960, TTT heads of
    # 64 (24 of them); each block cross-attends to 21 segments x 512 text tokens
    assert (g.units, g.dim, g.hidden, g.heads, g.head_dim) == (30, 1536, 8960, 24, 64)
    assert (g.tokens, g.act_bytes, g.cross_text_tokens, g.window_tokens) == (394680, 2, 21 * 512, 20280)
    assert g.backbone == "wan" and not g.measured and g.ffn_rows == g.tokens
    assert 1.0 < g.ffn_chunk_time() < 1.1


def test_ffn_chunks_leave_one_chunks_hidden_layer():
    def mlp_part(cfg) -> int:
        return next(p.nbytes for p in working_set(Geometry.of(cfg), K) if "MLP hidden" in p.name)

    assert mlp_part(wan()) == 394680 * 8960 * 2  # 6.6 GiB
    assert mlp_part(wan("checkpointing.ffn_chunk_tokens=32768")) == 32768 * 8960 * 2
    whole = train_peak(wan(), NOTHING, K)
    chunked = train_peak(wan("checkpointing.ffn_chunk_tokens=32768"), NOTHING, K)
    assert whole.allocated - chunked.allocated == (394680 - 32768) * 8960 * 2


def test_nested_spans_of_offloaded_inputs():
    """Spans of 5 over 30 blocks: forward saves 6 inputs; a pool of 14 GiB takes all 6, and a span's backward holds
    two fetched back plus its recomputed unit inputs beyond the first."""
    cfg = wan("checkpointing.nested_span=5", "checkpointing.offload_host_gib=14")
    assert (cfg.checkpointing.nested_span, cfg.checkpointing.offload_activations) == (5, True)
    assert fits_block_model(cfg)
    peak = train_peak(cfg, NOTHING, K)
    g = Geometry.of(cfg)
    s = g.stream + int(g.tokens * K.saved_extra_per_token)
    assert peak.host == 6 * s
    saved = next(p for p in peak.parts if p.name.startswith("saved inputs"))
    assert saved.nbytes == (2 + 4) * s and "4 of this span's unit inputs" in saved.name
    # CogVideoX's measured regime leaves that pair to a measurement
    assert not fits_block_model(load_config(None, [
        "model.preset=cogvideox-5b", "model.dtype=bf16", "model.adapter=qkvo", "checkpointing.block=true",
        *SUB_BLOCK, "checkpointing.nested_span=6", "checkpointing.offload_activations=true"]))


def test_plan_explains_wan_with_extrapolated_constants(capsys):
    code = main(["plan", STAGE5, "--gpu-mem", "80", "--explain", "--duration", "18s", "--all"])
    out = capsys.readouterr().out
    assert code == 0
    assert "counted (block model, extrapolated)" in out and "FFN chunks" in out
    assert "measured on CogVideoX-5B, extrapolated" in out
    assert "cross-attention keys and values of the text" in out
