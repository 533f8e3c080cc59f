"""The model without diffusers: block wiring, the no-TTT baseline, input checks, adapters, activation checkpointing
(gradients equal to the plain run) and our own safetensors checkpoints."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from tttvideo.config.schema import CheckpointingConfig, CheckpointRule, Config, TTTConfig
from tttvideo.errors import ConfigError, LayoutError, UserError
from tttvideo.layout import VideoLayout
from tttvideo.models import (CogVideoXTTT, apply_adapter, apply_checkpointing, build_model, get_preset, init_model,
                             load_checkpoint, print_trainable_summary, save_checkpoint, trainable_summary)
from tttvideo.models.checkpointing import KEPT_OPS, block_units, describe_policy, resolve_policy

TTT = TTTConfig(mini_batch_size=16, scan_checkpoint_group_size=2)
H_LAT, W_LAT, TEXT = 4, 6, 5  # 2 x 3 tokens per frame


pytestmark = pytest.mark.usefixtures("one_thread")


def spec(layers: int = 2):
    return dataclasses.replace(get_preset("tiny"), name=f"tiny{layers}", num_layers=layers)


def model_of(layers: int = 2, seed: int = 0, use_ttt: bool = True) -> CogVideoXTTT:
    torch.manual_seed(seed)
    return init_model(spec(layers), TTT, use_ttt)


def inputs(segments: int, batch: int = 1, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, 13 + 12 * (segments - 1), 16, H_LAT, W_LAT, generator=g)
    text = torch.randn(batch, segments, TEXT, 64, generator=g)
    return latents, text, torch.tensor([400.0] * batch)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


# ------------------------------------------------------------------------------------------------ structure
def test_tiny_preset_builds_from_config_and_runs():
    cfg = Config()
    cfg.ttt.mini_batch_size = 16
    model = build_model(cfg)
    assert model.spec.name == "tiny" and len(model.blocks) == 2
    latents, text, t = inputs(2)
    out = model(latents, text, t)
    assert out.shape == latents.shape and torch.isfinite(out).all()


def test_ttt_sees_attention_output_before_the_gate():
    model = model_of()
    block = model.blocks[0]
    seen = {}
    block.attn.register_forward_hook(lambda m, i, o: seen.__setitem__("attn", o))
    block.ttt.register_forward_hook(lambda m, i, o: seen.update(ttt_in=i[0], ttt_out=o))
    block.norm1.register_forward_hook(lambda m, i, o: seen.update(x=i[0], gate=o[1], text_gate=o[2]))
    block.norm2.register_forward_hook(lambda m, i, o: seen.__setitem__("x1", i[0]))
    with torch.no_grad():
        model(*inputs(2))
    assert seen["ttt_in"] is seen["attn"]
    layout = VideoLayout.from_latents(25, H_LAT, W_LAT, TEXT, model.spec.patch_size,
                                      model.ttt_config.mini_batch_size)
    T = layout.total_text_tokens
    x, z = seen["x"], seen["ttt_out"]
    expect = torch.cat([x[:, :T] + seen["text_gate"][:, None] * z[:, :T],
                        x[:, T:] + seen["gate"][:, None] * z[:, T:]], 1)
    torch.testing.assert_close(seen["x1"], expect)
    # and the TTT output is not its input (gates 0.1): the TTT layer takes part
    assert rel(z, seen["attn"]) > 1e-3


def test_no_ttt_baseline_equals_gates_at_zero():
    with_ttt = model_of()
    with_ttt.set_ttt_gates(0.0)
    baseline = model_of(use_ttt=False)
    assert not any(".ttt." in n for n, _ in baseline.named_parameters())
    missing, unexpected = baseline.load_state_dict(with_ttt.state_dict(), strict=False)
    assert not missing and all(".ttt." in n for n in unexpected)
    args = inputs(3)
    with torch.no_grad():
        torch.testing.assert_close(baseline(*args), with_ttt(*args), rtol=0, atol=0)


def test_input_errors_are_one_sentence():
    model = model_of()
    latents, text, t = inputs(3)
    with pytest.raises(LayoutError, match="3-s segment.*one text embedding per segment"):
        model(latents, text[:, :2], t)
    with pytest.raises(LayoutError, match="14 latent frames is not 13 \\+ 12"):
        model(latents[:, :14], text, t)
    with pytest.raises(LayoutError, match="32-d; the model takes 64-d"):
        model(latents, text[..., :32], t)
    with pytest.raises(LayoutError, match="8 channels"):
        model(latents[:, :, :8], text, t)
    # a list of per-segment embeddings is accepted
    with torch.no_grad():
        torch.testing.assert_close(model(latents, list(text.unbind(1)), t), model(latents, text, t))


# ------------------------------------------------------------------------------------------------ adapters
def trainable(model):
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_adapter_requires_grad_sets():
    model = model_of()
    names = {n for n, _ in model.named_parameters()}
    apply_adapter(model, "sft")
    assert trainable(model) == names
    apply_adapter(model, "qkvo")
    expect = {n for n in names if ".attn." in n or ".ttt." in n}
    assert trainable(model) == expect
    assert "blocks.0.attn.norm_k.weight" in expect and "blocks.1.ttt.reverse_gate_video" in expect
    assert "blocks.0.ttt.ttt.W2" in expect and "blocks.0.ttt.ttt.wo.weight" in expect
    assert "blocks.0.mlp.fc1.weight" not in expect and "embed.patch.weight" not in expect
    assert "blocks.0.norm1.linear.weight" not in expect


def test_lora_adapter():
    model = model_of()
    args = inputs(1)
    with torch.no_grad():
        before = model(*args)
    apply_adapter(model, "lora", lora_rank=4, lora_alpha=8.0)
    names = trainable(model)
    lora = {n for n in names if "lora_" in n}
    # A and B on q/k/v/o of every block, nowhere else
    assert len(lora) == 2 * 4 * 2
    assert all(".attn.to_" in n for n in lora)
    assert names - lora == {n for n, _ in model.named_parameters() if ".ttt." in n}
    assert "blocks.0.attn.to_q.base_layer.weight" not in names
    assert model.blocks[0].attn.to_q.lora_A["default"].weight.shape == (4, 64)
    with torch.no_grad():  # LoRA B starts at 0: the function is unchanged
        torch.testing.assert_close(model(*args), before)
    rows = {r["group"]: r for r in trainable_summary(model)}
    assert rows["attention"]["trainable"] == 0 and rows["lora"]["trainable"] == rows["lora"]["params"] > 0
    assert rows["total"]["trainable"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    buf = io.StringIO()
    from rich.console import Console

    print_trainable_summary(model, console=Console(file=buf, width=100))
    assert "lora" in buf.getvalue() and "backbone" in buf.getvalue()


def test_unknown_adapter():
    with pytest.raises(ConfigError, match="model.adapter 'full'"):
        apply_adapter(model_of(), "full")


# ------------------------------------------------------------------------------------------------ checkpointing
def test_policy_resolution():
    cfg = CheckpointingConfig(mlp=True, layers=[
        CheckpointRule(layers="0:4", block=True, group_size=2),
        CheckpointRule(layers="4:6", block=True, group_size=3),
        CheckpointRule(layers="-1", attention=True),
    ])
    policies = resolve_policy(cfg, 8)
    assert [p.mlp for p in policies] == [False] * 6 + [True, False]
    assert policies[7].attention and not policies[7].block
    assert block_units(policies) == [(0, 2, True), (2, 4, True), (4, 6, True), (6, 7, False), (7, 8, False)]
    with pytest.raises(ConfigError, match="'9:' covers none of the model's 8 layers"):
        resolve_policy(CheckpointingConfig(layers=[CheckpointRule(layers="9:")]), 8)
    with pytest.raises(ConfigError, match="'first third' is not a layer range"):
        resolve_policy(CheckpointingConfig(layers=[CheckpointRule(layers="first third")]), 8)


def grads(model, args):
    model.zero_grad(set_to_none=True)
    latents = args[0].clone().requires_grad_()
    out = model(latents, *args[1:])
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    (out * w).sum().backward()
    return out.detach(), latents.grad, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_checkpointing_keeps_gradients():
    model = model_of(layers=4)
    apply_adapter(model, "sft")
    args = inputs(2)
    plain = grads(model, args)
    cfg = CheckpointingConfig(layers=[
        CheckpointRule(layers="0:2", block=True, group_size=2, forward_ttt=True),
        CheckpointRule(layers="2", attention=True, mlp=True, forward_ttt=True, reverse_ttt=True),
        CheckpointRule(layers="3", block=True, reverse_ttt=True, mlp=True),
    ])
    apply_checkpointing(model, cfg)
    assert model.block_units == [(0, 2, True), (2, 3, False), (3, 4, True)]
    assert model.blocks[2].checkpoint_attention and model.blocks[2].ttt.checkpoint_reverse
    # count recomputation: with checkpointing, attention runs again in backward
    calls = []
    model.blocks[2].attn.register_forward_pre_hook(lambda *a: calls.append(1))
    remat = grads(model, args)
    assert len(calls) == 2
    torch.testing.assert_close(remat[0], plain[0], rtol=0, atol=0)
    torch.testing.assert_close(remat[1], plain[1], rtol=1e-6, atol=1e-7)
    assert remat[2].keys() == plain[2].keys() and len(plain[2]) == len(list(model.parameters()))
    for name in plain[2]:
        torch.testing.assert_close(remat[2][name], plain[2][name], rtol=1e-6, atol=1e-7, msg=name)


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the operators that run under it, by packet. Entered around a backward, it sees the recompute of
    checkpointed regions, but not the operators whose outputs selective checkpointing kept (those never run)."""

    def __init__(self):
        super().__init__()
        self.counts: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket] = self.counts.get(func.overloadpacket, 0) + 1
        return func(*args, **(kwargs or {}))

    def of(self, kind: str) -> int:
        return sum(self.counts.get(op, 0) for op in KEPT_OPS[kind])


