"""fp8 storage of frozen linear weights (tttvideo.models.fp8_storage): output error against the unconverted model,
bytes saved, trainable layers untouched with their gradients, and the model.frozen_weights key."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tttvideo.config.schema import Config, TTTConfig
from tttvideo.errors import ConfigError
from tttvideo.models import apply_adapter, build_model, get_preset, init_model, save_checkpoint, load_checkpoint
from tttvideo.models.fp8_storage import (FP8, Fp8Linear, fp8_linear, frozen_weight_bytes, quantize_rows, store_fp8,
                                         use_fp8_matmul)

pytestmark = pytest.mark.usefixtures("one_thread")

TTT = TTTConfig(mini_batch_size=16, scan_checkpoint_group_size=2)


def tiny(adapter: str = "qkvo", frozen_std: float | None = None) -> nn.Module:
    torch.manual_seed(0)
    model = init_model(get_preset("tiny"), TTT, True)
    apply_adapter(model, adapter)
    if frozen_std is not None:  # pretrained-like magnitudes: most values below e4m3's smallest normal (2^-6)
        with torch.no_grad():
            for m in model.modules():
                if type(m) is nn.Linear and not m.weight.requires_grad:
                    m.weight.normal_(0, frozen_std)
    return model


def inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(1, 13, 16, 4, 6, generator=g), torch.randn(1, 1, 5, 64, generator=g), torch.tensor([400.0]))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_fp8_output_error_and_plain_cast():
    """Measured: 2.50% (default init), 1.94% (frozen weights ~N(0, 0.01)); a plain e4m3 cast of the latter: 4.26%."""
    args = inputs()
    for std, bound in ((None, 0.03), (0.01, 0.025)):
        model = tiny(frozen_std=std)
        with torch.no_grad():
            ref = model(*args)
            plain = copy.deepcopy(model)
            for m in plain.modules():
                if type(m) is nn.Linear and not m.weight.requires_grad:
                    m.weight.copy_(m.weight.to(FP8).float())
            plain_err = rel(plain(*args), ref)
            assert store_fp8(model) == 13  # per block: adaLN x2, fc1, fc2; time embedding x2, text, norm_out, proj_out
            err = rel(model(*args), ref)
        assert 0 < err < bound
        if std is not None:
            assert plain_err > 2 * err, (plain_err, err)


def test_quantize_rows_scales_per_channel():
    w = torch.randn(4, 64) * torch.tensor([1e-4, 1e-2, 1.0, 100.0])[:, None]
    w[1] = 0.0  # an all-zero row must stay zero, not NaN
    codes, scale = quantize_rows(w)
    assert codes.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (4,)
    back = codes.float() * scale[:, None]
    assert torch.equal(back[1], torch.zeros(64))
    for i in (0, 2, 3):  # every row keeps e4m3's relative precision whatever its magnitude
        assert rel(back[i], w[i]) < 0.04
        assert codes[i].float().abs().max() == 448.0


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    latents, text, t = inputs()
    model(latents, text, t).square().mean().backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_frozen_bytes_drop_and_trainable_layers_untouched():
    model = tiny()
    reference = copy.deepcopy(model)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    fp32_bytes = frozen_weight_bytes(model)
    bf16_bytes = frozen_weight_bytes(copy.deepcopy(model).to(torch.bfloat16))
    store_fp8(model)
    fp8_bytes = frozen_weight_bytes(model)
    # 1 byte per value plus one fp32 scale per output row (4 / in_features more: 6% here, 0.1% at 3072 wide)
    rows = sum(m.out_features for m in model.modules() if isinstance(m, Fp8Linear))
    assert fp8_bytes == fp32_bytes // 4 + 4 * rows == bf16_bytes // 2 + 4 * rows
    assert 1.85 < bf16_bytes / fp8_bytes <= 2.0 and 3.7 < fp32_bytes / fp8_bytes <= 4.0, (fp32_bytes, fp8_bytes)
    after = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert after.keys() == trainable.keys() and all(after[n] is trainable[n] for n in after)
    for m in model.modules():  # no Linear with requires_grad True was converted, no frozen one was left
        if type(m) is nn.Linear:
            assert m.weight.requires_grad
    # gradients reach every trainable parameter they reached before, close to the unconverted model's
    # (measured: median relative difference 3.9%, worst 27% on a bias whose gradient is tiny)
    ref, got = grads(reference), grads(model)
    assert got.keys() == ref.keys()
    errors = []
    for name, g in ref.items():
        assert (got[name] is None) == (g is None), name
        if g is not None and g.abs().sum() > 0:
            assert got[name].abs().sum() > 0, name
            errors.append(rel(got[name], g))
    assert sorted(errors)[len(errors) // 2] < 0.06


def test_fp8linear_refuses_trainable_and_reads_like_linear():
    lin = nn.Linear(32, 16)
    with pytest.raises(ValueError, match="requires grad"):
        Fp8Linear(lin)
    lin.requires_grad_(False)
    f = Fp8Linear(lin)
    assert f.weight.dtype == torch.float32 and rel(f.weight, lin.weight) < 0.04
    assert f.bias is lin.bias
    x = torch.randn(3, 32)
    assert rel(f(x), lin(x)) < 0.04
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert f(x).dtype == torch.bfloat16


def test_backward_keeps_codes_not_the_dequantised_weight():
    lin = nn.Linear(32, 16).requires_grad_(False)
    lin.bias.requires_grad_(True)  # a trainable bias on a frozen weight still gets its gradient
    f = Fp8Linear(lin)
    x = torch.randn(2, 3, 32, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = f(x)
    assert not any(t.shape == (16, 32) and t.is_floating_point() and t.dtype != FP8 for t in saved)
    assert sum(t.dtype == FP8 for t in saved) == 1
    w = f.weight.detach().requires_grad_(False)
    x2 = x.detach().clone().requires_grad_(True)
    b2 = lin.bias.detach().clone().requires_grad_(True)
    g = torch.randn(2, 3, 16)
    y.backward(g)
    torch.nn.functional.linear(x2, w, b2).backward(g)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(lin.bias.grad, b2.grad, rtol=1e-6, atol=1e-7)


def test_lora_base_layers_convert_and_checkpoints_keep_working(tmp_path):
    pytest.importorskip("peft")
    model = tiny("lora")
    n = store_fp8(model)
    assert n == 13 + 2 * 4  # the frozen q/k/v/o base layers inside the LoRA wrappers too
    sd = model.state_dict()
    assert sd["blocks.0.mlp.fc1.weight_fp8"].dtype == FP8 and "blocks.0.mlp.fc1.weight" not in sd
    # a full checkpoint of the converted model holds its parameters (trainable ones and frozen biases) and loads back
    path = save_checkpoint(model, tmp_path / "m.safetensors")
    assert set(load_checkpoint(model, path)) == {n for n, _ in model.named_parameters()}


def test_config_key_builds_fp8_layers():
    cfg = Config()
    cfg.ttt.mini_batch_size = 16
    assert not any(isinstance(m, Fp8Linear) for m in build_model(cfg).modules())  # default: as before
    cfg.model.frozen_weights = "fp8"
    model = build_model(cfg)
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == 13
    out = model(*inputs())
    assert torch.isfinite(out).all()
    cfg.model.adapter = "sft"
    with pytest.raises(ConfigError, match="model.frozen_weights"):
        build_model(cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_checkpoint_loads_into_fp8_model_quantised(tmp_path, dtype):
    """A full checkpoint of a model without fp8 storage loads into one with it: the same codes as converting the
    loaded model, and the output within the fp8 tolerance of the original's."""
    from tttvideo.runs import is_full_checkpoint

    source = tiny().to(dtype)
    path = save_checkpoint(source, tmp_path / "full.safetensors")
    assert is_full_checkpoint(path)
    torch.manual_seed(5)  # other random weights: every value must come from the file
    target = apply_adapter(init_model(get_preset("tiny"), TTT, True, dtype=dtype), "qkvo")
    store_fp8(target)
    loaded = load_checkpoint(target, path)
    assert set(loaded) == {n for n, p in source.named_parameters()}
    expected = copy.deepcopy(source)
    store_fp8(expected)
    for (name, got), (_, want) in zip(target.state_dict().items(), expected.state_dict().items()):
        assert torch.equal(got.float(), want.float()), name
    args = inputs()
    with torch.no_grad():
        assert rel(target(*args), source(*args)) < (0.03 if dtype == torch.float32 else 0.05)
    # the fp8 model's own checkpoint lacks the frozen weights: marked partial, loaded over the base model's
    back = save_checkpoint(target, tmp_path / "fp8.safetensors")
    assert not is_full_checkpoint(back)
    assert set(load_checkpoint(target, back)) == {n for n, _ in target.named_parameters()} < set(loaded)


