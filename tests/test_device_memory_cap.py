"""cap_process_memory (tttvideo.device): the fraction of a card's memory a GiB cap is, checked with a fake card."""

from __future__ import annotations

import os
import types

import pytest
import torch

from tttvideo.device import cap_process_memory
from tttvideo.errors import UserError


def test_cap_is_gib_over_total(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d)))
    assert cap_process_memory(24, "cuda:1") == 0.3
    assert calls == [(0.3, torch.device("cuda:1"))]
    for bad in (0, 81):
        with pytest.raises(UserError, match="80.0 GiB"):
            cap_process_memory(bad, "cuda")
    assert len(calls) == 1


def test_cap_on_cpu_is_a_no_op():
    assert cap_process_memory(24, "cpu") is None


# ------------------------------------------------------------------------------------------- memory.max_gpu_gib
from tttvideo.config.loader import load_config  # noqa: E402
from tttvideo.config.schema import MemoryConfig  # noqa: E402
from tttvideo.memory.guard import cap  # noqa: E402

SMALL = ["layout.duration=3s", "layout.height=64", "layout.width=64", "layout.text_tokens=24",
         "ttt.backend=reference", "train.precision=fp32", "train.device=cpu", "sample.device=cpu"]


def fake_card(monkeypatch, calls):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_key_caps_cuda_and_zero_caps_nothing(monkeypatch):
    calls = []
    fake_card(monkeypatch, calls)
    assert cap.apply_memory_cap(MemoryConfig(), "cuda") is None and calls == []
    assert cap.apply_memory_cap(MemoryConfig(max_gpu_gib=24), "cuda") == 0.3
    assert calls == [(0.3, torch.device("cuda", 0))]  # an index-less device: the current one


def off_cuda_notes(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "memory.max_gpu_gib" in r.getMessage()]


def test_on_cpu_a_set_key_is_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(cap, "_said_off_cuda", False)
    with caplog.at_level("WARNING"):
        assert cap.apply_memory_cap(MemoryConfig(), "cpu") is None
        assert off_cuda_notes(caplog) == []
        assert cap.apply_memory_cap(MemoryConfig(max_gpu_gib=24), "cpu") is None
        assert cap.apply_memory_cap(MemoryConfig(max_gpu_gib=24), "cpu") is None
    assert off_cuda_notes(caplog) == ["memory.max_gpu_gib = 24 does not apply on cpu: only the CUDA allocator can "
                                      "be capped"]


@pytest.mark.parametrize("command", ["train", "sample", "profile"])
def test_train_sample_and_profile_apply_the_key(command, monkeypatch, caplog, tmp_path):
    """Each entry point hands memory.max_gpu_gib to apply_memory_cap with its device (on CPU: the note)."""
    monkeypatch.setattr(cap, "_said_off_cuda", False)
    cfg = load_config(None, SMALL + ["memory.max_gpu_gib=24", f"train.output_dir={tmp_path / 'run'}"])
    with caplog.at_level("WARNING"):
        if command == "train":
            from tttvideo.train.trainer import Trainer

            Trainer(cfg, quiet=True)
        elif command == "sample":
            from tttvideo.sample.model import load_model

            load_model(cfg, None, torch.device("cpu")).close()
        else:
            from tttvideo.memory.profile.drivers import profile

            assert profile(cfg, "train", 1, tmp_path / "report", device="cpu")[1] == 0
    assert len(off_cuda_notes(caplog)) == 1


# ------------------------------------------------------------------------------------------- allocator setting
@pytest.mark.parametrize("preset", [None, "max_split_size_mb:64"])
def test_tttv_sets_expandable_segments_unless_the_user_did(monkeypatch, preset):
    from tttvideo.cli import main

    if preset is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", preset)
    assert main(["layout", "--duration", "3s"]) == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == (preset or "expandable_segments:True")
