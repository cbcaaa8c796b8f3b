"""Every op, every backend, every memory layout of every tensor argument (OpInfo style).

One sample generator per op describes its tensor arguments (inputs, and the upstream gradients
``d*`` that autograd hands the backward) and yields samples over shape × layout: each argument
in turn contiguous, with padded rows, strided along the last dim, transposed in memory,
expanded (stride 0), and all arguments non-contiguous at once; plus empty inputs and N = 1.

Two properties are checked for every sample, dtype and backend:

* the outputs and every gradient agree with float64 math (``_oracle``; the low-precision bound
  uses torch's own ``F.rms_norm`` / ``F.layer_norm`` in the input dtype);
* with backend="triton", the results are bitwise those of the same call on contiguous copies
  of the same values: a kernel that ignores a stride (or reads past an expanded tensor) reads
  other values. (PyTorch's own reductions, which backend="torch" runs, may sum in another
  order for another layout, so there only the float64 check applies.)
"""

from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from _oracle import DTYPES, assert_close_to_oracle, layer_norm_f64, make_input, rms_norm_f64

import normtools
from normtools.core.reference import rope_reference

NON_CONTIGUOUS = ("padded_rows", "strided_last", "transposed_last", "expanded")
BACKENDS = ("torch", "triton")
RMS_EPS, LN_EPS = 1e-6, 1e-5


@dataclass
class ArgSpec:
    """One tensor argument: its shape, and its value distribution (normal · scale + shift)."""
    shape: tuple
    scale: float = 1.0
    shift: float = 0.0
    grad: bool = False          # an upstream gradient (passed to backward, not to the op)


@dataclass
class Sample:
    what: str
    inputs: dict = field(default_factory=dict)   # name → tensor, in the op's argument order
    grads: dict = field(default_factory=dict)    # name → upstream gradient, one per output


@dataclass
class OpSpec:
    """``call(backend, **inputs) -> tuple of outputs``; ``oracle(**float64 inputs)`` the same in
    float64; ``same(**inputs)`` torch's own implementation in the input dtype; ``specs(shape)``
    the arguments for a row shape (..., N), upstream gradients last and in output order."""
    name: str
    call: callable
    oracle: callable
    same: callable
    specs: callable
    shapes: tuple
    varied: tuple = ()          # arguments whose layouts vary one at a time (default: all)
    dtypes: tuple = tuple(DTYPES)


def layouts_of(spec):
    """Layouts that give a tensor of this shape a distinct memory layout."""
    ndim = len(spec.shape)
    return tuple(layout for layout in NON_CONTIGUOUS if ndim >= 2 or layout not in (
        "padded_rows", "transposed_last")) if ndim else ()


def samples(op, dtype, seed=0):
    """The samples of ``op``: for each shape, all arguments contiguous; each argument alone in
    each of its non-contiguous layouts; all arguments strided along the last dim at once."""
    for shape_index, shape in enumerate(op.shapes):
        specs = op.specs(shape)
        plans = [("contiguous", {})]
        if 0 not in shape and shape[-1] > 1:
            plans += [(f"{name} {layout}", {name: layout}) for name, spec in specs.items()
                      if name in (op.varied or specs) for layout in layouts_of(spec)]
        plans.append(("all strided_last", {name: "strided_last" for name in specs}))
        for plan_index, (what, layouts) in enumerate(plans):
            gen = torch.Generator().manual_seed(seed + 1000 * shape_index + plan_index)
            args = {name: make_input(spec.shape, dtype, layouts.get(name, "contiguous"),
                                     scale=spec.scale, shift=spec.shift, generator=gen)
                    for name, spec in specs.items()}
            yield Sample(f"{op.name} {tuple(shape)} {what}",
                         {name: t for name, t in args.items() if not specs[name].grad},
                         {name: t for name, t in args.items() if specs[name].grad})


def run(fn, inputs, grads):
    """Outputs of ``fn(**inputs)`` and the gradients of every input after backpropagating
    ``grads`` (one per output, in order), keeping each tensor's memory layout."""
    leaves = {name: t.detach().requires_grad_() for name, t in inputs.items()}
    outs = fn(**leaves)
    got = torch.autograd.grad(outs, list(leaves.values()), list(grads), allow_unused=True)
    return [o.detach() for o in outs], list(got)


# ----------------------------------------------------------------------------- the ops

def rms_norm_specs(shape):
    n = shape[-1]
    return {"x": ArgSpec(shape), "weight": ArgSpec((n,), 0.25, 1.0),
            "dy": ArgSpec(shape, grad=True)}


def add_rms_norm_specs(shape):
    n = shape[-1]
    return {"x": ArgSpec(shape), "residual": ArgSpec(shape), "weight": ArgSpec((n,), 0.25, 1.0),
            "dy": ArgSpec(shape, grad=True), "dsum": ArgSpec(shape, grad=True)}