def test_the_gathered_weights_of_a_sharded_fp8_model_are_saved_partial(tmp_path):
    """The multi-process trainer saves a gathered stand-in of its FSDP2 model (train/dcp.py); it lacked the model's
    modules, so the file of an fp8-frozen run was marked whole, and `tttv sample` of it left the frozen layers as
    built: random, another video each run (a 4-process CPU chain through the 63-s 4-GPU config)."""
    from tttvideo.runs import is_full_checkpoint
    from tttvideo.train.dcp import _WholeWeights

    model = tiny()
    store_fp8(model)
    whole = _WholeWeights(model, {n: p.detach() for n, p in model.named_parameters()})
    path = save_checkpoint(whole, tmp_path / "gathered.safetensors")
    assert not is_full_checkpoint(path)
    plain = _WholeWeights(tiny(), {n: p.detach() for n, p in tiny().named_parameters()})
    assert is_full_checkpoint(save_checkpoint(plain, tmp_path / "plain.safetensors"))


def _fresh_fp8(seed: int) -> nn.Module:
    torch.manual_seed(seed)  # other random weights: every loaded value must come from the files
    model = apply_adapter(init_model(get_preset("tiny"), TTT, True), "qkvo")
    store_fp8(model)
    return model


def test_a_partial_checkpoint_gets_its_frozen_layers_from_where_its_run_started(tmp_path):
    """A run with fp8 frozen weights saves only what it trains. The stage configs start such a run from the previous
    stage (train.init_from) with no model.pretrained_path, so `tttv sample`, `--resume` and the next stage's
    init_from loaded the file over frozen layers left as built: random, another video each run; with a
    model.pretrained_path they got the base's frozen layers, not the previous stage's (which the sft stage trained).
    They now load the run's start first."""
    from tttvideo.errors import UserError
    from tttvideo.runs import load_trained

    start = tiny()
    (tmp_path / "a").mkdir()
    a = save_checkpoint(start, tmp_path / "a" / "model.safetensors")
    trained = copy.deepcopy(start)
    store_fp8(trained)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.25)
    (tmp_path / "b").mkdir()
    b = save_checkpoint(trained, tmp_path / "b" / "model.safetensors")
    (tmp_path / "b" / "config.toml").write_text(f'[train]\ninit_from = "{a}"\n[model]\npretrained_path = ""\n')
    # built without base weights, and built from other base weights (has_base): the frozen layers the run froze
    # are its start's (a's), not the base's
    loaded = [_fresh_fp8(seed) for seed in (1, 2)]
    for model, has_base in zip(loaded, (False, True)):
        load_trained(model, b, has_base=has_base)
    for (name, want), got1, got2 in zip(trained.state_dict().items(), loaded[0].state_dict().values(),
                                        loaded[1].state_dict().values()):
        assert torch.equal(got1.float(), want.float()) and torch.equal(got2.float(), want.float()), name
    # without a start to follow: one sentence, not random frozen layers
    (tmp_path / "b" / "config.toml").write_text('[train]\ninit_from = ""\n[model]\npretrained_path = "w/x"\n')
    with pytest.raises(UserError, match="holds the trained weights only .* set model.pretrained_path to it"):
        load_trained(_fresh_fp8(3), b, has_base=False)
    (tmp_path / "b" / "config.toml").write_text(f'[train]\ninit_from = "{tmp_path / "gone"}"\n')
    with pytest.raises(UserError, match="they come from where its run started .train.init_from = .*gone"):
        load_trained(_fresh_fp8(3), b, has_base=False)


