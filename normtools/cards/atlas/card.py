"""The atlas row of a probed model (:func:`classify`): its layers read one by one
(:mod:`~normtools.cards.atlas.layers`), then the card, one function per field: block norm and
placement, QK-Norm (:mod:`~normtools.cards.atlas.qk`), final norm (the norm whose output is the
LM head's input), other norms (latent norms, embedding norms, norms inside mixers), projection
biases and attention sinks (from the parameters), and the default config's sizes."""

import collections
import itertools
import re

from normtools.cards.atlas.layers import ATTN_NAME, read_layer
from normtools.cards.atlas.pattern import layer_pattern
from normtools.cards.atlas.norm import GATE, norm_spec, probe_norm, takes_a_gate, with_gate
from normtools.cards.atlas.probed import ProbedModel, ProbeError, config_attr, inside, one_line, same
from normtools.cards.atlas.qk import qk_norms
from normtools.cards.types import ModelNormSpec, OtherNorm, ProjectionBiases, QKNormSpec


def classify(pm: ProbedModel) -> dict:
    """``{"spec": ModelNormSpec dict, "probe": what was measured}`` of a probed model;
    :class:`ProbeError` ("classify") when a layer never ran or layer 0 has no block norm."""
    readings = [read_layer(pm, i) for i in range(len(pm.layers))]
    placements = [r.placement for r in readings]
    qk, qk_layer, qk_unprobed = qk_norms(pm, readings)
    block = {n[len(f"{pm.prefix}.0") + 1:]: pm.norm_probe(n) for n in readings[0].block}
    final = _final_norm_name(pm)
    others = _probe_others(pm, _other_norm_names(pm, readings, qk_layer, qk_unprobed, final))
    final_probe = pm.norm_probe(final) if final else None
    if not block:
        raise ProbeError("classify", "no block norm found in the first layer")
    block_notes = _block_notes(block)
    qk_spec, qk_notes = _qk_norm(qk)
    biases, bias_notes = _biases(pm)
    pattern = layer_pattern(pm, readings)
    if qk and any(field == "qk_norm" for field, _ in pattern):
        qk_notes.append("QK-Norm on some layers only (see the layer pattern)")
    other, other_notes = _other_norms(pm, others, final)
    spec = ModelNormSpec(
        model_type=pm.text.model_type if pm.text.model_type else pm.model.config.model_type,
        block_norm=norm_spec(next(iter(block.values()))),
        placement=placements[0] if len(set(placements)) == 1 else "mixed", layer_norms=tuple(block),
        final_norm=norm_spec(final_probe) if final_probe else None, qk_norm=qk_spec, biases=biases,
        other_norms=other, attention_sinks=any("sink" in n for n, _ in pm.layers[0].named_parameters()),
        **_default_sizes(pm.defaults), layer_pattern=pattern,
        notes=tuple(block_notes + qk_notes + bias_notes + other_notes) + (
            "probed on a tiny random instance of the config class's defaults; shapes are the defaults",),
    )
    return {"spec": spec.to_dict(), "probe": {
        "qk_norms": qk, "layer_placements": placements, "sublayer_placements": [r.sublayers for r in readings],
        "block_norms": block, "final_norm": final_probe, "final_norm_name": final, "other_norms": others,
        "has_rope": pm.has_rope, "qk_layer": qk_layer, "tiny_config": _tiny_summary(pm.text)}}


def _block_notes(block: dict) -> list:
    """Notes on layer 0's block norms (``{local name: probe}``): when they differ, or have no scale."""
    notes = []
    specs = {n: norm_spec(p) for n, p in block.items()}
    if len(set(specs.values())) > 1:
        notes.append("block norms differ: " + "; ".join(f"{n}: {s.kind}, eps {s.eps:g}, offset {s.offset:g}, "
                                                        f"{s.casting}" for n, s in specs.items()))
    if any(not p["affine"] for p in block.values()):
        notes.append("block norms have no learned scale (y = x̂)")
    return notes


def _qk_norm(qk: dict) -> tuple:
    """(QKNormSpec of the q norm, or of the one q/k norm; notes) from the q/k norm probes."""
    if not qk:
        return QKNormSpec(), []
    q = next((v for v in qk.values() if v["which"] == "q"), next(iter(qk.values())))
    scopes = {v["which"]: v["scope"] for v in qk.values()}
    notes = [f"q and k norms differ in scope: {scopes}"] if len(set(scopes.values())) > 1 else []
    return QKNormSpec(q["scope"], norm_spec(q["norm"]), q["before_rope"]), notes