def layer_norm_specs(shape):
    n = shape[-1]
    return {"x": ArgSpec(shape, 1.0, 0.5), "weight": ArgSpec((n,), 0.25, 1.0),
            "bias": ArgSpec((n,), 0.5), "dy": ArgSpec(shape, grad=True)}


HEADS_Q, HEADS_K = 4, 2


def qk_norm_specs(shape):
    """shape = (T, head_dim): q (T, Hq, D), k (T, Hk, D), shared (D,) weights."""
    t, d = shape
    return {"q": ArgSpec((t, HEADS_Q, d)), "k": ArgSpec((t, HEADS_K, d), 2.0),
            "q_weight": ArgSpec((d,), 0.25, 1.0), "k_weight": ArgSpec((d,), 0.25, 1.0),
            "dq": ArgSpec((t, HEADS_Q, d), grad=True), "dk": ArgSpec((t, HEADS_K, d), grad=True)}


def qk_norm_per_layer_specs(shape):
    """shape = (T, head_dim): q (T, Hq·D), k (T, Hk·D), per-layer weights."""
    t, d = shape
    return {"q": ArgSpec((t, HEADS_Q * d)), "k": ArgSpec((t, HEADS_K * d), 2.0),
            "q_weight": ArgSpec((HEADS_Q * d,), 0.25, 1.0),
            "k_weight": ArgSpec((HEADS_K * d,), 0.25, 1.0),
            "dq": ArgSpec((t, HEADS_Q * d), grad=True), "dk": ArgSpec((t, HEADS_K * d), grad=True)}


def qk_norm_rope_specs(shape):
    """shape = (T, head_dim): qk_norm_specs plus the rotary tables cos, sin (T, D)."""
    t, d = shape
    specs = qk_norm_specs(shape)
    grads = {name: specs.pop(name) for name in ("dq", "dk")}
    return specs | {"cos": ArgSpec((t, d)), "sin": ArgSpec((t, d))} | grads


def rope_f64_or_same(norm, q, k, q_weight, k_weight, cos, sin):
    """RoPE (reference form) after ``norm``; the tables are constants (no gradient)."""
    cos, sin = cos.detach()[:, None], sin.detach()[:, None]
    return (rope_reference(norm(q, q_weight), cos, sin),
            rope_reference(norm(k, k_weight), cos, sin))


OPS = [
    OpSpec(
        "rms_norm",
        lambda backend, x, weight: (normtools.rms_norm(x, weight, RMS_EPS, backend=backend),),
        lambda x, weight: (rms_norm_f64(x, weight, RMS_EPS),),
        lambda x, weight: (F.rms_norm(x, (x.shape[-1],), weight, RMS_EPS),),
        rms_norm_specs, ((3, 5, 24), (2, 33), (6, 1), (0, 16))),
    OpSpec(
        "rms_norm_gemma",
        lambda backend, x, weight: (normtools.rms_norm(x, weight, RMS_EPS, offset=1.0,
                                                       casting="gemma", backend=backend),),
        lambda x, weight: (rms_norm_f64(x, weight, RMS_EPS, 1.0),),
        lambda x, weight: (F.rms_norm(x.float(), (x.shape[-1],), 1.0 + weight.float(),
                                      RMS_EPS).to(x.dtype),),
        rms_norm_specs, ((4, 40),)),
    OpSpec(
        "add_rms_norm",
        lambda backend, x, residual, weight: normtools.add_rms_norm(x, residual, weight, RMS_EPS,
                                                                    backend=backend),
        lambda x, residual, weight: (rms_norm_f64(x + residual, weight, RMS_EPS), x + residual),
        lambda x, residual, weight: (F.rms_norm(x + residual, (x.shape[-1],), weight, RMS_EPS),
                                     x + residual),
        add_rms_norm_specs, ((3, 5, 24), (6, 1), (0, 16))),
    OpSpec(
        "layer_norm",
        lambda backend, x, weight, bias: (normtools.layer_norm(x, weight, bias, LN_EPS,
                                                               backend=backend),),
        lambda x, weight, bias: (layer_norm_f64(x, weight, bias, LN_EPS),),
        lambda x, weight, bias: (F.layer_norm(x, (x.shape[-1],), weight, bias, LN_EPS),),
        layer_norm_specs, ((3, 5, 24), (2, 33), (6, 1), (0, 16))),
    OpSpec(
        "qk_norm",
        lambda backend, q, k, q_weight, k_weight: normtools.qk_norm(
            q, k, q_weight, k_weight, RMS_EPS, head_dim=q.shape[-1], backend=backend),
        lambda q, k, q_weight, k_weight: (rms_norm_f64(q, q_weight, RMS_EPS),
                                          rms_norm_f64(k, k_weight, RMS_EPS)),
        lambda q, k, q_weight, k_weight: (F.rms_norm(q, (q.shape[-1],), q_weight, RMS_EPS),
                                          F.rms_norm(k, (k.shape[-1],), k_weight, RMS_EPS)),
        qk_norm_specs, ((5, 16), (3, 1), (0, 8))),
    OpSpec(
        "qk_norm_per_layer",
        lambda backend, q, k, q_weight, k_weight: normtools.qk_norm(
            q, k, q_weight, k_weight, RMS_EPS, head_dim=q.shape[-1] // HEADS_Q,
            scope="per_layer", backend=backend),
        lambda q, k, q_weight, k_weight: (rms_norm_f64(q, q_weight, RMS_EPS),
                                          rms_norm_f64(k, k_weight, RMS_EPS)),
        lambda q, k, q_weight, k_weight: (F.rms_norm(q, (q.shape[-1],), q_weight, RMS_EPS),
                                          F.rms_norm(k, (k.shape[-1],), k_weight, RMS_EPS)),
        qk_norm_per_layer_specs, ((5, 8), (0, 8))),
    OpSpec(
        "qk_norm_rope",
        lambda backend, q, k, q_weight, k_weight, cos, sin: normtools.qk_norm_rope(
            q, k, q_weight, k_weight, cos.detach(), sin.detach(), RMS_EPS, head_dim=q.shape[-1],
            backend=backend),
        lambda **args: rope_f64_or_same(lambda x, w: rms_norm_f64(x, w, RMS_EPS), **args),
        lambda **args: rope_f64_or_same(
            lambda x, w: F.rms_norm(x, (x.shape[-1],), w, RMS_EPS), **args),
        qk_norm_rope_specs, ((5, 16), (0, 8)),
        # the q/k arguments are handled as in qk_norm (sampled above); the interpreter is slow
        varied=("q", "q_weight", "cos", "sin", "dq"), dtypes=(torch.float32, torch.bfloat16)),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op, dtype", [(op, dtype) for op in OPS for dtype in op.dtypes],
                         ids=lambda v: v.name if isinstance(v, OpSpec) else str(v))
