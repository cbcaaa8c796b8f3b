"""One callable per (op, backend): normtools, torch.nn.functional, torch.compile, Liger-Kernel."""

import dataclasses
from functools import partial
from importlib import import_module, util

import torch

from normtools.core import launch_hooks, launcher
from normtools.measure import triton_runs
from normtools.measure.bench.shapes import BACKENDS, LAYER_EPS, QK_ROPE_OPS, RMS_EPS

# ---------------------------------------------------------------------------------- backends

class Unavailable(Exception):
    """A backend that cannot run here; the message is the reason recorded in the results."""


def _composed_ops(rms, layer, head_dim):
    """The ops composed from ``rms(x, w, eps)`` and ``layer(x, w, b, eps)`` over the last dim.

    add_rms_norm is ``summed = x + residual`` then ``rms(summed)``; QK-Norm is one ``rms`` call on
    q and one on k, viewed as (T, H, D) per head. QK-Norm + RoPE: that QK-Norm, then
    ``reference.rope_reference`` (transformers' ``apply_rotary_pos_emb``: plain PyTorch ops) on
    each (T, H, D) head, the (T, D) tables broadcast over the heads.
    Returns {op: fn(inputs) -> output(s)}.
    """
    def per_head(x, w):
        return rms(x.view(x.shape[0], -1, head_dim), w, RMS_EPS).view(x.shape)

    def add_rms_norm(t):
        summed = t["x"] + t["residual"]
        return rms(summed, t["w"], RMS_EPS), summed

    from normtools.core.reference import rope_reference

    def rotated(y, t):
        heads = y.view(y.shape[0], -1, head_dim)
        return rope_reference(heads, t["cos"][:, None], t["sin"][:, None]).view(y.shape)

    def qk_rope(t, scope):
        if scope == "per_head":
            q, k = per_head(t["q"], t["q_w"]), per_head(t["k"], t["k_w"])
        else:
            q, k = rms(t["q"], t["q_w"], RMS_EPS), rms(t["k"], t["k_w"], RMS_EPS)
        return rotated(q, t), rotated(k, t)

    return {
        "rms_norm": lambda t: rms(t["x"], t["w"], RMS_EPS),
        "add_rms_norm": add_rms_norm,
        "layer_norm": lambda t: layer(t["x"], t["w"], t["b"], LAYER_EPS),
        "qk_norm_per_head": lambda t: (per_head(t["q"], t["q_w"]), per_head(t["k"], t["k_w"])),
        "qk_norm_per_layer": lambda t: (rms(t["q"], t["q_w"], RMS_EPS),
                                        rms(t["k"], t["k_w"], RMS_EPS)),
        "qk_norm_rope_per_head": partial(qk_rope, scope="per_head"),
        "qk_norm_rope_per_layer": partial(qk_rope, scope="per_layer"),
    }


def _normtools_ops(backend, head_dim):
    from normtools.core import ops
    from normtools.core.qk import qk_norm
    from normtools.core.rope import qk_norm_rope

    def qk(t, scope):
        return qk_norm(t["q"], t["k"], t["q_w"], t["k_w"], RMS_EPS, head_dim=head_dim,
                       scope=scope, backend=backend)

    def qk_rope(t, scope):
        return qk_norm_rope(t["q"], t["k"], t["q_w"], t["k_w"], t["cos"], t["sin"], RMS_EPS,
                            head_dim=head_dim, scope=scope, backend=backend)

    return {
        "rms_norm": lambda t: ops.rms_norm(t["x"], t["w"], RMS_EPS, backend=backend),
        "add_rms_norm": lambda t: ops.add_rms_norm(t["x"], t["residual"], t["w"], RMS_EPS,
                                                   backend=backend),
        "layer_norm": lambda t: ops.layer_norm(t["x"], t["w"], t["b"], LAYER_EPS, backend=backend),
        "qk_norm_per_head": partial(qk, scope="per_head"),
        "qk_norm_per_layer": partial(qk, scope="per_layer"),
        "qk_norm_rope_per_head": partial(qk_rope, scope="per_head"),
        "qk_norm_rope_per_layer": partial(qk_rope, scope="per_layer"),
    }


_CHUNKED_CAPABILITY = 80     # an A100's plan: no clusters, long rows read in chunks


def _sm90_plans(op, shape, stages=1):
    """The H200 plans of the main kernels of ``op`` at ``shape`` (``triton_runs.kernels_of``),
    each as its launcher plans it (``triton_runs.launch_of``), prefetching ``stages``."""
    with launch_hooks.planning_for_cuda(), launch_hooks.prefetching(stages):
        return [triton_runs.launch_of(kernel, op, shape, torch.bfloat16)[0]
                for kernel in triton_runs.kernels_of(op)]