def _outside_norms(pm) -> list:
    """The norms outside the decoder layers that ran."""
    return [n for n in pm.norms if not inside(n, pm.prefix) and n in pm.calls]


def _final_norm_name(pm):
    """The norm outside the layers whose (last) output reaches the LM head's input, up to one
    positive scalar and a slice of its rows (:func:`_reaches`); None without one."""
    head_in = pm.calls.get("<lm_head>", [(None, None)])[0][0]
    return next((n for n in _outside_norms(pm) if _reaches(pm.calls[n][-1][1], head_in)), None)


def _reaches(norm_out, head_in) -> bool:
    """Every row of ``head_in`` is ``c`` times a row of ``norm_out``, one ``c > 0`` for all: the
    norm's output reached the head through an elementwise scalar (MiniCPM3's ``hidden /
    logits_scaling``) and a slice along the token axis (prompt rows dropped), compared by row
    direction: cosine 1 and one ratio of lengths, to float32 rounding."""
    import torch

    if norm_out is None or head_in is None or norm_out.shape[-1] != head_in.shape[-1]:
        return False
    if same(norm_out, head_in):
        return True
    a, b = norm_out.reshape(-1, norm_out.shape[-1]).double(), head_in.reshape(-1, head_in.shape[-1]).double()
    a_len, b_len = a.norm(dim=-1), b.norm(dim=-1)
    if a.shape[0] < b.shape[0] or (a_len == 0).any() or (b_len == 0).any():
        return False
    cosine = (b / b_len[:, None]) @ (a / a_len[:, None]).T      # (head rows, norm rows)
    best = cosine.max(dim=-1)
    ratio = b_len / a_len[best.indices]
    return bool((best.values > 1 - 1e-6).all() and (ratio.max() - ratio.min()) <= 1e-5 * ratio.max())


def _other_norm_names(pm, readings, qk_layer, qk_unprobed, final) -> list:
    """Every norm neither block, QK nor final: each layer's other norms (a name within the layer
    kept from its first layer), the q/k norms that could not be probed, the norms outside the
    layers."""
    names, seen_locals = [], set()
    for i, reading in enumerate(readings):
        layer = f"{pm.prefix}.{i}"
        for n in reading.other:
            if n[len(layer) + 1:] not in seen_locals:
                seen_locals.add(n[len(layer) + 1:])
                names.append(n)
        if i == qk_layer:
            names += qk_unprobed
    # a final norm that also ran earlier (nanochat's one ``norm`` on the embeddings and after
    # the layers) holds both roles: it is an other norm too
    return names + [n for n in _outside_norms(pm) if n != final or len(pm.calls[n]) > 1]


def _probe_others(pm, names) -> dict:
    """{name: norm probe} of the other norms; a gated norm (its forward takes a gate) is probed
    through :func:`with_gate`; a norm that still cannot run on one tensor is kept with the reason."""
    import torch

    probes = {}
    for n in names:
        module = pm.norms[n]
        try:
            if takes_a_gate(module):
                gated = with_gate(module)
                gated(pm.seen(n)[0].float().clone() if pm.seen(n)[0] is not None else torch.randn(2, 8))
                probes[n] = {**probe_norm(gated, tuple(pm.seen(n)[0].shape)),
                             "gate": "before the norm" if gated.gate_before else "after the norm"}
            else:
                probes[n] = pm.norm_probe(n)
        except Exception as e:  # noqa: BLE001 - a norm with other inputs is reported with the reason
            probes[n] = {"class": type(module).__name__, "kind": "not probed", "error": one_line(e)}
    return probes


def _other_norms(pm, probes: dict, final) -> tuple:
    """(OtherNorm tuple, notes) of the other norms' probes: per-layer norms by their name within
    the layer, the others by their name in the base model (the final norm, when it also ran
    before, "(also the final norm)"); a norm that is not an RMSNorm or a LayerNorm is a note, and
    so are a gated norm's gate and a size that no config key gives."""
    other, notes = [], []
    base = getattr(pm.model, "base_model_prefix", "") + "."
    for n, p in probes.items():
        per_layer = n.startswith(pm.prefix + ".")
        local = n[len(pm.prefix) + 1:].split(".", 1)[1] if per_layer else n.removeprefix(base)
        shown = local if per_layer else n
        if p.get("kind") not in ("rms", "layer"):
            notes.append(f"{shown}: {p['class']} not probed ({p.get('error', p.get('kind'))})")
            continue
        if "gate" in p:
            notes.append(f"{shown}: {p['class']} is gated (times silu(gate), {p['gate']}); probed with gate "
                         f"{GATE:g}, whose SiLU is exactly {GATE:g} in float32, divided out")
        seen_in = pm.seen(n)[0]
        dim = p["weight_shape"][-1] if p["weight_shape"] else seen_in.shape[-1] if seen_in is not None else 0
        size = _default_size(int(dim), pm.text, pm.defaults)
        if size is None:
            notes.append(f"{shown}: width {dim} in the tiny model, which no default-config key gives: "
                         "its default size is unknown (0 on the card)")
        other.append(OtherNorm(local + (" (also the final norm)" if n == final else ""), per_layer,
                               size or 0, norm_spec(p)))
    return tuple(other), notes


