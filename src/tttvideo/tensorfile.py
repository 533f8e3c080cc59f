"""A safetensors file written tensor by tensor, hashed as it is written: `write_safetensors`.

safetensors' own `save_file` first copies every tensor of the file to host memory and holds them all until the file
is written (a 5B model file with every parameter trained: 14.5 GB on top of the process), and the checkpoint
manifest then read each file back to hash it. This writer copies a GPU tensor through two pinned staging buffers, a
chunk at a time, and hands each chunk to a writer thread and a hasher thread, which run side by side (file writes
and SHA-256 release the GIL) while the next chunk is copied: the host holds two chunks, not the file, and the bytes
are hashed once, on their way out. The file is an ordinary safetensors file (safetensors' header and dtype names, the
header padded to 8 bytes, tensors ordered by item size then name so that each starts aligned to its item size) that
`safetensors.safe_open` reads; tests/test_tensorfile.py holds the two writers to the same tensors and metadata.
Its time against save_file's: `benchmarks/checkpoint_write.py`.

`written_digest(path)` gives the SHA-256 this process computed while writing `path`, as long as the file's size and
modification time are the ones it left (`tttvideo.runs.file_digest` asks it first).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import struct
import threading
from pathlib import Path

import torch

CHUNK = 64 << 20  # bytes per staging buffer and per piece: large enough that the copies run at the link's rate
HASH_STEP = 1 << 20

# torch dtype -> safetensors' name (the format's dtype table)
DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    **{getattr(torch, f"uint{b}"): f"U{b}" for b in (16, 32, 64) if hasattr(torch, f"uint{b}")},
}

_WRITTEN: dict[str, tuple[int, int, str]] = {}  # resolved path -> (size, mtime_ns, sha256 hex)


def header_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> tuple[bytes, list[str]]:
    """(the header block: its 8-byte length and the JSON, padded with spaces to a multiple of 8; the tensors' names in
    file order)."""
    for name, t in tensors.items():
        if t.dtype not in DTYPES:
            raise TypeError(f"tensor {name!r}: dtype {t.dtype} has no safetensors name")
        if not t.is_contiguous():
            raise ValueError(f"tensor {name!r} is not contiguous: call .contiguous() before saving it")
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    entries: dict[str, object] = {}
    if metadata:
        entries["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        entries[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor on its device (no copy)."""
    flat = t.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


class _Piece:
    """A run of bytes on the host, handed to both the writer and the hasher; its staging buffer goes back to the
    pool when both are done with it."""

    def __init__(self, data: torch.Tensor, buffer: int | None, pool: queue.Queue):
        self.view = memoryview(data.numpy())
        self.buffer, self.pool = buffer, pool
        self.left = 2
        self.lock = threading.Lock()

    def done(self) -> None:
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last and self.buffer is not None:
            self.pool.put(self.buffer)


def _consume(pieces: queue.Queue, use, failure: list[BaseException]) -> None:
    """Apply `use` to every piece in order until None; the first error is kept for the caller, the rest skipped."""
    while (piece := pieces.get()) is not None:
        try:
            if not failure:
                use(piece.view)
        except BaseException as err:  # noqa: BLE001 - re-raised by the thread that writes the file
            failure.append(err)
        piece.done()


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None,
                      chunk: int = CHUNK, stage: bool | None = None) -> str:
    """Write `tensors` (contiguous, on any device) and `metadata` to `path` as safetensors; returns the file's
    SHA-256 (hex). The caller makes the write atomic (a temporary name, then a rename) and durable (fsync).
    `stage`: copy through the staging buffers (None: the tensors not in host memory; True: all, which the tests use
    to run the chunked path on a CPU). Pieces of at most `chunk` bytes go to a writer thread and a hasher thread
    side by side, so the file's time is the slower of the two, not their sum."""
    path = Path(path)
    header, order = header_bytes(tensors, metadata)
    digest = hashlib.sha256(header)
    staged_names = {n for n, t in tensors.items() if (t.device.type != "cpu" if stage is None else stage)}
    pinned = torch.cuda.is_available() and any(t.device.type == "cuda" for t in tensors.values())
    buffers = [torch.empty(chunk, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)] if staged_names else []
    pool: queue.Queue = queue.Queue()
    for i in range(len(buffers)):
        pool.put(i)
    failure: list[BaseException] = []

    def hash_piece(view: memoryview) -> None:
        for i in range(0, len(view), HASH_STEP):  # in cache-sized steps: one pass over a large view is slower
            digest.update(view[i:i + HASH_STEP])

    with open(path, "wb") as f:
        f.write(header)
        lanes = [queue.Queue(maxsize=4), queue.Queue(maxsize=4)]
        threads = [threading.Thread(target=_consume, args=(lane, use, failure), daemon=True,
                                    name=f"tensorfile-{what}")
                   for lane, use, what in ((lanes[0], f.write, "write"), (lanes[1], hash_piece, "hash"))]
        for t in threads:
            t.start()
        try:
            for name in order:
                data = _byte_view(tensors[name])
                for start in range(0, data.numel(), chunk):
                    if failure:
                        break
                    piece = data[start:start + chunk]
                    buffer = None
                    if name in staged_names:
                        buffer = pool.get()
                        piece = buffers[buffer][:piece.numel()].copy_(piece)  # synchronous: on the host after it
                    handed = _Piece(piece, buffer, pool)
                    for lane in lanes:
                        lane.put(handed)
                if failure:
                    break
        finally:
            for lane in lanes:
                lane.put(None)
            for t in threads:
                t.join()
    if failure:
        raise failure[0]
    hexdigest = digest.hexdigest()
    stat = path.stat()
    _WRITTEN[str(path.resolve())] = (stat.st_size, stat.st_mtime_ns, hexdigest)
    return hexdigest


def written_digest(path: str | Path) -> str | None:
    """The SHA-256 `write_safetensors` computed for `path` in this process, if the file is still as it left it."""
    key = str(Path(path).resolve())
    known = _WRITTEN.get(key)
    if known is None:
        return None
    try:
        stat = os.stat(key)
    except OSError:
        return None
    return known[2] if (stat.st_size, stat.st_mtime_ns) == known[:2] else None