def test_a_partial_checkpoint_finds_a_relative_start_from_elsewhere_and_warns_when_it_is_gone(tmp_path, monkeypatch,
                                                                                              caplog):
    """The stage configs name their start relatively (train.init_from = "runs/.../stage1-3s"), as launched from the
    project folder: sampling or resuming from another folder finds it from the folders above the checkpoint. A start
    that is gone leaves the base weights (has_base) with a warning, or one sentence without them."""
    import logging

    from tttvideo.errors import UserError
    from tttvideo.runs import load_trained

    project = tmp_path / "project"
    start = tiny()
    (project / "runs/a").mkdir(parents=True)
    save_checkpoint(start, project / "runs/a/model.safetensors")
    trained = copy.deepcopy(start)
    store_fp8(trained)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.25)
    (project / "runs/b").mkdir(parents=True)
    b = save_checkpoint(trained, project / "runs/b/model.safetensors")
    (project / "runs/b/config.toml").write_text('[train]\ninit_from = "runs/a/model.safetensors"\n')
    monkeypatch.chdir(tmp_path)  # not the project folder: "runs/a/..." is not found from here
    model = _fresh_fp8(4)
    load_trained(model, b, has_base=True)
    for (name, want), got in zip(trained.state_dict().items(), model.state_dict().values()):
        assert torch.equal(got.float(), want.float()), name
    (project / "runs/a/model.safetensors").unlink()
    based = _fresh_fp8(5)
    frozen = {k: v.clone() for k, v in based.state_dict().items() if "fp8" in k or "scale" in k}
    with caplog.at_level(logging.WARNING, logger="tttvideo.runs"):
        load_trained(based, b, has_base=True)
    assert "come from the base weights" in caplog.text and "runs/a/model.safetensors" in caplog.text
    assert frozen and all(torch.equal(based.state_dict()[k], v) for k, v in frozen.items())
    with pytest.raises(UserError, match="they come from where its run started"):
        load_trained(_fresh_fp8(6), b, has_base=False)


