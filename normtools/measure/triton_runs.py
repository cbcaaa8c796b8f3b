"""The ops that the bytes counter and the spill report launch, run on the Triton backend.

``normtools.measure.bytes_counter`` (bytes touched, run under the interpreter) and
``normtools.measure.spills`` (registers and spills, launches recorded and compiled) both need
"run this op on ``backend="triton"``, forward or forward+backward, so that its kernels are
launched": that is ``run_on_triton``. The bytes counter, the SM-time model and the cluster
pass also need the plan of each of those launches without running it: ``kernels_of`` and
``launch_of``. An op is a base op of ``normtools.measure.bench`` —
rms_norm, add_rms_norm, layer_norm, qk_norm_per_head / per_layer, qk_norm_rope_per_head /
per_layer — optionally with ``_fwd_bwd`` (forward, then backward to every input that has a
gradient). ``op_inputs`` makes its inputs with ``bench.make_inputs`` (the rotary tables of
qk_norm_rope included).
"""

import torch

from normtools.core.launcher import plan_for
from normtools.core.ops import add_rms_norm, layer_norm, rms_norm
from normtools.core.qk import launch_shape as qk_launch_shape
from normtools.core.qk import qk_norm
from normtools.core.rope import launch_shape as rope_launch_shape
from normtools.core.rope import qk_norm_rope
from normtools.measure.bench.shapes import make_inputs

OPS = ("rms_norm", "rms_norm_fwd_bwd", "add_rms_norm", "add_rms_norm_fwd_bwd", "layer_norm",
       "layer_norm_fwd_bwd", "qk_norm_per_head", "qk_norm_per_head_fwd_bwd",
       "qk_norm_per_layer", "qk_norm_per_layer_fwd_bwd", "qk_norm_rope_per_head",
       "qk_norm_rope_per_head_fwd_bwd", "qk_norm_rope_per_layer",
       "qk_norm_rope_per_layer_fwd_bwd")
# What a row op's N or a QK op's (Hq, Hk, D) mean: see op_shape.
QK_HEADS = (32, 8)


def _base_op(op):
    """The forward op of ``op``: "rms_norm" for "rms_norm_fwd_bwd"."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")
    return op.removesuffix("_fwd_bwd")


def op_shape(op, n, m):
    """The shape of ``op`` at row length ``n`` and ``m`` rows (tokens): (M, N) for row ops;
    for QK ops Hq, Hk = QK_HEADS and head_dim D = n per head, n / Hq per layer (the per-layer
    row of q is n long)."""
    if not op.startswith("qk_norm"):
        return {"M": m, "N": n}
    hq, hk = QK_HEADS
    return {"T": m, "Hq": hq, "Hk": hk, "D": n if "per_head" in op else n // hq}


def kernels_of(op):
    """The main kernels ``op`` launches: (forward,) or (forward, backward) for *_fwd_bwd."""
    base = _base_op(op)
    family = ("qk_norm_rope" if base.startswith("qk_norm_rope") else
              "qk_norm" if base.startswith("qk_norm") else
              "layer_norm" if base == "layer_norm" else "rms_norm")
    return (family + "_fwd",) + ((family + "_bwd",) if op.endswith("_fwd_bwd") else ())


def launch_of(kernel, op, shape, dtype):
    """(plan, heads) of the launch of ``kernel`` (a name of ``kernels_of(op)``) for ``op`` at
    ``shape``, planned as its launcher plans it (on the CUDA device of an enclosing
    ``launch_hooks.planning_for_cuda``; nothing runs): the LaunchPlan, and per tensor the
    heads of each of its slots (a row op: one slot of one row)."""
    if not kernel.startswith("qk_norm"):
        return plan_for(kernel, dtype, shape["M"], shape["N"], "cpu"), ([1],)
    t, hq, hk, d = shape["T"], shape["Hq"], shape["Hk"], shape["D"]
    if "per_layer" in op:
        plan = (rope_launch_shape(kernel, t, hq, hk, d, True, dtype, "cpu")[0]
                if kernel.startswith("qk_norm_rope") else
                qk_launch_shape(kernel, t, hq * d, hk * d, 1, 1, dtype, "cpu")[0])
        return plan, ([hq], [hk])
    if kernel.startswith("qk_norm_rope"):
        # a slot: units_per_slot tiles of BLOCK_HQ (BLOCK_HK) heads
        plan, block_hq, block_hk = rope_launch_shape(kernel, t, hq, hk, d, False, dtype,
                                                     "cpu")[:3]
        per_slot = tuple(block * share.units_per_slot
                         for block, share in zip((block_hq, block_hk), plan.shares))
    else:
        plan = qk_launch_shape(kernel, t, d, d, hq, hk, dtype, "cpu")[0]
        per_slot = tuple(share.units_per_slot for share in plan.shares)
    return plan, tuple([min(block, h - s * block) for s in range(share.slots)]
                       for share, h, block in zip(plan.shares, (hq, hk), per_slot))


def op_inputs(op, shape, dtype, seed=0):
    """Random CPU inputs of ``op`` at ``shape`` (those of its forward op), with the head dim
    under "D" for QK ops."""
    inputs = make_inputs(_base_op(op), shape, dtype, "cpu", seed)
    inputs["D"] = shape.get("D")
    return inputs


def run_on_triton(op, inputs, seed=0):
    """Run ``op`` on ``backend="triton"`` with ``inputs`` (``op_inputs``): the forward, and for
    *_fwd_bwd the backward with random output gradients. Returns the forward's outputs."""
    base, backward = _base_op(op), op.endswith("_fwd_bwd")
    tensors = {k: v.detach().requires_grad_(backward and k not in ("cos", "sin"))
               for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    if base.startswith("qk_norm_rope"):
        outs = qk_norm_rope(tensors["q"], tensors["k"], tensors["q_w"], tensors["k_w"],
                            tensors["cos"], tensors["sin"], head_dim=inputs["D"],
                            scope=base[len("qk_norm_rope_"):], backend="triton")
    elif base.startswith("qk_norm"):
        outs = qk_norm(tensors["q"], tensors["k"], tensors["q_w"], tensors["k_w"],
                       head_dim=inputs["D"], scope=base[len("qk_norm_"):], backend="triton")
    elif base == "rms_norm":
        outs = (rms_norm(tensors["x"], tensors["w"], backend="triton"),)
    elif base == "add_rms_norm":
        outs = add_rms_norm(tensors["x"], tensors["residual"], tensors["w"], backend="triton")
    else:
        outs = (layer_norm(tensors["x"], tensors["w"], tensors["b"], backend="triton"),)
    if backward:
        gen = torch.Generator().manual_seed(seed + 1)
        grads = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]
        torch.autograd.backward(outs, grads)
    return outs