def backward_counts(model, args, keep):
    """(gradients, operator counts of the backward) with every block checkpointed, keeping `keep`."""
    apply_checkpointing(model, CheckpointingConfig(block=True, keep=list(keep)))
    model.zero_grad(set_to_none=True)
    out = model(*args)
    with OpCounter() as counter:
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(5))).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, counter


def test_selective_checkpointing_keeps_what_it_names_and_the_gradients():
    """checkpointing.keep: the recompute of a checkpointed block skips the kept operators (their outputs saved in
    forward), and the gradients equal those of full recomputation (fp32, 1e-6)."""
    model = model_of(layers=3, use_ttt=False)
    apply_adapter(model, "sft")
    args = inputs(1)
    full, counted = backward_counts(model, args, ())
    assert counted.of("attention") == 3  # every layer's attention ran again in backward
    for keep in (("attention",), ("attention", "matmul")):
        kept, counter = backward_counts(model, args, keep)
        assert counter.of("attention") == 0, keep
        if "matmul" in keep:  # the backward's own products only: the 3 x 8 forward ones (6 linears + 2 adaLN) kept
            assert counter.of("matmul") == counted.of("matmul") - 3 * 8
        for name in full:
            torch.testing.assert_close(kept[name], full[name], rtol=1e-6, atol=1e-7, msg=name)
    assert describe_policy(resolve_policy(CheckpointingConfig(block=True, keep=["matmul", "attention"]), 3)) == [
        "0-2: block x1, keeping attention and matmul"]
    with pytest.raises(ConfigError, match=r"layers 1\.\.2 checkpoint none; set checkpointing.block = true"):
        resolve_policy(CheckpointingConfig(keep=["attention"], layers=[CheckpointRule(layers="0", block=True)]), 3)