def test_a_partial_checkpoint_takes_its_frozen_layers_from_the_ema_weights_its_run_started_from(tmp_path):
    """`tttv train` starts a stage from the previous stage's EMA weights when it kept some (ema.safetensors beside its
    model file): the frozen layers of a partial file come from those too."""
    from tttvideo.models.weights import load_checkpoint
    from tttvideo.runs import load_trained

    start = tiny()
    (tmp_path / "a").mkdir()
    save_checkpoint(start, tmp_path / "a" / "model.safetensors")
    averaged = copy.deepcopy(start)
    with torch.no_grad():
        for p in averaged.parameters():
            p.add_(0.5)
    everything = copy.deepcopy(averaged)
    for p in everything.parameters():  # the start trained every layer (an sft stage): its average covers them all
        p.requires_grad_(True)
    save_checkpoint(everything, tmp_path / "a" / "ema.safetensors", trainable_only=True)
    trained = copy.deepcopy(averaged)
    store_fp8(trained)
    (tmp_path / "b").mkdir()
    b = save_checkpoint(trained, tmp_path / "b" / "model.safetensors")
    (tmp_path / "b" / "config.toml").write_text(f'[train]\ninit_from = "{tmp_path / "a"}"\n')
    model = _fresh_fp8(7)
    load_trained(model, b, has_base=False)
    expected = copy.deepcopy(averaged)
    store_fp8(expected)
    load_checkpoint(expected, b)
    for (name, want), got in zip(expected.state_dict().items(), model.state_dict().values()):
        assert torch.equal(got.float(), want.float()), name