def clusters_matter(op, shape):
    """True when an sm_90 launch plan of ``op`` at ``shape`` runs a kernel on thread-block
    clusters, so that the chunked plan (``_CHUNKED_CAPABILITY``) launches it differently."""
    return any(plan.num_ctas > 1 for plan in _sm90_plans(op, shape))


def on_chunked_plan(fn, sm_count):
    """``fn`` with every kernel launched on the plan of a GPU of ``sm_count`` SMs without
    clusters (compute capability ``_CHUNKED_CAPABILITY``), backward included."""
    def call(t):
        with launch_hooks.planning_for_cuda(sm_count, _CHUNKED_CAPABILITY):
            return fn(t)
    return call


def _cuda_plan_ops(device, head_dim):
    """normtools-triton's ops, for a backend that changes their CUDA launch plan."""
    if torch.device(device).type != "cuda":
        raise Unavailable("a CUDA launch plan: on CPU the kernels run the interpreter's plan")
    return _normtools_ops("triton", head_dim)


# normtools-triton-prefetch: the same kernels and plan, the single-pass loops over row (token)
# blocks loading PREFETCH_STAGES − 1 blocks ahead (launch_hooks.prefetching): the A/B of the
# prefetch, timed where an sm_90 plan has a single-pass program of more than one row block.
PREFETCH_STAGES = 2


def prefetch_matters(op, shape):
    """True when the H200 plan of a main kernel of ``op`` at ``shape``
    (``triton_runs.launch_of``, as its launcher plans it), prefetching PREFETCH_STAGES, has a
    tensor whose programs loop over more than one row block (something to load ahead; only
    launch_plans.PREFETCH_KERNELS prefetch)."""
    return any(plan.num_stages > 1 and share.rows_per_program > plan.block_m
               for plan in _sm90_plans(op, shape, PREFETCH_STAGES) for share in plan.shares)


def on_prefetching_plan(fn, stages=PREFETCH_STAGES):
    """``fn`` with every kernel launched on a plan that prefetches ``stages``, backward
    included."""
    def call(t):
        with launch_hooks.prefetching(stages):
            return fn(t)
    return call


def _torch_f_ops(head_dim):
    import torch.nn.functional as F

    def rms(x, w, eps):
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    def layer(x, w, b, eps):
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)

    return _composed_ops(rms, layer, head_dim)


# Enough recompiles for every shape of a run: past the limit torch.compile would silently run
# the function eagerly, and the row would time eager PyTorch under the torch-compile name.
_RECOMPILE_LIMIT = 512
_COMPILED = {}


def allow_recompiles():
    """Raise Dynamo's recompile limits to ``_RECOMPILE_LIMIT`` (never lower them), so that every
    shape of a run compiles instead of falling back to eager."""
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name,
                    max(getattr(torch._dynamo.config, name), _RECOMPILE_LIMIT))


def _compiled_reference_ops(head_dim):
    """torch.compile of the reference composition, built once per head_dim and kept: a new
    shape recompiles in the same process (warm caches) instead of after a
    ``torch.compiler.reset()``, which made every shape a cold compile."""
    from normtools.core.reference import layer_norm_reference, rms_norm_reference

    if head_dim not in _COMPILED:
        allow_recompiles()
        ops = _composed_ops(rms_norm_reference, layer_norm_reference, head_dim)
        _COMPILED[head_dim] = {op: torch.compile(fn, dynamic=False) for op, fn in ops.items()}
    return _COMPILED[head_dim]


def _liger_ops(device, head_dim):
    """Liger-Kernel as its own benchmark runs it (benchmark/scripts/benchmark_rms_norm.py uses
    ``LigerRMSNorm`` with its defaults): ``in_place=True``, the backward writing dx into dy's
    buffer, and the fused add+RMSNorm with its default ``in_place=True``."""
    if torch.device(device).type != "cuda":
        raise Unavailable("Liger-Kernel runs on CUDA only")
    if util.find_spec("liger_kernel") is None:
        raise Unavailable("liger_kernel is not installed")
    functional = import_module("liger_kernel.transformers.functional")

    def rms(x, w, eps):
        return functional.liger_rms_norm(x, w, eps, in_place=True)

    ops = {op: fn for op, fn in _composed_ops(rms, functional.liger_layer_norm, head_dim).items()
           if op not in QK_ROPE_OPS}   # no fused QK-Norm + RoPE in Liger: see _NOT_OFFERED
    fused_add = getattr(functional, "liger_fused_add_rms_norm", None)
    if fused_add is not None:
        ops["add_rms_norm"] = lambda t: fused_add(t["x"], t["residual"], t["w"], RMS_EPS,
                                                  in_place=True)
    return ops


