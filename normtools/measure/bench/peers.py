"""Concurrency measured: K processes time the same case at the same moment.

A GPU serving several model replicas, or several jobs sharing one GPU, runs several processes
on it at once, each with its own CUDA context; their kernels share the memory bandwidth. With
``run_sweep(..., processes=K)`` the sweep starts ``K − 1`` peer processes once
(``multiprocessing`` "spawn": a fresh interpreter and CUDA context each). For every
(case, backend) the sweep's own process makes its first call, then each peer builds its own
input sets of the case and makes its first call (a compile, a JIT), and all K processes wait
at a barrier and time the case together, each over its own inputs. Each row records

* ``processes``: K;
* its own percentiles (the sweep's process) and ``peer_p50_us``, the peers' p50s;
* ``aggregate_gbs_p50`` = Σₖ bytes / p50ₖ, the bandwidth the K processes got together;
* ``overlap``: the fraction of the sweep process's timing window during which every peer was
  timing too (wall clock: 1.0 when the K windows coincide, 0 when they ran one after another),
  so that a row shows that the processes did run at once rather than assuming it.

A peer that fails (or a case that fails in the sweep's process) breaks the barrier; the row
is an "error" with the peer's reason and the sweep goes on. A peer that has exited makes every
later row an "error" at once.
"""

import multiprocessing
import threading
import time

import torch

__all__ = ["Peers"]

_WAIT_S = 180   # at the barrier and for a peer's answer: a first call may be a cold compile


def _peer_loop(rank, tasks, results, barrier, cache_bytes, threads):
    """A peer: time each task of ``tasks`` at the barrier, put (rank, times, window, error)."""
    torch.set_num_threads(threads)   # as many intra-op threads as the sweep's process
    from normtools.measure.bench.backends import backend_fn
    from normtools.measure.bench.shapes import make_inputs
    from normtools.measure.bench.timing import input_sets, rotating_calls, time_calls

    while (task := tasks.get()) is not None:
        op, backend, shape, dtype, device, cache, warmup, reps, timer = task
        try:
            sets = ([make_inputs(op, shape, dtype, device)] if cache == "warm"
                    else input_sets(op, shape, dtype, device, cache_bytes))
            fn = backend_fn(op, backend, device, shape)
            fn(sets[0])
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize(device)
        except BaseException as exc:   # reported to the sweep, which records it
            barrier.abort()
            results.put((rank, None, None, f"{type(exc).__name__}: {exc}"[:300]))
            continue
        try:
            barrier.wait(_WAIT_S)
            start = time.time()
            times, _ = time_calls(rotating_calls(fn, sets), device, warmup, reps, timer)
            results.put((rank, times, (start, time.time()), None))
        except threading.BrokenBarrierError:
            results.put((rank, None, None, "the barrier was broken by another process"))
        except BaseException as exc:
            results.put((rank, None, None, f"{type(exc).__name__}: {exc}"[:300]))
        del sets, fn


class Peers:
    """``n`` peer processes that time each case together with the calling process."""

    def __init__(self, n, cache_bytes):
        if n < 1:
            raise ValueError(f"a run with peers needs at least one, got {n}")
        context = multiprocessing.get_context("spawn")
        self.barrier = context.Barrier(n + 1)
        self.results = context.Queue()
        self.tasks = [context.Queue() for _ in range(n)]
        self.workers = [context.Process(target=_peer_loop, daemon=True,
                                        args=(rank, tasks, self.results, self.barrier,
                                              cache_bytes, torch.get_num_threads()))
                        for rank, tasks in enumerate(self.tasks, start=1)]
        for worker in self.workers:
            worker.start()

    @property
    def processes(self):
        """K: the peers and the calling process."""
        return len(self.workers) + 1

    def time_together(self, task, own_timing):
        """Send ``task`` (op, backend, shape, dtype, device, cache, warmup, reps, timer) to every
        peer, meet them at the barrier and run ``own_timing()`` (returns (times, group)).

        Returns (times, group, peer_times, overlap); raises RuntimeError with the peers'
        reasons when a peer failed or has exited (then no later case waits for it).
        """
        dead = [rank for rank, w in enumerate(self.workers, start=1) if not w.is_alive()]
        if dead:
            raise RuntimeError(f"peer processes {dead} have exited")
        for tasks in self.tasks:
            tasks.put(task)
        own, window, broken = None, None, False
        try:
            self.barrier.wait(_WAIT_S)
            start = time.time()
            own = own_timing()
            window = (start, time.time())
        except threading.BrokenBarrierError:
            broken = True
        except BaseException:
            self.barrier.abort()
            self._collect()
            self.barrier.reset()
            raise
        answers = self._collect()
        if broken:
            self.barrier.reset()
        errors = [f"peer {rank}: {error}" for rank, _, _, error in answers if error]
        if errors or own is None:
            raise RuntimeError("; ".join(errors) or "the barrier was broken")
        peer_times = [times for _, times, _, _ in sorted(answers, key=lambda a: a[0])]
        windows = [window] + [peer_window for _, _, peer_window, _ in answers]
        together = min(end for _, end in windows) - max(start for start, _ in windows)
        overlap = max(0.0, together) / max(window[1] - window[0], 1e-9)
        return own[0], own[1], peer_times, min(1.0, overlap)

    def _collect(self):
        return [self.results.get(timeout=_WAIT_S) for _ in self.workers]

    def close(self):
        """Stop the peers (each ends after its current task)."""
        for tasks in self.tasks:
            tasks.put(None)
        for worker in self.workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.terminate()