def test_keeping_matmul_keeps_the_backbones_products_only():
    """keep = ["matmul"] saves the backbone's products (6 linears and 2 adaLN per block) and recomputes the TTT
    layer's (its projections and the scan's products): the backward runs every product of full recomputation but
    those 2 x 8; the gradients are those of full recomputation."""
    model = model_of(layers=2)
    apply_adapter(model, "sft")
    args = inputs(2)
    full, counted = backward_counts(model, args, ())
    kept, counter = backward_counts(model, args, ("matmul",))
    assert counter.of("matmul") == counted.of("matmul") - 2 * 8
    for name in full:
        torch.testing.assert_close(kept[name], full[name], rtol=1e-6, atol=1e-7, msg=name)


def test_selective_checkpointing_nests_with_the_ttt_checkpoints():
    """keep on checkpointed blocks whose TTT passes (and the scan) are checkpointed inside: same gradients."""
    model = model_of(layers=2)
    apply_adapter(model, "sft")
    args = inputs(2)
    plain = grads(model, args)
    apply_checkpointing(model, CheckpointingConfig(layers=[
        CheckpointRule(layers="0", block=True, keep=["attention", "matmul"], forward_ttt=True, reverse_ttt=True),
        CheckpointRule(layers="1", attention=True, mlp=True, keep=["attention"])]))
    kept = grads(model, args)
    torch.testing.assert_close(kept[0], plain[0], rtol=0, atol=0)
    for name in plain[2]:
        torch.testing.assert_close(kept[2][name], plain[2][name], rtol=1e-6, atol=1e-7, msg=name)


