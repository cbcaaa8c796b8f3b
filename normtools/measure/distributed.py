"""Running and measuring code on several processes (``torch.distributed``, gloo on CPU).

``spawn`` runs a module-level function on P processes joined in a process group and returns
each rank's result; ``run_all`` runs several such functions in one group (process start-up is
the cost). ``CommBytes`` counts, inside it, the collectives a rank makes and the bytes it
receives by the ring algorithms NCCL uses for large messages, with b the bytes of the full
tensor and P the group size:

    all-reduce: 2·(P − 1)/P · b     all-gather: (P − 1)/P · b     reduce-scatter: (P − 1)/P · b

(all-gather's b is the gathered output, reduce-scatter's the unreduced input).
"""

import multiprocessing
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["spawn", "run_all", "CommBytes"]


def _run_rank(rank, fn, world_size, dist_backend, init_method, out_dir, args, kwargs):
    """Body of one spawned process: join the process group, run fn, save its result."""
    torch.set_num_threads(1)
    if dist_backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(dist_backend, init_method=init_method, rank=rank,
                            world_size=world_size)
    try:
        torch.save(fn(rank, world_size, *args, **kwargs), os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn(fn, world_size, *args, dist_backend="gloo", **kwargs):
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes joined in a
    ``dist_backend`` process group (gloo: CPU; nccl: GPU ``rank`` per process) and return the
    list of results by rank.

    ``fn`` must be a module-level function (it is imported in the workers, not copied), so this
    works from a notebook. The workers are forked from multiprocessing's fork server, which
    imports torch and normtools once (``set_forkserver_preload``) and is reused by later
    calls; results travel back through ``torch.save``. The server also imports
    ``torch._dynamo``, which the first custom-op call imports otherwise, in every rank (seconds
    each).
    """
    multiprocessing.set_forkserver_preload([__name__, "torch._dynamo"])
    with tempfile.TemporaryDirectory() as out_dir:
        init_method = "file://" + os.path.join(out_dir, "rendezvous")
        mp.start_processes(_run_rank, nprocs=world_size, join=True, start_method="forkserver",
                           args=(fn, world_size, dist_backend, init_method, out_dir, args, kwargs))
        return [torch.load(os.path.join(out_dir, f"{rank}.pt"), map_location="cpu")
                for rank in range(world_size)]


def run_all(rank, world_size, calls):
    """Per-rank worker (for ``spawn``) running several workers in one process group:
    ``calls`` is a list of (fn, args, kwargs); returns the list of their results."""
    return [fn(rank, world_size, *args, **kwargs) for fn, args, kwargs in calls]


def _group_size(group_name):
    return dist.distributed_c10d._resolve_process_group(group_name).size()


def _tensor_bytes(tensors):
    tensors = tensors if isinstance(tensors, (list, tuple)) else [tensors]
    return sum(t.numel() * t.element_size() for t in tensors)


_funcol = torch.ops._c10d_functional
_c10d = torch.ops.c10d
# op -> (kind, bytes of the full tensor b, group size P) from its arguments
_COLLECTIVES = {
    _funcol.all_reduce.default: lambda a: ("all_reduce", _tensor_bytes(a[0]), _group_size(a[2])),
    _funcol.all_gather_into_tensor.default:
        lambda a: ("all_gather", _tensor_bytes(a[0]) * a[1], a[1]),
    _funcol.reduce_scatter_tensor.default:
        lambda a: ("reduce_scatter", _tensor_bytes(a[0]), a[2]),
    _c10d.allreduce_.default:
        lambda a: ("all_reduce", _tensor_bytes(a[0]), dist.ProcessGroup.unbox(a[1]).size()),
}
_MOVES_DATA = ("all", "reduce", "gather", "scatter", "broadcast", "send", "recv")
_RING_FACTOR = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}


class CommBytes(TorchDispatchMode):
    """Context manager recording the collectives this rank makes inside it: ``calls`` lists
    (kind, b, P); ``received`` is the total of the ring formulas of the module docstring. A
    collective it has no formula for raises (an uncounted byte would go unnoticed)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _COLLECTIVES:
            self.calls.append(_COLLECTIVES[func](args))
        elif func.namespace in ("_c10d_functional", "c10d") and any(
                word in func.name() for word in _MOVES_DATA):
            raise NotImplementedError(f"CommBytes has no byte count for {func}")
        return func(*args, **(kwargs or {}))

    @property
    def received(self):
        return sum(_RING_FACTOR[kind] * (p - 1) * b / p for kind, b, p in self.calls)