_BIAS_NAMES = (  # (regex on a Linear's local name in the attention module, any case; projections it holds)
    (r".*(qkv|c_attn|query_key_value|in_proj|wqkv).*", "qkv"),
    (r"(kv_a_proj_with_mqa|kv_b_proj|kv_proj|wkv.*)", "kv"),
    (r"(q_proj|query|query_proj|q|wq|q_a_proj|q_b_proj|q_lin)", "q"),
    (r"(k_proj|key|key_proj|k|wk|k_lin)", "k"),
    (r"(v_proj|value|value_proj|v|wv|v_lin)", "v"),
    (r"(o_proj|dense|out_proj|c_proj|wo|o|out_lin|output|proj|out)", "o"),
)


def _biases(pm) -> tuple:
    """(ProjectionBiases from the parameters of every layer with an attention or another token
    mixer, a bias found in any of them; notes). A hybrid's layers differ: Qwen3-Next's first
    layers are linear attention, its fourth full attention. A biased linear of a token mixer that
    no name rule maps is classified by what it reads and writes (:func:`_traced_fields`): never
    reported as no bias."""
    found = dict(q=False, k=False, v=False, o=False, mlp=False, router=False, experts=False)
    unknown, unnamed, internal, uncalled = set(), [], [], []
    for i, layer in enumerate(pm.layers):
        mixers = [n for n, m in layer.named_children() if ATTN_NAME.match(n) and m not in pm.norms.values()]
        if not mixers:
            continue
        for name, module in layer.named_modules():
            if module in pm.norms.values():
                continue
            for pname, p in module.named_parameters(recurse=False):
                if "bias" not in pname:
                    continue
                fields = _bias_fields(name, module, pname, p, name.split(".")[0] in mixers)
                if fields is None:
                    fields, role = _traced_fields(pm, f"{pm.prefix}.{i}", name)
                    listed = internal if role == "internal" else uncalled if role == "uncalled" else unnamed
                    if name not in listed:
                        listed.append(name)
                    unknown |= set(fields) if role in ("unknown", "uncalled") else set()
                    fields = fields if role == "o" else ()
                for field in fields:
                    found[field] = True
    found.update({f: None for f in unknown if not found[f]})
    head = pm.model.get_output_embeddings()
    lm_head = head is not None and getattr(head, "bias", None) is not None
    notes = ["token-mixer linears with a bias that no name rule maps, classified by what they read and "
             "write (the mixer's input: q/k/v, unknown which; its output: o): " + ", ".join(unnamed)] if unnamed else []
    notes += ["biased linears inside a token mixer, on neither its input nor its output (not q/k/v/o): "
              + ", ".join(internal)] if internal else []
    notes += ["biased linears of a token mixer never called as modules (their weights used directly), "
              "so q/k/v/o biases are unknown: " + ", ".join(uncalled)] if uncalled else []
    return ProjectionBiases(**found, lm_head=lm_head), notes


def _traced_fields(pm, layer, name) -> tuple:
    """(fields, role) of an unmapped biased linear ``name`` of the layer ``layer``, from the calls
    the probe recorded: writing the mixer's output, ``(("o",), "o")``; reading the mixer's input,
    ``(("q", "k", "v"), "unknown")``; neither, ``((), "internal")``; never called, unknown."""
    mixer, own = pm.calls.get(f"{layer}.{name.split('.')[0]}"), pm.calls.get(f"{layer}.{name}")
    if not mixer or not own:  # never called as a module: its weight is used directly
        return ("q", "k", "v", "o"), "uncalled"
    if same(own[-1][1], mixer[0][1]):
        return ("o",), "o"
    if same(own[0][0], mixer[0][0]):
        return ("q", "k", "v"), "unknown"
    return (), "internal"