# ------------------------------------------------------------------------------------------------ own checkpoints
def test_checkpoint_round_trip(tmp_path):
    a, b = model_of(seed=0), model_of(seed=1)
    args = inputs(1)
    path = save_checkpoint(a, tmp_path / "full.safetensors")
    with torch.no_grad():
        assert rel(b(*args), a(*args)) > 1e-3
        load_checkpoint(b, path)
        torch.testing.assert_close(b(*args), a(*args), rtol=0, atol=0)


def test_partial_checkpoint_and_mismatches(tmp_path):
    a, b = model_of(seed=0), model_of(seed=1)
    apply_adapter(a, "qkvo")
    path = save_checkpoint(a, tmp_path / "trainable.safetensors", trainable_only=True)
    keys = load_checkpoint(b, path)
    assert set(keys) == trainable(a)
    torch.testing.assert_close(b.blocks[1].attn.to_v.weight, a.blocks[1].attn.to_v.weight)
    assert not torch.equal(b.blocks[1].mlp.fc1.weight, a.blocks[1].mlp.fc1.weight)  # frozen: not in the file
    with pytest.raises(UserError, match="saved from model 'tiny2', not 'tiny4'.*num_layers 2"):
        load_checkpoint(model_of(layers=4), path)
    full = save_checkpoint(a, tmp_path / "full.safetensors")
    with pytest.raises(UserError, match="unexpected blocks.0.ttt"):
        load_checkpoint(model_of(use_ttt=False), full)


def test_attention_window_glue_round_trips_and_stays_eager_on_cpu():
    """Gathering the windows of v (no RoPE on v) and merging them back gives v: every residual position is the
    mean of its windows' identical copies. On the CPU the glue runs eagerly whatever model.compile_attention_glue
    says (it compiles for CUDA only)."""
    from tttvideo.device import compiled_on_cuda
    from tttvideo.layout import VideoLayout
    from tttvideo.models import attention

    layout = VideoLayout.create(9, 32, 48, text_tokens=4)
    index, cos, sin, inv_count = attention.window_tensors(layout, 16, 10000.0, torch.device("cpu"))
    n, L = index.shape[0], layout.total_tokens
    assert n == 3
    q, k, v = (torch.randn(2, L, 3, 16) for _ in range(3))
    assert compiled_on_cuda(attention.gather_windows, q, True) is attention.gather_windows
    _, _, windows = attention.gather_windows(q, k, v, index.reshape(-1), n, cos, sin)
    assert windows.shape == (2 * n, 3, index.shape[1], 16)
    merged = attention.merge_windows(windows, index.reshape(-1), n, inv_count, L)
    torch.testing.assert_close(merged, v.flatten(2), rtol=1e-6, atol=1e-6)
    one = VideoLayout.create(3, 32, 48, text_tokens=4)  # one window: no gather, the same tokens in order
    _, _, whole = attention.gather_windows(q[:, :one.total_tokens], k[:, :one.total_tokens],
                                           v[:, :one.total_tokens], None, 1, *attention.window_tensors(
                                               one, 16, 10000.0, torch.device("cpu"))[1:3])
    merged_one = attention.merge_windows(whole, None, 1, None, one.total_tokens)
    assert torch.equal(merged_one, v[:, :one.total_tokens].flatten(2))


def test_glue_compiles_once_per_shape_past_dynamos_default_limit():
    """compiled_on_cuda raises Dynamo's recompile limit (allow_glue_recompiles) before it compiles: a glue function
    called at more shapes than Dynamo's default 8 (a process running several layouts) is compiled for each of them
    instead of falling back to eager. Counted with a backend that records each compile (the CPU builds no kernels).
    The limit is restored by assignment: pytest's monkeypatch deletes the attribute on undo, which removes the
    setting from torch's config module for every later test."""
    import torch._dynamo.config as dynamo

    from tttvideo.device import GLUE_RECOMPILE_LIMIT, allow_glue_recompiles

    def count_compiles(limit_raised: bool) -> int:
        torch._dynamo.reset()
        dynamo.recompile_limit = 8
        if limit_raised:
            allow_glue_recompiles()
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        fn = torch.compile(lambda x, y: torch.addcmul(x, y, y), dynamic=False, backend=backend)
        for n in range(1, 13):
            fn(torch.ones(n, 2), torch.ones(n, 2))
        return len(graphs)

    before = dynamo.recompile_limit
    try:
        assert GLUE_RECOMPILE_LIMIT >= 12
        assert count_compiles(limit_raised=False) == 8  # Dynamo's default: shapes 9-12 ran eagerly
        assert count_compiles(limit_raised=True) == 12
    finally:
        dynamo.recompile_limit = before
        torch._dynamo.reset()