def test_every_layout_of_every_argument(op, backend, dtype):
    """Outputs and gradients of each sample: close to float64, and (Triton) bitwise equal to
    the same call on contiguous copies."""
    for sample in samples(op, dtype):
        inputs, grads = sample.inputs, list(sample.grads.values())
        outs, dinputs = run(lambda **a: op.call(backend, **a), inputs, grads)
        if backend == "triton":
            dense = {name: t.contiguous() for name, t in inputs.items()}
            outs_dense, dinputs_dense = run(lambda **a: op.call(backend, **a), dense,
                                            [g.contiguous() for g in grads])
        else:
            outs_dense, dinputs_dense = outs, dinputs
        outs64, dinputs64 = run(op.oracle, {n: t.double() for n, t in inputs.items()},
                                [g.double() for g in grads])
        outs_same, dinputs_same = run(op.same, inputs, grads)
        names = [f"out{i}" for i in range(len(outs))] + [f"d{n}" for n in inputs]
        for name, got, got_dense, ref, same in zip(names, outs + dinputs,
                                                   outs_dense + dinputs_dense,
                                                   outs64 + dinputs64, outs_same + dinputs_same):
            what = f"{sample.what}, {backend}, {dtype}: {name}"
            if ref is None:                      # a constant (the rotary tables)
                assert got is None and got_dense is None, what
                continue
            assert torch.equal(got, got_dense), f"{what} depends on the memory layout"
            assert_close_to_oracle(got, ref, same, dtype, what)


def test_samples_cover_every_layout_of_every_argument():
    """The generator really produces the layouts it names (a stride-0 tensor, a last-dim stride
    other than 1, padded rows), for every argument of every op, so that the property test above
    cannot silently check contiguous tensors only."""
    seen = {}
    for op in OPS:
        for sample in samples(op, torch.float32):
            for name, t in (sample.inputs | sample.grads).items():
                kinds = seen.setdefault((op.name, name), set())
                if t.numel() > 1:
                    kinds.add("expanded" if 0 in t.stride() else
                              "strided_last" if t.stride(-1) != 1 else
                              "contiguous" if t.is_contiguous() else "padded_rows")
    varied = {(op.name, name) for op in OPS for name in (op.varied or op.specs(op.shapes[0]))}
    for (op_name, name), kinds in seen.items():
        if (op_name, name) not in varied:
            continue
        needed = {"contiguous", "expanded", "strided_last"} | (
            {"padded_rows"} if name not in ("weight", "bias", "q_weight", "k_weight") else set())
        assert needed <= kinds, f"{op_name}.{name}: no sample with layout {needed - kinds}"