def _bias_fields(name, module, pname, p, in_mixer):
    """The ProjectionBiases fields that the bias ``pname`` of module ``name`` sets; None for a
    linear of a token mixer that no name rule maps."""
    import torch

    local = name.rsplit(".", 1)[-1]
    # a bias of one value per expert shifts the routing scores (AFMoE's expert_bias; DeepSeek-V3
    # keeps its e_score_correction_bias as a buffer, not a parameter, so it is not counted): the
    # router's, not the experts'
    per_expert_score = p.dim() == 1 and "expert" in pname
    if ("expert" in name or "expert" in pname) and not per_expert_score:
        return ("experts",)
    if re.fullmatch(r"(gate|router|wg|gating)", local) or "router" in pname or per_expert_score:
        return ("router",)
    if in_mixer and isinstance(module, torch.nn.Conv1d) and module.groups > 1:
        return ()  # a grouped (depthwise) convolution of a mixer (Mamba's conv1d): not a projection
    if in_mixer and (isinstance(module, (torch.nn.Linear, torch.nn.Conv1d)) or type(module).__name__ == "Conv1D"):
        # "qkv" sets q, k and v; "kv" k and v
        return next((tuple(which) for pattern, which in _BIAS_NAMES if re.fullmatch(pattern, local, re.I)), None)
    if not in_mixer and isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D":
        return ("mlp",)
    return ()


def _default_sizes(defaults) -> dict:
    """The card's sizes: those of the family's default config."""
    num_heads = config_attr(defaults, "num_attention_heads", 0) or 0
    hidden = config_attr(defaults, "hidden_size", None)
    return dict(hidden_size=int(config_attr(defaults, "hidden_size", 0) or 0),
                num_layers=int(config_attr(defaults, "num_hidden_layers", 0) or 0), num_heads=int(num_heads),
                num_kv_heads=int(config_attr(defaults, "num_key_value_heads", None) or num_heads),
                head_dim=int(config_attr(defaults, "head_dim", None)
                             or (defaults.hidden_size // num_heads if num_heads and hidden else 0)))


_SIZE_KEY = re.compile(r".*(hidden|head|dim|size|expand|rank).*")
_NOT_SIZE_KEY = re.compile(r".*(token|layers|vocab|position|chunk|window|bucket).*")


def _default_size(tiny: int, text, defaults):
    """The default-config value of the config key whose tiny value is ``tiny`` (the probe's sizes
    are distinct: hidden 64, latent ranks 40 and 24, ...); else H·D when ``tiny`` is the tiny
    model's (MiniMax-01's linear-attention output norm); else of a product of two size keys
    (a linear-attention output norm over ``num_v_heads * head_v_dim``), the value most such
    products give; None when no key or product gives it, or two values tie."""
    def size_keys(pattern_ok):  # int keys that are not counts of tokens, layers, positions
        return {k: v for k, v in text.to_dict().items() if isinstance(v, int) and not isinstance(v, bool)
                and isinstance(config_attr(defaults, k), int) and not isinstance(config_attr(defaults, k), bool)
                and not _NOT_SIZE_KEY.match(k) and (not pattern_ok or _SIZE_KEY.match(k))}

    keys = [k for k, v in size_keys(False).items() if v == tiny]
    if keys:
        return int(config_attr(defaults, "hidden_size" if "hidden_size" in keys else keys[0]))
    tiny_shape, default_shape = _default_sizes(text), _default_sizes(defaults)
    if tiny == tiny_shape["num_heads"] * tiny_shape["head_dim"]:  # H·D: a norm over all heads' outputs
        return default_shape["num_heads"] * default_shape["head_dim"] or None
    tiny_sizes = size_keys(True)
    pairs = [(a, b) for a, b in itertools.combinations(sorted(tiny_sizes), 2)
             if tiny_sizes[a] > 1 and tiny_sizes[b] > 1 and tiny_sizes[a] * tiny_sizes[b] == tiny]
    products = collections.Counter(config_attr(defaults, a) * config_attr(defaults, b) for a, b in pairs)
    ranked = products.most_common(2)
    return int(ranked[0][0]) if ranked and (len(ranked) == 1 or ranked[0][1] > ranked[1][1]) else None


def _tiny_summary(text) -> dict:
    """The tiny model's sizes (the probe's record)."""
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
    return {k: config_attr(text, k, None) for k in keys if isinstance(config_attr(text, k, None), int)}
