"""QK-Norm, measured on the first layer that has a q/k norm (in a hybrid such as Qwen3-Next,
layer 0 may be linear attention, without one).

* scope: perturb one head of the norm's recorded input and count the heads of its output that
  move (one head: per head, with one weight per head when the weight has H*head_dim values; all
  heads: per layer);
* the weight shape: (head_dim,), (H, head_dim) or (H*head_dim,);
* before or after RoPE: the model ran a second time with every position id moved by the same
  offset. Relative positions do not change, so only RoPE's rotation does, and a norm before RoPE
  reads the same input both times (undetermined when the rotary embedding ignores the offset).
"""

import copy

from normtools.cards.atlas.norm import probe_norm, scale_param


def qk_norms(pm, readings) -> tuple:
    """({full name: :func:`_probe_qk`}, the first layer with a q/k norm or None, [q/k norms that
    could not be probed]) of a :class:`ProbedModel` and its :class:`LayerReading` s."""
    qk_layer = next((i for i, r in enumerate(readings) if r.qk), None)
    probes, unprobed = {}, []
    if qk_layer is None:
        return probes, qk_layer, unprobed
    layer = f"{pm.prefix}.{qk_layer}"
    for n in readings[qk_layer].qk:
        try:
            probes[n] = _probe_qk(pm.norms[n], pm.seen(n)[0], pm.shifted_calls.get(n, [(None, None)])[0][0],
                                 n[len(layer) + 1:], pm.head_dim, pm.heads)
        except Exception:  # noqa: BLE001 - a q/k norm with other inputs (Zaya's takes q and k)
            unprobed.append(n)  # is reported among the other norms, with the reason
    return probes, qk_layer, unprobed


def _probe_qk(module, inp, shifted_inp, local_name, head_dim, heads) -> dict:
    """QK-Norm scope by perturbing one head; weight shape; before/after RoPE (``shifted_inp``:
    its input with every position id moved, None when undetermined). ``which``: "q", "k", or
    "qk" for one module applied to both (probed on q's heads); ``heads``: {"q": H, "k": H_kv}."""
    last = local_name.rsplit(".", 1)[-1].lower()
    which = "qk" if last.startswith("qk") else "q" if last.startswith("q") else "k"
    h = heads["q" if which == "qk" else which]
    moved_heads = _moved_heads(module, inp.float(), h, head_dim)
    _, weight = scale_param(module)
    scope = "unrecognised"
    if moved_heads == 1:
        scope = "per_head_weights" if weight is not None and weight.numel() == h * head_dim else "per_head"
    elif moved_heads is not None and moved_heads == h:
        scope = "per_layer"
    norm = probe_norm(module, tuple(inp.shape))
    return {"which": which, "scope": scope, "moved_heads": moved_heads, "heads": h,
            "weight_shape": list(weight.shape) if weight is not None else None,
            "before_rope": _before_rope(inp, shifted_inp), "norm": norm, "name": local_name}


def _moved_heads(module, x, h, d):
    """How many of the ``h`` heads of the norm's output move when head 0 of its input ``x`` does
    (None when no axis of ``x`` holds the heads)."""
    import torch

    if x.shape[-1] == d:  # per-head rows: the head axis is the one of size h (tokens differ)
        axis = next((a for a in range(x.dim() - 1) if x.shape[a] == h), None)
        view = x
    elif h and d and x.shape[-1] == h * d:
        axis, view = x.dim() - 1, x.unflatten(-1, (h, d))
    else:
        return None
    if axis is None:
        return None
    m = copy.deepcopy(module).float().eval()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        base = m(x)
        bumped = view.clone()
        bumped.select(axis, 0).add_(torch.randn(bumped.select(axis, 0).shape, generator=gen))
        out = m(bumped.reshape(x.shape))
        diff = (out - base).abs()
        diff = diff if x.shape[-1] == d else diff.unflatten(-1, (h, d))
        moved = diff.movedim(axis, 0).reshape(h, -1).amax(1) > 1e-6
    return int(moved.sum())


def _before_rope(inp, shifted_inp):
    """The norm's input did not move with the positions (None: undetermined)."""
    import torch

    if shifted_inp is None:
        return None
    # the same GEMMs on the same tokens: equal up to rounding before RoPE; RoPE moves them by
    # O(1) of the rows' scale
    scale = inp.abs().max().item() + 1e-30
    return bool(torch.allclose(inp, shifted_inp, rtol=0, atol=1e-4 * scale))
