"""Minimum memory traffic of each op: the bytes that every bandwidth figure divides by."""

import torch

from normtools.measure.bench.shapes import OPS, QK_OPS, QK_ROPE_OPS


def bytes_moved(op, shape, dtype):
    """Minimum bytes ``op`` must move: each input read once, each output written once.

    With s the element size, A = M·N·s one activation and W = N·s one weight row (weights have
    the activation dtype here):

    * rms_norm:          read x, w; write y                        = 2A + W
    * rms_norm_fwd_bwd:  forward 2A + W; backward read x, dy, w,
                         write dx, dw (the inverse RMS is recomputable, so not counted)
                                                                   = 5A + 3W
    * add_rms_norm:      read x, residual, w; write normed, summed = 4A + W
    * layer_norm:        read x, w, b; write y                     = 2A + 2W
    * layer_norm_fwd_bwd: forward 2A + 2W; backward read x, dy, w, write dx, dw, db
                                                                   = 5A + 5W
    * qk_norm_*:         read q, k, q_w, k_w; write q_out, k_out   = 2Q + 2K + Wq + Wk
      with Q = T·Hq·D·s, K = T·Hk·D·s; Wq = Wk = D·s per head, Wq = Hq·D·s, Wk = Hk·D·s per layer.
    * qk_norm_rope_*:    qk_norm_* + read cos, sin once per position   = 2Q + 2K + Wq + Wk + C
      with C = 2·T·D·s (the tables of make_inputs have the activation dtype; q and k share them).
    * qk_norm_*_fwd_bwd, qk_norm_rope_*_fwd_bwd: forward as above; backward read q, k,
                         dq_out, dk_out, q_w, k_w (and cos, sin), write dq, dk, dq_w, dk_w
                                                     = 5Q + 5K + 3(Wq + Wk) (+ 2C)
      (the inverse RMS is recomputable, so not counted).
    """
    s = torch.empty(0, dtype=dtype).element_size()
    forward = op.removesuffix("_fwd_bwd")
    if forward in QK_OPS:
        t, hq, hk, d = shape["T"], shape["Hq"], shape["Hk"], shape["D"]
        weights = 2 * d * s if "per_head" in op else (hq + hk) * d * s
        q, k = t * hq * d * s, t * hk * d * s
        tables = 2 * t * d * s if forward in QK_ROPE_OPS else 0
        if op.endswith("_fwd_bwd"):
            return 5 * q + 5 * k + 3 * weights + 2 * tables
        return 2 * q + 2 * k + weights + tables
    act, row = shape["M"] * shape["N"] * s, shape["N"] * s
    per_op = {"rms_norm": 2 * act + row, "rms_norm_fwd_bwd": 5 * act + 3 * row,
              "add_rms_norm": 4 * act + row, "layer_norm": 2 * act + 2 * row,
              "layer_norm_fwd_bwd": 5 * act + 5 * row}
    if op not in per_op:
        raise ValueError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")
    return per_op[op]
