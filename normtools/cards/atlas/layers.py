"""One decoder layer, read from its recorded calls (:func:`read_layer`): which of its norms are
block norms, q/k norms or other norms, and where each block norm sits around each sublayer.

A norm whose output is a sublayer's input is an input norm, a norm whose input is a sublayer's
output (and whose output is added to the residual stream) is an output norm, a norm whose
output is the residual stream after a sublayer's output was added is a post norm. pre = input
norms only, sandwich = input and output norms, post_sublayer = output norms only, post = post
norms; two sublayers that read the layer's input are parallel."""

import re
from dataclasses import dataclass

from normtools.cards.atlas.probed import ProbedModel, ProbeError, close, inside, same

# a token mixer's name: attention, or what a hybrid has instead (Mamba, linear attention, conv)
ATTN_NAME = re.compile(r".*(attn|attention|self_attention|mixer|linear_attn|mamba|token_mixer|conv).*", re.I)
# QK-Norm modules: one for q and one for k, or one module for both (Llama 4's ``qk_norm``)
_QK_NAME = re.compile(r"^(q|k|qk|query|key)_?(norm|layernorm|layer_norm|ln|rmsnorm)$", re.I)


@dataclass
class LayerReading:
    """One layer's norms (full module names) by role, and its placements."""

    block: list         # on the residual stream's width, not inside a token mixer
    qk: list            # q/k norms held by the attention module itself
    other: list         # every other norm of the layer
    sublayers: dict     # a sublayer's local name: "pre", "sandwich", "post_sublayer", "post" or "none"
    placement: str      # the layer's: its sublayers' one label, "parallel", "none" or "mixed"


def read_layer(pm: ProbedModel, i: int) -> LayerReading:
    """The norms and placements of layer ``i`` (see the module docstring)."""
    name = f"{pm.prefix}.{i}"
    if name not in pm.calls:
        raise ProbeError("classify", f"layer {i} never ran")
    subs = {n: pm.seen(n) for n in pm.calls
            if n.startswith(name + ".") and n.count(".") == name.count(".") + 1 and n not in pm.norms}
    block, qk, other = _norm_roles(pm, name, subs)
    labels, parallel = _sublayer_placements(pm, name, subs, block)
    kinds = set(labels.values()) - {"none"}
    placement = "parallel" if parallel else kinds.pop() if len(kinds) == 1 else "none" if not kinds else "mixed"
    return LayerReading(block, qk, other, labels, placement)


def _norm_roles(pm, name, subs) -> tuple:
    """(block, qk, other) norm names of the layer ``name`` whose sublayers' calls are ``subs``."""
    block, qk, other = [], [], []
    for n in (n for n in pm.norms if inside(n, name) and n in pm.calls):
        inp = pm.seen(n)[0]
        dim = inp.shape[-1] if inp is not None else None
        # QK-Norm: a q/k norm held by the attention module itself (not by a helper inside it,
        # such as DeepSeek-V3.2's sparse-attention indexer)
        in_attn = any(n.rpartition(".")[0] == s and ATTN_NAME.match(s.rsplit(".", 1)[-1]) for s in subs)
        if in_attn and _QK_NAME.match(n.rsplit(".", 1)[-1]):
            qk.append(n)
        elif dim == pm.hidden and not any(inside(n, s) and ATTN_NAME.match(s.rsplit(".", 1)[-1])
                                          and not _is_post_in(pm, n, subs[s]) for s in subs):
            block.append(n)
        else:
            other.append(n)
    return block, qk, other


def _is_post_in(pm, norm_name, sub_seen) -> bool:
    """A block norm nested in a sublayer that reads the sublayer's input (pre-LN BERT variants) or
    writes its output (BERT's post-LN)."""
    return same(pm.seen(norm_name)[1], sub_seen[1]) or same(pm.seen(norm_name)[0], sub_seen[0])


def _sublayer_placements(pm, name, subs, block) -> tuple:
    """({sublayer's local name: label}, parallel) of the sublayers with parameters that do not
    read another sublayer's output (an attention's rotary helper, an MLP's activation)."""
    layer_in, layer_out = pm.seen(name)
    primary = [s for s in subs if sum(p.numel() for p in pm.model.get_submodule(s).parameters()) > 0
               and not any(same(subs[s][0], subs[t][1]) for t in subs if t != s)]
    residual = _Residual(pm, layer_in, layer_out, block, subs)
    labels, reads = {}, {}
    for s in primary:
        labels[s[len(name) + 1:]], reads[s] = _sublayer_placement(pm, s, subs[s], block, residual)
    parallel = sum(same(reads[s], layer_in) for s in primary) >= 2
    return labels, parallel


class _Residual:
    """The tensors of one layer that the residual stream is made of: the layer's input and output,
    the block norms' and sublayers' inputs, the sublayers' outputs."""

    def __init__(self, pm, layer_in, layer_out, block, subs):
        self.layer_out = layer_out
        self.inputs = [layer_in] + [pm.seen(n)[0] for n in block] + [subs[t][0] for t in subs]
        self.later = [layer_out] + self.inputs[1:]
        self.outs = [subs[t][1] for t in subs]

    def holds(self, v) -> bool:
        """v is the residual stream: the layer's output, or v + a sublayer output is read later."""
        return same(v, self.layer_out) or any(close(w, v, o) for w in self.later for o in self.outs)

    def receives(self, v) -> bool:
        """v is added to the residual stream: stream + v is read later."""
        return any(close(w, u, v) for w in self.later for u in self.inputs)


def _sublayer_placement(pm, s, sub_seen, block, residual) -> tuple:
    """(label, the tensor the sublayer reads off the residual stream: its input norm's input,
    else its own input) of sublayer ``s``."""
    s_in, s_out = sub_seen
    outside = [n for n in block if not inside(n, s)]
    in_norm = next((n for n in outside if same(pm.seen(n)[1], s_in) and not residual.holds(pm.seen(n)[1])),
                   None) or next((n for n in block if inside(n, s) and same(pm.seen(n)[0], s_in)), None)
    out_norm = next((n for n in outside if same(pm.seen(n)[0], s_out) and residual.receives(pm.seen(n)[1])), None)
    post_norm = next((n for n in block if inside(n, s) and same(pm.seen(n)[1], s_out)), None) or next(
        (n for n in outside if residual.holds(pm.seen(n)[1]) and any(close(pm.seen(n)[0], u, s_out)
                                                                     for u in residual.inputs)), None)
    label = ("post" if post_norm else "sandwich" if in_norm and out_norm
             else "post_sublayer" if out_norm else "pre" if in_norm else "none")
    return label, pm.seen(in_norm)[0] if in_norm else s_in
