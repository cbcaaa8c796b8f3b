"""The whole atlas: every causal-LM family of the installed transformers probed
(:func:`build_atlas`), the committed file (:func:`load_atlas`, :func:`save_atlas`), a family's
card (:func:`atlas_spec`), the table's rows (:func:`atlas_rows`), and two comparisons: of two
atlases (:func:`compare_atlases`) and of the atlas with the hand rules of
:mod:`normtools.cards.derive` (:func:`rule_disagreements`)."""

import json
from importlib import resources

from normtools.cards.atlas.probed import ProbeError
from normtools.cards.atlas.run import probe_family
from normtools.cards.types import ModelNormSpec, SpecError

PROBE_VERSION = 4
ATLAS_FILE = resources.files("normtools.cards").joinpath("data", "atlas.json")


def causal_lm_model_types() -> tuple:
    """Every causal-LM model type of the installed transformers, sorted."""
    return tuple(sorted(_causal_lm_classes()))


def _causal_lm_classes() -> dict:
    """{model type: its causal-LM class name} of the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def build_atlas(model_types=None, progress=None) -> dict:
    """Probe ``model_types`` (default: every causal-LM type); ``progress(model_type, result)``
    is called after each. Returns ``{"transformers": version, "probe_version", "families":
    {type: row}, "not_probed": {type: reason}}``; every requested type is in exactly one of them."""
    import logging
    import warnings

    import torch
    import transformers

    torch.set_num_threads(1)
    families, not_probed = {}, {}
    classes = _causal_lm_classes()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    for model_type in model_types or causal_lm_model_types():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                families[model_type] = probe_family(model_type)
                families[model_type]["probe"]["class"] = classes.get(model_type)
                result = "probed"
            except ProbeError as e:
                not_probed[model_type] = str(e)
                result = str(e)
        if progress is not None:
            progress(model_type, result)
    return {"transformers": transformers.__version__, "probe_version": PROBE_VERSION,
            "families": families, "not_probed": not_probed}


ATLAS_KEYS = {"families": dict, "not_probed": dict, "probe_version": int, "transformers": str}
FAMILY_KEYS = {"spec": dict, "probe": dict}
PROBE_KEYS = {"qk_norms": dict, "tiny_config": dict}


def load_atlas(path=None) -> dict:
    """The committed atlas (``normtools/cards/data/atlas.json``) or the one at ``path``;
    :class:`SpecError` naming the file and the fault for a file that is not JSON, lacks a key of
    ``ATLAS_KEYS``, has a family without the keys of ``FAMILY_KEYS`` and ``PROBE_KEYS`` or whose
    spec is not a norm card, or a not-probed reason that is not a string."""
    name = ATLAS_FILE if path is None else path
    text = ATLAS_FILE.read_text() if path is None else open(path, encoding="utf-8").read()
    try:
        atlas = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise SpecError(f"{name}: not valid JSON ({str(e)[:200]})") from None
    if not (isinstance(atlas, dict) and _has_keys(atlas, ATLAS_KEYS)):
        raise SpecError(f"{name}: not a norm atlas (a JSON object with {_key_list(ATLAS_KEYS)})")
    for model_type, row in atlas["families"].items():
        if not (isinstance(row, dict) and _has_keys(row, FAMILY_KEYS) and _has_keys(row["probe"], PROBE_KEYS)):
            raise SpecError(f"{name}: family {model_type!r} is not an atlas row (an object with "
                            f"{_key_list(FAMILY_KEYS)}; probe with {_key_list(PROBE_KEYS)})")
        try:
            ModelNormSpec.from_dict(row["spec"])
        except KeyError as e:
            raise SpecError(f"{name}: family {model_type!r}: spec lacks {e}") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise SpecError(f"{name}: family {model_type!r}: spec is not a norm card ({e})") from None
    for model_type, reason in atlas["not_probed"].items():
        if not isinstance(reason, str):
            raise SpecError(f"{name}: not_probed {model_type!r}: the reason must be a string, got {str(reason)[:40]}")
    return atlas


def _has_keys(d: dict, keys: dict) -> bool:
    """Whether ``d`` has each key of ``keys`` with a value of its type."""
    return all(isinstance(d.get(k), t) for k, t in keys.items())


def _key_list(keys: dict) -> str:
    """``keys`` in words: "spec (dict), probe (dict)"."""
    return ", ".join(f"{k} ({t.__name__})" for k, t in keys.items())


def save_atlas(atlas: dict, path=None) -> None:
    """Write ``atlas`` as the committed file (or to ``path``): indented JSON, keys sorted."""
    text = json.dumps(atlas, indent=1, sort_keys=True) + "\n"
    if path is None:
        with resources.as_file(ATLAS_FILE) as p:
            p.write_text(text)
    else:
        open(path, "w").write(text)


def atlas_spec(model_type: str, atlas=None) -> ModelNormSpec:
    """The norm card of an atlas family; :class:`SpecError` for a type the atlas lacks (with the
    reason when it was not probed)."""
    atlas = atlas or load_atlas()
    if model_type in atlas["families"]:
        return ModelNormSpec.from_dict(atlas["families"][model_type]["spec"])
    if model_type in atlas["not_probed"]:
        raise SpecError(f"{model_type}: in the atlas but not probed ({atlas['not_probed'][model_type]})")
    raise SpecError(f"{model_type}: not a causal-LM model type of transformers {atlas['transformers']}")


def atlas_rows(atlas=None) -> list:
    """One flat dict per probed family (the columns of the atlas table)."""
    atlas = atlas or load_atlas()
    rows = []
    for model_type, row in sorted(atlas["families"].items()):
        s = ModelNormSpec.from_dict(row["spec"])
        b = s.block_norm
        pattern = dict(s.layer_pattern)
        rows.append({
            "model_type": model_type, "norm": b.kind, "eps": b.eps,
            "scale": "none" if not b.affine else "1+w" if b.offset == 1 else "w",
            "bias": b.bias, "casting": b.casting, "placement": s.placement,
            "final_norm": s.final_norm is not None, "qk_norm": s.qk_norm.scope,
            "qk_layers": "none" if s.qk_norm.scope == "none" else "some" if "qk_norm" in pattern else "all",
            "qk_before_rope": s.qk_norm.before_rope, "qk_weight": _qk_weight(row["probe"]),
            "other_norms": len(s.other_norms),
            "attn_bias": _any_bias(s.biases.q, s.biases.k, s.biases.v), "sinks": s.attention_sinks,
            "proj_biases": _bias_text(s.biases),
            "layer_pattern": "; ".join(f"{field}: {text}" for field, text in s.layer_pattern),
        })
    return rows


def _any_bias(*flags):
    """True if any flag is, else None if any is unknown, else False."""
    return True if any(flags) else None if None in flags else False


def _bias_text(biases) -> str:
    """The projections with a bias, "?" after each whose bias is unknown: "q k v", "q? k? v? o?"."""
    import dataclasses

    flags = dataclasses.asdict(biases)
    return " ".join(k if v else f"{k}?" for k, v in flags.items() if v or v is None) or "none"


def _qk_weight(probe: dict) -> str:
    """The q-norm weight's shape in words: "head_dim", "H*head_dim", "H x head_dim" or "none"."""
    q = next((v for v in probe["qk_norms"].values() if v["which"] in ("q", "qk")), None)
    if q is None:
        return "none"
    shape, heads = q["weight_shape"], q["heads"]
    d = probe["tiny_config"].get("head_dim") or probe["tiny_config"]["hidden_size"] // heads
    if shape is None:
        return "no weight"
    return {(d,): "head_dim", (heads * d,): "H*head_dim", (heads, d): "H x head_dim"}.get(tuple(shape), str(shape))