# ------------------------------------------------------------------------------------------------ model.fp8_matmul
def _fp8_linear_reference(x: torch.Tensor, layer: Fp8Linear) -> torch.Tensor:
    """What fp8_linear computes, in plain fp32: x rounded to e4m3 with one scale per token, times the stored
    weight, plus the bias."""
    rows = x.reshape(-1, x.shape[-1]).float()
    scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
    x_rounded = (rows / scale).to(FP8).float() * scale
    w = layer.weight_fp8.float() * layer.weight_scale[:, None]
    return (x_rounded @ w.T + layer.bias.float()).reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fp8_linear_is_scaled_mm_of_token_and_channel_scaled_codes(dtype, atol):
    """fp8_linear against its plain reference on fresh random inputs (fp32 out: to 1e-5, the summation order;
    bf16 out: to bf16 rounding of outputs of magnitude ~5); outputs, scales and transposes the right way round."""
    torch.manual_seed(3)
    linear = nn.Linear(64, 48).requires_grad_(False)
    linear.weight.mul_(torch.logspace(-2, 0, 48)[:, None])  # rows of very different ranges: the scales matter
    layer = Fp8Linear(linear)
    x = torch.randn(2, 7, 64) * torch.logspace(-1, 1, 7)[None, :, None]  # tokens of very different ranges too
    out = fp8_linear(x.to(dtype), layer.weight_fp8, layer.weight_scale, layer.bias, dtype)
    assert out.dtype == dtype and out.shape == (2, 7, 48)
    torch.testing.assert_close(out.float(), _fp8_linear_reference(x.to(dtype), layer), rtol=1e-4, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_adds_the_bias_apart_where_the_product_takes_none(monkeypatch, dtype):
    """The bias goes into torch._scaled_mm where this PyTorch takes one there (`scaled_mm_takes_bias`, asked on the
    device: the CPU does), else it is added to the product's output: both hold to the same reference."""
    import tttvideo.models.fp8_storage as fp8

    assert fp8.scaled_mm_takes_bias(torch.device("cpu"), dtype)
    torch.manual_seed(4)
    layer = Fp8Linear(nn.Linear(64, 32).requires_grad_(False))
    layer.bias.data.mul_(20)  # a bias as large as the products: one added in the wrong place shows
    x = torch.randn(5, 64).to(dtype)
    fused = fp8_linear(x, layer.weight_fp8, layer.weight_scale, layer.bias, dtype)
    monkeypatch.setattr(fp8, "scaled_mm_takes_bias", lambda device, out_dtype: False)
    apart = fp8_linear(x, layer.weight_fp8, layer.weight_scale, layer.bias, dtype)
    atol = 1e-5 if dtype == torch.float32 else 0.25  # bf16: one rounding of outputs up to ~30 (fused rounds once)
    for out in (fused, apart):
        torch.testing.assert_close(out.float(), _fp8_linear_reference(x, layer), rtol=1e-4, atol=atol)


def test_fp8_matmul_output_error_and_gradients():
    """The tiny model with every frozen linear multiplying in fp8 against the same fp8-stored weights upcast:
    the output moves by the activations' rounding (measured 2.5%; fp8 storage itself 2.5% from the fp32 weights);
    the gradients are those of the stored weights (backward upcasts them as before): grad of x through one layer
    equal to the upcast layer's, and the trainable weights' gradients, all of them together, within twice the
    forward's error."""
    args = inputs()
    upcast = tiny()
    store_fp8(upcast)
    in_fp8 = copy.deepcopy(upcast)
    assert use_fp8_matmul(in_fp8, "cpu") == (13, 13)
    with torch.no_grad():
        ref = upcast(*args)
        err = rel(in_fp8(*args), ref)
    assert 0 < err < 0.04, err
    g_ref, g = grads(upcast), grads(in_fp8)
    assert g.keys() == g_ref.keys()
    every = rel(torch.cat([g[n].flatten() for n in g_ref]), torch.cat([t.flatten() for t in g_ref.values()]))
    assert 0 < every < 0.06, every  # measured 2.8%
    layer = next(m for m in in_fp8.modules() if isinstance(m, Fp8Linear))
    x = torch.randn(5, layer.in_features, requires_grad=True)
    layer(x).sin().sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(x_ref, layer.weight, layer.bias).sin().sum().backward()
    grad_err = rel(x.grad, x_ref.grad)  # only sin's derivative at the rounded output differs
    assert grad_err < 0.05, grad_err


def test_sampling_stores_every_linear_in_fp8_and_the_ttt_qkv_in_one_product():
    """sample.fp8_linears = 'all': the trained linears (qkvo and TTT under the qkvo adapter) go to fp8 as well and
    multiply in fp8; the TTT layer's stacked q/k/v product (one quantisation of x) equals the three layers' own
    products, also for a group of heads; load_model refuses the setting without fp8 storage, in a sentence."""
    from tttvideo.models.fp8_storage import store_every_linear_fp8
    from tttvideo.sample.model import load_model

    model = tiny()
    plain = sum(type(m) is nn.Linear for m in model.modules())
    with torch.no_grad():
        ref = model(*inputs())
    assert store_every_linear_fp8(model, "cpu", matmul=True) == (plain, plain)
    assert not any(type(m) is nn.Linear for m in model.modules()) and not any(p.requires_grad
                                                                                for p in model.parameters())
    with torch.no_grad():
        err = rel(model(*inputs()), ref)
    assert 0 < err < 0.1, err  # measured 3.5%, 0.8% from the model with only the frozen linears in fp8
    ttt = next(m for m in model.modules() if hasattr(m, "project_qkv"))
    x = torch.randn(2, 9, ttt.dim)
    H, D = ttt.num_heads, ttt.head_dim
    each = torch.stack([layer(x) for layer in (ttt.wq, ttt.wk, ttt.wv)], 2).view(2, 9, 3, H, D)
    torch.testing.assert_close(ttt.project_qkv(x).view(2, 9, 3, H, D), each, rtol=1e-6, atol=1e-6)
    heads = slice(1, 2)
    torch.testing.assert_close(ttt.project_qkv(x, heads).view(2, 9, 3, 1, D), each[:, :, :, heads],
                               rtol=1e-6, atol=1e-6)
    cfg = Config()
    cfg.ttt.mini_batch_size, cfg.sample.fp8_linears = 16, "all"
    with pytest.raises(ConfigError, match="sample.fp8_linears = 'all'.*model.frozen_weights = 'fp8'"):
        load_model(cfg, None, torch.device("cpu"))
    cfg.model.frozen_weights, cfg.model.fp8_matmul = "fp8", True
    with load_model(cfg, None, torch.device("cpu")) as loaded:
        layers = [m for m in loaded.model.modules() if isinstance(m, Fp8Linear)]
        assert len(layers) == plain and all(m.fp8_matmul for m in layers)


def test_fp8_matmul_config_sentences_and_layer_sizes():
    cfg = Config()
    cfg.ttt.mini_batch_size = 16
    cfg.model.fp8_matmul = True
    with pytest.raises(ConfigError, match="model.frozen_weights = 'fp8'"):
        build_model(cfg)
    cfg.model.frozen_weights = "fp8"
    model = build_model(cfg)
    assert sum(getattr(m, "fp8_matmul", False) for m in model.modules()) == 13
    assert "matmul=fp8" in repr(model)
    # on CUDA torch._scaled_mm takes sizes in multiples of 16: a layer of other sizes keeps upcasting there
    odd = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 40), nn.Linear(24, 64)).requires_grad_(False)
    store_fp8(odd)
    assert use_fp8_matmul(odd, "cuda") == (1, 3)
    assert [m.fp8_matmul for m in odd] == [True, False, False]
    assert use_fp8_matmul(odd, "cpu") == (3, 3)  # the CPU takes any size


