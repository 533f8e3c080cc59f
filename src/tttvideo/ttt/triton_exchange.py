"""Cooperating programs: one TTT stream split over SPLIT programs that exchange partial sums through global memory.

The TTT scan is a serial chain per (batch, head) stream, and B x H streams (48 at B=1) leave most SMs of a GPU
idle. The TTT-MLP kernels therefore split the hidden dim E of a stream over SPLIT programs ("roles"): each holds
E / SPLIT rows of W1^T and W2 and their activations, and only the products that sum over E (the [M, D] tiles
Z2 = X2 W2 and the like) need the other roles. Those are exchanged here: every role stores its partial tile, raises
its flag to the exchange's sequence number, waits for the flags of the other roles, and sums the partials in role
order.
The order is fixed, so every role gets the bitwise-same sum and the roles stay in lock step.

Per exchange: `stage` the partial tiles, `raise_flag`, `wait_all`, `gather`.

Buffers of one launch (zeroed by the host before it):
    SYNC  int32 [1 + streams * SPLIT]: SYNC[0] hands out tickets; then one flag per (stream, role)
    XB    fp32 [streams, SPLIT, 3, 2, M, D]: two partial tiles per exchange, in three slots (seq % 3)

Why this cannot deadlock: a program's (stream, role) comes from a ticket taken when it starts, not from its program
id, so the roles of a stream are handed out to programs that are already running, in ticket order. At most one
stream (the one holding the newest ticket) can be waiting for a role no program has taken yet, and the next program
to start takes it. Three slots: a role may stage a tile for exchange s once it has
passed the wait of exchange s - 2 (so it can stage work for the next exchange before waiting on the present one).
Slot s % 3 last held exchange s - 3, which every role finished reading before raising its flag for s - 2.

In the Triton interpreter programs run one after another, so only SPLIT = 1 can run there (the exchange code runs
the same way, with one role).

A second protocol, "LL" (low latency; the name and the idea are NCCL's), has no flags: each fp32 partial is stored
in a 64-bit word whose high half is the exchange's sequence number (`stage_ll`), and a role polls the words
themselves until every one carries the sequence number (`wait_gather_ll`). A naturally aligned 64-bit store is
single-copy atomic, so a word that shows the number also shows its value; the producer needs no fence and no
flag, and the consumer's poll is its gather. Per exchange that removes the fence's round trip to L2 and the flag's,
at twice the bytes per tile. XB is then int64 and zeroed (no word carries a sequence number, which start at 1). A
slot is safe to overwrite for the same reason as above: a role stages exchange s only after it has read every
role's words of s - 1, which those roles staged only after reading s - 3.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def exchange_buffers(streams: int, split: int, M: int, D: int, device,
                     ll: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """SYNC (zeroed) and XB for one launch of `streams` streams split over `split` roles, [M, D] tiles; with `ll`,
    XB in the LL protocol's words (int64, zeroed). A forward's first step reads a tile no role wrote (it writes no
    output; the store is masked), so on the CPU (the interpreter, where numpy warns about garbage) XB is zeroed
    too."""
    sync = torch.zeros(1 + streams * split, device=device, dtype=torch.int32)
    shape = (streams, split, 3, 2, M, D)
    if ll:
        return sync, torch.zeros(shape, device=device, dtype=torch.int64)
    new = torch.zeros if torch.device(device).type == "cpu" else torch.empty
    return sync, new(shape, device=device, dtype=torch.float32)


@triton.jit
def take_ticket(SYNC, SPLIT: tl.constexpr):
    """(stream, role) of this program, in the order programs start."""
    ticket = tl.atomic_add(SYNC, 1).to(tl.int64)
    return ticket // SPLIT, ticket % SPLIT


@triton.jit
def stage(XB, stream, role, seq, which: tl.constexpr, x, M: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr):
    """Store this role's partial tile `which` (0 or 1; [M, D] fp32) of exchange `seq`; `raise_flag` publishes it.
    Staging a tile as soon as it is known frees its registers until the exchange."""
    slot = XB + (((stream * SPLIT + role) * 3 + seq % 3) * 2 + which) * (M * D)
    tl.store(slot + tl.arange(0, M)[:, None] * D + tl.arange(0, D)[None, :], x)


@triton.jit
def raise_flag(SYNC, stream, role, seq, SPLIT: tl.constexpr):
    """Publish this role's staged tiles of exchange `seq`."""
    tl.debug_barrier()  # every thread's stores happen before the flag (release is cumulative over the barrier)
    tl.atomic_xchg(SYNC + 1 + stream * SPLIT + role, seq.to(tl.int32), sem="release", scope="gpu")


