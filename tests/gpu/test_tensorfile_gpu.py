"""tttvideo.tensorfile.write_safetensors with CUDA tensors (skipped without CUDA): the pinned staging buffers rotate
over many small chunks and the file reads back bit for bit, hashed as written."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors import safe_open

from tttvideo.tensorfile import write_safetensors

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("chunk", [4096, 64 << 20])
def test_cuda_tensors_read_back_bit_for_bit(tmp_path, chunk):
    g = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    tensors = {"w": torch.randn(1000, 333, device="cuda", generator=g).bfloat16(),
               "b": torch.randn(333, device="cuda", generator=g),
               "codes": torch.randn(77, 64, device="cuda", generator=g).to(torch.float8_e4m3fn),
               "host": torch.arange(10)}  # a host tensor beside them goes out as it is
    path = tmp_path / "m.safetensors"
    digest = write_safetensors(tensors, path, {"k": "v"}, chunk=chunk)
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"k": "v"}
        for name, t in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.cpu().view(torch.uint8)), name
