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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def exchange_buffers(streams: int, split: int, M: int, D: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """SYNC (zeroed) and XB for one launch of `streams` streams split over `split` roles, [M, D] tiles. A sampling
    forward's first step reads an output tile no role wrote (its store is masked), so on the CPU (the interpreter,
    where numpy warns about the garbage) XB is zeroed."""
    sync = torch.zeros(1 + streams * split, device=device, dtype=torch.int32)
    new = torch.zeros if torch.device(device).type == "cpu" else torch.empty
    return sync, new(streams, split, 3, 2, M, D, device=device, dtype=torch.float32)


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