@triton.jit
def wait_all(SYNC, stream, role, seq, SPLIT: tl.constexpr):
    """Wait until every other role of the stream has published exchange `seq`. Its own flag is not polled: this
    program raised it, and its own staged tiles are ordered before its later loads by the block barriers of
    `raise_flag` and of this function. That saves one atomic round trip to L2 on every exchange's critical path."""
    for r in tl.static_range(SPLIT):
        if r != role:
            while tl.atomic_add(SYNC + 1 + stream * SPLIT + r, 0, sem="acquire", scope="gpu") < seq:
                pass
    tl.debug_barrier()


@triton.jit
def gather(XB, stream, seq, which: tl.constexpr, row0, R: tl.constexpr, M: tl.constexpr, D: tl.constexpr,
           SPLIT: tl.constexpr):
    """Sum over roles of rows [row0, row0 + R) of partial tile `which` (0 or 1) of exchange `seq`, in role order.
    The loads bypass L1 (.cg): another SM wrote the data, and L1 may hold this slot from two exchanges ago."""
    tile = (row0 + tl.arange(0, R))[:, None] * D + tl.arange(0, D)[None, :]
    acc = tl.zeros([R, D], tl.float32)
    for r in tl.static_range(SPLIT):
        slot = XB + (((stream * SPLIT + r) * 3 + seq % 3) * 2 + which) * (M * D)
        acc += tl.load(slot + tile, cache_modifier=".cg")
    return acc


@triton.jit
def stage_ll(XB, stream, role, seq, which: tl.constexpr, x, M: tl.constexpr, D: tl.constexpr,
             SPLIT: tl.constexpr):
    """`stage` in the LL protocol: each fp32 element of the partial tile in the low half of a 64-bit word, the
    exchange's sequence number in the high half. The store is the publication (no `raise_flag`)."""
    slot = XB + (((stream * SPLIT + role) * 3 + seq % 3) * 2 + which) * (M * D)
    word = (x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF) | (seq.to(tl.int64) << 32)
    tl.store(slot + tl.arange(0, M)[:, None] * D + tl.arange(0, D)[None, :], word)


@triton.jit
def _ll_words(XB, stream, r, seq, which: tl.constexpr, M: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr):
    """Role r's words of tile `which` of exchange `seq` ([M, D] int64), loaded volatile (L2, never a stale L1
    line)."""
    slot = XB + (((stream * SPLIT + r) * 3 + seq % 3) * 2 + which) * (M * D)
    return tl.load(slot + tl.arange(0, M)[:, None] * D + tl.arange(0, D)[None, :], volatile=True)


@triton.jit
def _ll_carry(words, seq):
    """Elementwise: the word carries sequence number `seq`."""
    return (words >> 32).to(tl.int32) == seq


@triton.jit
def _ll_value(words):
    """Elementwise: the fp32 value in the word's low half."""
    return (words & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _ll_ready(a0, b0, a1, b1, seq, need0, need1):
    """1 once every word of the tiles asked for carries `seq` (both roles' words; one block-wide reduction over
    every element at once)."""
    ok = ((_ll_carry(a0, seq) & _ll_carry(b0, seq)) | (need0 == 0)) & \
        ((_ll_carry(a1, seq) & _ll_carry(b1, seq)) | (need1 == 0))
    return tl.min(ok.to(tl.int32))


@triton.jit
def wait_gather_ll(XB, stream, seq, need0, need1, M: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
                   TILE1: tl.constexpr):
    """`wait_all` and `gather` in the LL protocol, for SPLIT 1 or 2: poll every role's words of tile 0 (and of tile
    1 where TILE1) of exchange `seq` until each tile asked for (`need0`, `need1`) carries `seq` in every word, in
    one loop, so once the words are there both tiles cost one round trip to L2 together. Returns the two [M, D]
    sums over roles (tile 0 again where not TILE1; a tile not asked for holds whatever its slot held). The loop
    carries only the words (Triton 3.6's layout pass fails on a while loop that also carries their check)."""
    a0 = _ll_words(XB, stream, 0, seq, 0, M, D, SPLIT)
    b0 = _ll_words(XB, stream, SPLIT - 1, seq, 0, M, D, SPLIT)
    if TILE1:
        a1 = _ll_words(XB, stream, 0, seq, 1, M, D, SPLIT)
        b1 = _ll_words(XB, stream, SPLIT - 1, seq, 1, M, D, SPLIT)
    else:
        a1 = a0
        b1 = b0
    while _ll_ready(a0, b0, a1, b1, seq, need0, need1) == 0:
        a0 = _ll_words(XB, stream, 0, seq, 0, M, D, SPLIT)
        b0 = _ll_words(XB, stream, SPLIT - 1, seq, 0, M, D, SPLIT)
        if TILE1:
            a1 = _ll_words(XB, stream, 0, seq, 1, M, D, SPLIT)
            b1 = _ll_words(XB, stream, SPLIT - 1, seq, 1, M, D, SPLIT)
        else:
            a1 = a0
            b1 = b0
    if SPLIT == 1:
        return _ll_value(a0), _ll_value(a1)
    else:
        return _ll_value(a0) + _ll_value(b0), _ll_value(a1) + _ll_value(b1)