def test_fp8_matmul_sentences_on_a_gpu_that_cannot(monkeypatch):
    """The CUDA checks, with the GPU's answers stood in: fp8 tensor cores (compute capability 8.9) and a per-row
    scaled product this PyTorch runs there (`scaled_mm_refusal`, asked on the device); each a sentence naming the
    key. Any compute dtype passes: CUDA's bf16 results are cast to it."""
    import tttvideo.models.fp8_storage as fp8

    cfg = Config()
    cfg.model.frozen_weights, cfg.model.fp8_matmul, cfg.model.dtype = "fp8", True, "bf16"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    with pytest.raises(ConfigError, match=r"model.fp8_matmul needs fp8 tensor cores .* Some GPU has 8.6"):
        fp8.check_fp8_matmul(cfg, "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fp8, "scaled_mm_refusal", lambda device: "Rowwise scaling is not supported here")
    with pytest.raises(ConfigError, match=r"no fp8 matrix product with per-row scales on Some GPU \(Rowwise"):
        fp8.check_fp8_matmul(cfg, "cuda")
    monkeypatch.setattr(fp8, "scaled_mm_refusal", lambda device: None)
    fp8.check_fp8_matmul(cfg, "cuda")  # everything answered: no sentence
    cfg.model.dtype = "fp32"  # computes in fp32 (or an autocast dtype): bf16 results, cast
    fp8.check_fp8_matmul(cfg, "cuda")
    assert fp8.scaled_mm_refusal(torch.device("cpu")) is None  # the CPU runs it


def test_a_model_built_on_the_cpu_to_run_on_a_gpu_is_checked_for_the_gpu(monkeypatch):
    """`tttv sample --offload` builds on the CPU and streams the blocks to the GPU: the checks and the layer sizes
    are the GPU's (`build_model(compute_device=...)`), not the CPU's, where everything is allowed."""
    cfg = Config()
    cfg.ttt.mini_batch_size = 16
    cfg.model.frozen_weights, cfg.model.fp8_matmul = "fp8", True
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Old GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match="Old GPU has 8.0"):
        build_model(cfg, "cpu", compute_device="cuda")
    assert sum(getattr(m, "fp8_matmul", False) for m in build_model(cfg, "cpu").modules()) == 13