def _with_backward(forward):
    """forward + backward: y = forward(t); return (dx, dw) = ∂⟨y, dy⟩/∂(x, w)."""
    def fwd_bwd(t):
        return torch.autograd.grad(forward(t), (t["x"], t["w"]), t["dy"])
    return fwd_bwd


def _qk_with_backward(forward):
    """forward + backward of a QK op: (q_out, k_out) = forward(t); return (dq, dk, dq_w, dk_w)
    = ∂(⟨q_out, dq_out⟩ + ⟨k_out, dk_out⟩)/∂(q, k, q_w, k_w)."""
    def fwd_bwd(t):
        return torch.autograd.grad(forward(t), (t["q"], t["k"], t["q_w"], t["k_w"]),
                                   (t["dq_out"], t["dk_out"]))
    return fwd_bwd


def _no_grad(fn):
    def call(t):
        with torch.no_grad():
            return fn(t)
    return call


# Ops a backend does not offer, and why (the reason recorded in the skipped rows).
_NOT_OFFERED = {("liger", f"qk_norm_rope_{scope}"):
                "Liger-Kernel has no fused QK-Norm + RoPE (its RMSNorm and its RoPE are separate "
                "kernels, two passes over q and k)" for scope in ("per_head", "per_layer")}


@dataclasses.dataclass(frozen=True)
class _PlanVariant:
    """A backend that runs normtools-triton on another CUDA launch plan: timed only where
    ``matters(op, shape)`` (the plan differs), skipped elsewhere for ``lacking``; ``wrap(fn,
    device)`` runs fn on that plan."""

    matters: object
    lacking: str
    wrap: object


_PLAN_VARIANTS = {
    "normtools-triton-chunks": _PlanVariant(
        clusters_matter, "no thread-block cluster",
        lambda fn, device: on_chunked_plan(fn, launcher.cuda_sm_count_and_capability(device)[0])),
    "normtools-triton-prefetch": _PlanVariant(
        prefetch_matters, "no single-pass program of several row blocks to prefetch",
        lambda fn, device: on_prefetching_plan(fn)),
}


def backend_fn(op, backend, device, shape):
    """fn(inputs) -> output(s) running ``op`` on ``backend``; raises ``Unavailable``."""
    head_dim = shape.get("D")
    builders = {
        "normtools-triton": lambda: _normtools_ops("triton", head_dim),
        **{variant: lambda: _cuda_plan_ops(device, head_dim) for variant in _PLAN_VARIANTS},
        "normtools-torch": lambda: _normtools_ops("torch", head_dim),
        "torch-F": lambda: _torch_f_ops(head_dim),
        "torch-compile": lambda: _compiled_reference_ops(head_dim),
        "liger": lambda: _liger_ops(device, head_dim),
    }
    if backend not in builders:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    ops = builders[backend]()
    forward = op.removesuffix("_fwd_bwd")
    if forward not in ops:
        raise Unavailable(_NOT_OFFERED.get((backend, forward), f"{backend} has no {op}"))
    if not offered(op, backend, shape):
        raise Unavailable(f"{_PLAN_VARIANTS[backend].lacking} in the sm_90 plan of this "
                          "shape: the launch plan of normtools-triton")
    if op == "rms_norm_fwd_bwd":
        fn = _with_backward(ops["rms_norm"])
    elif op.endswith("_fwd_bwd"):
        fn = _qk_with_backward(ops[forward])
    else:
        fn = _no_grad(ops[op])
    if backend in _PLAN_VARIANTS:
        return _PLAN_VARIANTS[backend].wrap(fn, device)
    return fn


def offered(op, backend, shape):
    """Whether ``backend`` times ``op`` at ``shape`` (False: a skipped row, which the time
    estimate leaves out): not a fused op it lacks, for normtools-triton-chunks only where
    ``clusters_matter``, for normtools-triton-prefetch only where ``prefetch_matters``."""
    if (backend, op.removesuffix("_fwd_bwd")) in _NOT_OFFERED:
        return False
    return backend not in _PLAN_VARIANTS or _PLAN_VARIANTS[backend].matters(op, shape)


def default_backends(device):
    """{backend: None (run it) or the reason it is skipped by default}."""
    skips = {b: None for b in BACKENDS}
    if torch.device(device).type != "cuda":
        skips["normtools-triton"] = ("skipped on CPU by default: Triton's interpreter runs "
                                     "kernels in Python, its timing is meaningless")
    return skips
