"""normtools.measure.l2_model: the L2 model on hand-made traces whose DRAM bytes are counted
by hand (lines of 128 bytes; capacity in lines), then on a kernel's re-read."""

import numpy as np
import pytest
import torch

import normtools
from normtools.core import launch_plans
from normtools.measure import bytes_counter as kt
from normtools.measure.l2_model import Access, dram_bytes

L = 128


def access(kind, lines, hint="", program=0, launch=0):
    """One access touching whole lines ``lines`` (float32 lanes)."""
    addresses = np.concatenate([np.arange(i * L, (i + 1) * L, 4) for i in lines])
    return Access(kind, addresses, 4, hint, launch, program)


def reads(trace, lines, **kwargs):
    return dram_bytes(trace, capacity=lines * L, line=L, **kwargs)[0] // L


def test_streaming_and_rereads():
    """4 lines read once: 4 from DRAM whatever the size; read twice: 2 if they fit, 8 if
    not (least recently used first out: each is gone before it comes back)."""
    once = [access("load", [i]) for i in range(4)]
    assert reads(once, 2) == 4 and reads(once, 8) == 4
    twice = once + once
    assert reads(twice, 4) == 4 and reads(twice, 3) == 8


def test_lru_order():
    """Capacity 2: A, B, A, C, A. C evicts B (A was used more recently): 3 reads."""
    trace = [access("load", [i]) for i in (0, 1, 0, 2, 0)]
    assert reads(trace, 2) == 3


def test_evict_first_goes_first():
    """Capacity 2: A, B with evict_first, C, then A. C evicts B, not the older A (B went in
    at the least-recently-used end): A hits, 3 reads; without hints C evicts A: 4 reads."""
    trace = [access("load", [0]), access("load", [1], "evict_first"), access("load", [2]),
             access("load", [0])]
    assert reads(trace, 2) == 3
    assert reads(trace, 2, hints=False) == 4


def test_evict_last_is_kept():
    """Capacity 2: a weight line W with evict_last, a stream of 3 lines, W again: W stays,
    1 + 3 reads; without hints the stream evicts it: 5 reads."""
    trace = ([access("load", [9], "evict_last")] + [access("load", [i]) for i in range(3)]
             + [access("load", [9], "evict_last")])
    assert reads(trace, 2) == 4
    assert reads(trace, 2, hints=False) == 5


def test_write_back():
    """Capacity 1: a line stored twice is written to DRAM once, when a load evicts it; the
    loaded line is clean (no write at the end); a store reads nothing."""
    trace = [access("store", [0]), access("store", [0]), access("load", [1])]
    assert dram_bytes(trace, capacity=L, line=L) == (L, L)
    assert dram_bytes(trace[:1], capacity=L, line=L) == (0, L)       # flushed at the end


def test_programs_interleave_within_a_wave():
    """Two programs each read their own line twice, capacity 1. One resident program at a
    time: A A B B, 2 reads; both resident, interleaved A B A B: every read misses, 4."""
    trace = [access("load", [0], program=0), access("load", [0], program=0),
             access("load", [1], program=1), access("load", [1], program=1)]
    assert reads(trace, 1, resident=1) == 2
    assert reads(trace, 1, resident=2) == 4


def test_counter_trace_feeds_the_model():
    """A real kernel's trace: rms_norm forward of 8 float32 rows of 4096 (128 KiB) in chunks
    of 1024 (CPU tiles, one program): pass 1 reads x, pass 2 reads it again. With an L2 that
    holds x the re-read is free (DRAM reads: x and w once, each maybe one line more: CPU
    tensors are not 128-byte aligned); with a small one it is not."""
    x, w = torch.randn(8, 4096), torch.randn(4096)
    trace = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch_plans, "MAX_CHUNK_BYTES", 4096)
        with kt.counting_bytes(trace=trace):
            normtools.rms_norm(x, w, backend="triton")
    assert {a.program for a in trace} == {0} and {a.launch for a in trace} == {0}
    big = dram_bytes(trace, capacity=2**20, line=L)[0]
    small = dram_bytes(trace, capacity=8 * L, line=L)[0]
    assert x.nbytes + w.nbytes <= big <= x.nbytes + w.nbytes + 2 * L     # + alignment
    assert small >= 2 * x.nbytes
