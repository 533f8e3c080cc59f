"""tttvideo.tensorfile.write_safetensors against safetensors' own writer: the same tensors and metadata read back by
safetensors, every dtype a checkpoint holds, the chunked staging path (run on the CPU with tiny chunks), the digest
it returns and remembers, and a failed write raising."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tttvideo.runs import file_digest
from tttvideo.tensorfile import header_bytes, write_safetensors, written_digest


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        "blocks.0.w": r(37, 11), "blocks.0.b": r(11).bfloat16(), "half": r(3, 5).half(), "f64": r(7).double(),
        "steps": torch.randint(0, 2**40, (3,), generator=g), "i32": torch.randint(-9, 9, (5,), generator=g).int(),
        "codes": torch.randint(-128, 127, (13,), generator=g, dtype=torch.int8),
        "absmax": torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8), "mask": r(6) > 0,
        "fp8": r(4, 4).to(torch.float8_e4m3fn), "scalar": torch.tensor(3.5), "empty": torch.empty(0, 4),
    }


def _read(path) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("stage, chunk", [(None, 64 << 20), (True, 5), (True, 64)])
def test_reads_back_as_safetensors_own_file(tmp_path, stage, chunk):
    tensors = _tensors(seed=torch.seed() % 2**31)
    meta = {"format": "tttvideo", "spec": '{"a": 1}'}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    digest = write_safetensors(tensors, ours, meta, chunk=chunk, stage=stage)
    save_file(tensors, str(theirs), metadata=meta)
    (got, got_meta), (want, want_meta) = _read(ours), _read(theirs)
    assert got_meta == want_meta == meta
    assert set(got) == set(want) == set(tensors)
    assert all(_same(got[k], want[k]) and _same(got[k], tensors[k]) for k in tensors)
    assert theirs.stat().st_size == ours.stat().st_size  # the same header and data, only the key order may differ
    assert digest == hashlib.sha256(ours.read_bytes()).hexdigest()


def test_header_is_padded_and_every_tensor_aligned_to_its_item_size():
    tensors = _tensors(seed=1)
    header, order = header_bytes(tensors, {"k": "v"})
    assert len(header) % 8 == 0
    sizes = [tensors[n].element_size() for n in order]
    assert sizes == sorted(sizes, reverse=True)  # larger items first: each offset a multiple of its item size


def test_digest_is_remembered_until_the_file_changes(tmp_path):
    path = tmp_path / "m.safetensors"
    digest = write_safetensors(_tensors(seed=2), path)
    assert written_digest(path) == digest == file_digest(path)
    with open(path, "ab") as f:  # anything that changes size or mtime makes the file be read again
        f.write(b" ")
    assert written_digest(path) is None
    assert file_digest(path) == hashlib.sha256(path.read_bytes()).hexdigest() != digest


def test_refuses_what_it_cannot_write(tmp_path):
    with pytest.raises(ValueError, match="'t' is not contiguous"):
        write_safetensors({"t": torch.zeros(4, 4).t()}, tmp_path / "x.safetensors")
    with pytest.raises(TypeError, match="complex64"):
        write_safetensors({"c": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "x.safetensors")


def test_a_failed_write_raises(tmp_path):
    # /dev/full: every write fails with ENOSPC, in the writer thread or at close
    with pytest.raises(OSError):
        write_safetensors({"w": torch.zeros(1 << 16)}, "/dev/full", stage=True, chunk=1 << 12)


def test_checkpoint_write_benchmark_runs_both_writers_on_cpu(tmp_path):
    # its CPU smoke run (each writer in a child process, one repetition, 10 MiB): the table's rows and the files'
    # equality, not the times
    from tests.benchmark_scripts import load_benchmark

    bench = load_benchmark("checkpoint_write")
    out = tmp_path / "r.json"
    assert bench.main(["--gib", "0.01", "--device", "cpu", "--reps", "1", "--dir", str(tmp_path / "files"),
                       "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["files_equal"] is True
    assert [r["writer"] for r in result["rows"]] == ["save_file+rehash", "write_safetensors"]
    assert all(r["bytes"] >= 0.01 * 2**30 and r["seconds"] > 0 for r in result["rows"])
