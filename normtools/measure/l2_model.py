"""A simple L2 cache model: the DRAM bytes of a trace of loads and stores, with and without
the kernels' eviction hints.

The bytes counter (``normtools.measure.bytes_counter``) records every load and store of an
interpreted launch: which program issued it, its hint and the addresses of its masked-in lanes.
``dram_bytes`` replays that trace through one L2 and counts what reaches DRAM:

* Lines of ``line`` bytes, ``capacity`` bytes in all (``H200_L2_BYTES`` by default), least
  recently used first out. By default a line is 32 bytes: the sector, the unit in which
  NVIDIA's L2 moves data to and from DRAM (its 128-byte lines are four sectors). CPU tensors
  are 64-byte aligned, so no tensor shares a 32-byte unit with another, while a 128-byte unit
  would split the rows of a tensor that starts 64 bytes into one (CUDA tensors start on
  512-byte boundaries).
* A load of a line that is not cached reads it from DRAM (``line`` bytes) and caches it; a
  store caches the line dirty without reading it (the lanes of a tile cover whole lines); a
  dirty line is written to DRAM once, when it is evicted or at the end (write-back).
* Hints: a line loaded or stored with ``evict_first`` goes in at the least-recently-used end
  (the next to leave); a line with ``evict_last`` is kept: it leaves only when every cached
  line is an evict_last line. Without a hint a line goes in at the most-recently-used end.
  ``hints=False`` replays the same trace with every hint removed: the same kernels, hints
  stripped.
* Order: the GPU runs a launch's programs a wave at a time, ``resident`` programs at once, side
  by side. The model takes the programs of a launch ``resident`` at a time and interleaves
  them access by access (round robin, each program's accesses in its own order); launches
  follow one another and share the cache.

What it leaves out: 128-byte lines as the unit of replacement, set associativity, the
write-allocate behaviour of partial sectors, and the real relative speed of the programs. It
answers one question: does a re-read reach DRAM or not?
"""

import collections
from typing import NamedTuple

import numpy as np

# NVIDIA H200: 50 MB of L2 (the H100 SXM5's L2; NVIDIA H100 Tensor Core GPU Architecture
# whitepaper, 2022, "50 MB L2 cache"; the H200 keeps the H100's die).
H200_L2_BYTES = 50 * 2**20
LINE_BYTES = 32


class Access(NamedTuple):
    """One load or store: ``kind`` "load" / "store", the byte addresses of its masked-in lanes
    (an int array), their element size, the eviction hint ("" for none), and the
    (launch, program) that issued it."""

    kind: str
    addresses: np.ndarray
    itemsize: int
    hint: str
    launch: int
    program: int


def interleaved(trace, resident):
    """The accesses of ``trace`` in the model's order: per launch, waves of ``resident``
    programs (in program order), each wave round robin, one access of each program in turn."""
    launches = collections.defaultdict(lambda: collections.defaultdict(list))
    for access in trace:
        launches[access.launch][access.program].append(access)
    for launch in sorted(launches):
        programs = sorted(launches[launch])
        for start in range(0, len(programs), resident):
            queues = [collections.deque(launches[launch][p])
                      for p in programs[start:start + resident]]
            while queues:
                for queue in list(queues):
                    yield queue.popleft()
                    if not queue:
                        queues.remove(queue)


def _lines(access, line):
    """The distinct lines an access touches, in address order (each lane's first and last
    byte: an element may straddle a line)."""
    first = access.addresses // line
    last = (access.addresses + access.itemsize - 1) // line
    return np.unique(np.concatenate([first, last]))


def dram_bytes(trace, capacity=H200_L2_BYTES, line=LINE_BYTES, resident=1, hints=True):
    """DRAM bytes (read, written) of replaying ``trace`` (a list of ``Access``) through the
    L2 model of the module docstring."""
    slots = max(1, capacity // line)
    normal = collections.OrderedDict()     # line -> dirty; first item = least recently used
    kept = collections.OrderedDict()       # evict_last lines
    read = written = 0

    def evict_one():
        nonlocal written
        _, dirty = (normal if normal else kept).popitem(last=False)
        written += line * dirty

    for access in interleaved(trace, resident):
        hint = access.hint if hints else ""
        store = access.kind == "store"
        for key in _lines(access, line).tolist():
            dirty = store
            if key in normal:
                dirty |= normal.pop(key)
            elif key in kept:
                dirty |= kept.pop(key)
            elif not store:
                read += line
            while len(normal) + len(kept) >= slots:
                evict_one()
            if hint == "evict_last":
                kept[key] = dirty
            else:
                normal[key] = dirty
                if hint == "evict_first":
                    normal.move_to_end(key, last=False)
    written += line * (sum(normal.values()) + sum(kept.values()))
    return read, written
