"""Sweep plan: the ops, the backends, the shapes of a sweep and the inputs of one case."""

import torch

from normtools.core.reference import rope_tables

ROW_OPS = ("rms_norm", "rms_norm_fwd_bwd", "add_rms_norm", "layer_norm")
# Fused QK-Norm + RoPE, forward and forward+backward (normtools.qk_norm_rope).
QK_ROPE_OPS = ("qk_norm_rope_per_head", "qk_norm_rope_per_layer",
               "qk_norm_rope_per_head_fwd_bwd", "qk_norm_rope_per_layer_fwd_bwd")
QK_OPS = ("qk_norm_per_head", "qk_norm_per_layer") + QK_ROPE_OPS
# Sweep order: the ops with performance targets first, so a time budget cuts the others.
OPS = ("rms_norm", "rms_norm_fwd_bwd", "qk_norm_per_head", "add_rms_norm", "layer_norm",
       "qk_norm_per_layer") + QK_ROPE_OPS
BACKENDS = ("normtools-triton", "normtools-triton-chunks", "normtools-triton-prefetch",
            "normtools-torch", "torch-F", "torch-compile", "liger")
RMS_EPS, LAYER_EPS = 1e-6, 1e-5
ROPE_THETA = 10000.0

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ------------------------------------------------------------------------------------ shapes

def default_shapes(device, quick=False):
    """The sweep: {op: [shape, ...]}; a shape is a dict of ints.

    Row ops: M tokens × N features. QK ops: T tokens, Hq query heads, Hk key heads (GQA), head
    dim D. CUDA: M = 4096, N = 1K … 128K; T = 8192, D ∈ {64, 128, 256},
    (Hq, Hk) ∈ {(32, 8), (64, 8), (16, 16)}. CPU: a few small shapes; ``quick``: one tiny shape
    per op (for tests).
    """
    if quick:
        rows, qk = [{"M": 64, "N": 256}], [{"T": 16, "Hq": 4, "Hk": 2, "D": 64}]
    elif torch.device(device).type == "cuda":
        rows = [{"M": 4096, "N": 2**p} for p in range(10, 18)]
        qk = [{"T": 8192, "Hq": hq, "Hk": hk, "D": d} for d in (64, 128, 256)
              for hq, hk in ((32, 8), (64, 8), (16, 16))]
    else:
        rows = [{"M": 256, "N": 1024}, {"M": 256, "N": 4096}]
        qk = [{"T": 256, "Hq": 8, "Hk": 2, "D": 128}]
    return {op: (rows if op in ROW_OPS else qk) for op in OPS}


def rows_and_length(op, shape):
    """(rows, N) of the rows ``op`` normalizes at ``shape``: (M, N) for a row op; for QK-Norm
    (T, head_dim) per head and (T, Hq · head_dim) per layer (q's row, the longer one)."""
    if "N" in shape:
        return shape["M"], shape["N"]
    return shape["T"], shape["D"] * (1 if "per_head" in op else shape["Hq"])


def shape_label(shape):
    """"M=4096 N=2048" for a shape dict."""
    return " ".join(f"{k}={v}" for k, v in shape.items())


# ------------------------------------------------------------------------ inputs and bytes

def make_inputs(op, shape, dtype, device, seed=0):
    """One set of random inputs for ``op`` at ``shape``: a dict of tensors.

    Row ops: x (M, N), w (N,), plus residual (M, N) for add_rms_norm, b (N,) for layer_norm, and
    dy (M, N) for rms_norm_fwd_bwd (x and w then require grad). QK ops: q (T, Hq·D), k (T, Hk·D)
    and weights q_w, k_w of shape (D,) per head or (Hq·D,), (Hk·D,) per layer. Weights are
    1 + small noise in the activation dtype; nothing is zero. qk_norm_rope_*: also cos, sin
    (T, D), the rotary tables of positions 0 … T−1 (``reference.rope_tables``), and for *_fwd_bwd the
    output gradients dq_out (T, Hq·D), dk_out (T, Hk·D) (q, k, q_w, k_w then require grad).
    """
    if op not in OPS + QK_OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*size, scale=1.0, base=0.0):
        z = torch.randn(*size, generator=g, device=device, dtype=torch.float32)
        return (base + scale * z).to(dtype)

    if op in QK_OPS:
        t, hq, hk, d = shape["T"], shape["Hq"], shape["Hk"], shape["D"]
        per_head = "per_head" in op
        inputs = {"q": randn(t, hq * d), "k": randn(t, hk * d),
                  "q_w": randn(d if per_head else hq * d, scale=0.1, base=1.0),
                  "k_w": randn(d if per_head else hk * d, scale=0.1, base=1.0)}
        if op in QK_ROPE_OPS:
            inputs["cos"], inputs["sin"] = rope_tables(t, d, ROPE_THETA, dtype, device)
        if op.endswith("_fwd_bwd"):
            for name in ("q", "k", "q_w", "k_w"):
                inputs[name].requires_grad_(True)
            inputs["dq_out"], inputs["dk_out"] = randn(t, hq * d), randn(t, hk * d)
        return inputs
    m, n = shape["M"], shape["N"]
    inputs = {"x": randn(m, n), "w": randn(n, scale=0.1, base=1.0)}
    if op == "add_rms_norm":
        inputs["residual"] = randn(m, n)
    if op == "layer_norm":
        inputs["b"] = randn(n, scale=0.1)
    if op == "rms_norm_fwd_bwd":
        inputs["x"].requires_grad_(True)
        inputs["w"].requires_grad_(True)
        inputs["dy"] = randn(m, n)
    return inputs