def compare_atlases(old: dict, new: dict) -> dict:
    """What changed from ``old`` to ``new``: ``{"added", "removed", "now_probed", "no_longer_probed":
    [types], "changed": {type: {field: [old, new]}}}`` (card fields only, not timings)."""
    from normtools.cards.types import diff

    old_f, new_f = old["families"], new["families"]
    old_all = set(old_f) | set(old["not_probed"])
    new_all = set(new_f) | set(new["not_probed"])
    changed = {}
    for t in sorted(set(old_f) & set(new_f)):
        d = diff(ModelNormSpec.from_dict(old_f[t]["spec"]), ModelNormSpec.from_dict(new_f[t]["spec"]))
        if d:
            changed[t] = {k: list(v) for k, v in d.items()}
    return {"added": sorted(new_all - old_all), "removed": sorted(old_all - new_all),
            "now_probed": sorted((set(new_f) - set(old_f)) & old_all),
            "no_longer_probed": sorted((set(old_f) - set(new_f)) & new_all), "changed": changed}


_RULE_FIELDS = ("block_norm", "placement", "layer_norms", "final_norm", "qk_norm", "biases", "other_norms",
                "attention_sinks", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")


def rule_disagreements(atlas=None) -> dict:
    """``{model_type: {field: [rule value, probed value]}}`` for every family that has a hand-written
    rule in :mod:`normtools.cards.derive` (its config class's defaults) and a probed atlas row."""
    from normtools.cards.derive import FAMILY_RULES, from_hf_config
    from normtools.cards.types import diff

    atlas = atlas or load_atlas()
    out = {}
    for model_type in sorted(set(FAMILY_RULES) & set(atlas["families"])):
        d = diff(from_hf_config({"model_type": model_type}), atlas_spec(model_type, atlas))
        d = {k: list(v) for k, v in d.items() if k.split(".")[0] in _RULE_FIELDS}
        if d:
            out[model_type] = d
    return out


_CHECKPOINT_FIELDS = ("block_norm", "placement", "final_norm", "qk_norm", "biases", "attention_sinks", "hidden_size",
                      "num_layers", "num_heads", "num_kv_heads", "head_dim")


def checkpoint_differences(atlas=None) -> dict:
    """``{bundled config: {field: [default card's value, checkpoint card's value]}}`` for every
    published config of :func:`normtools.cards.sources.bundled_configs` whose family the atlas
    probed: the atlas card is of the config class's defaults, the checkpoint's is read from its
    config.json (:func:`normtools.cards.sources.load`); fields both cards determine."""
    from normtools.cards.sources import bundled_configs, load
    from normtools.cards.types import diff

    atlas = atlas or load_atlas()
    out = {}
    for name in bundled_configs():
        checkpoint, _ = load(name)
        if checkpoint.model_type in atlas["families"]:
            d = diff(atlas_spec(checkpoint.model_type, atlas), checkpoint)
            out[name] = {k: list(v) for k, v in d.items() if k.split(".")[0] in _CHECKPOINT_FIELDS}
    return out
