"""Where cards come from: checkpoint directories (config.json and safetensors headers, checked
against each other), config.json files and the bundled published configs."""

import dataclasses
import json
import os
import re
from importlib import resources
from pathlib import Path

from normtools.cards.derive import PRE_NORMS, SANDWICH_NORMS, from_hf_config
from normtools.cards.safetensors_header import open_regular_file, read_header
from normtools.cards.types import (CheckpointMismatchError, ModelNormSpec, ProjectionBiases, QKNormSpec,
                                   SpecError, diff)


_LAYER_NAME = re.compile(r"^(?:.*\.)?(?:layers|layer)\.(\d+)\.(.+)$")
_QK_NORM_MODULES = {"q_norm": "q", "k_norm": "k", "q_layernorm": "q", "k_layernorm": "k"}
_BIAS_PATTERNS = {
    "q": r"(self_attn\.(q_proj|q_a_proj)|attention\.self\.query)\.bias",
    "k": r"(self_attn\.(k_proj|kv_a_proj_with_mqa)|attention\.self\.key)\.bias",
    "v": r"(self_attn\.(v_proj|kv_a_proj_with_mqa)|attention\.self\.value)\.bias",
    "o": r"(self_attn\.(o_proj|dense)|attention\.output\.dense)\.bias",
    "mlp": r"(mlp\.(shared_experts\.)?(gate_proj|up_proj|down_proj|fc1|fc2)|intermediate\.dense|output\.dense)\.bias",
    "router": r"mlp\.(router|gate)\.bias",
    "experts": r"mlp\.experts\.\w*bias",
}
_FINAL_NORM = re.compile(r"^(?:.*\.)?(norm|final_layernorm)\.(weight|bias)$")


MAX_JSON_BYTES = 64 * 1024 * 1024  # config.json and index files of published models are < 10 MB
# A layer index has at most this many digits: more cannot be a model, and would make the reader
# list (and allocate) that many missing layers.
MAX_LAYER_DIGITS = 6


def read_config_json(path) -> dict:
    """The JSON object in the regular file ``path`` (at most ``MAX_JSON_BYTES``); :class:`SpecError`
    if it is not one (including nesting too deep to parse and integers of over 4,300 digits)."""
    with open_regular_file(path) as f:
        if os.fstat(f.fileno()).st_size > MAX_JSON_BYTES:
            raise SpecError(f"{path}: larger than {MAX_JSON_BYTES} bytes, not a config")
        raw = f.read()
    try:
        config = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # JSON and UTF-8 errors are ValueErrors
        raise SpecError(f"{path}: not valid JSON ({str(e)[:200] or type(e).__name__})") from None
    if not isinstance(config, dict):
        raise SpecError(f"{path}: not a JSON object")
    return config


def _read_checkpoint_tensors(path) -> dict:
    """``{name: TensorInfo}`` merged over every ``*.safetensors`` file in the directory ``path``."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise SpecError(f"{path}: no *.safetensors files")
    if len(files) > 100_000:
        raise SpecError(f"{path}: {len(files)} *.safetensors files, not a checkpoint")
    tensors = {}
    for file in files:
        tensors.update(read_header(file))
    index = Path(path) / "model.safetensors.index.json"
    if index.is_file():  # a sharded checkpoint: every tensor its index names must be there
        weight_map = read_config_json(index).get("weight_map", {})
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise SpecError(f"{index}: weight_map must map tensor names to file names, "
                            f"got {str(weight_map)[:80]}")
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise SpecError(f"{path}: {len(missing)} tensors named in {index.name} are in no file "
                            f"(first: {missing[0]!r} in {weight_map[missing[0]]!r})")
    return tensors


def from_checkpoint(path) -> ModelNormSpec:
    """The norm spec of the checkpoint directory ``path`` (config.json + one or more *.safetensors).

    Reads config.json and the safetensors headers (names, shapes, dtypes; never tensor data, never
    pickle), infers the layout from tensor names and shapes, and raises
    :class:`CheckpointMismatchError` listing every disagreement with config.json.
    """
    path = Path(path)
    if not path.is_dir():
        raise SpecError(f"{path}: not a directory")
    if not (path / "config.json").is_file():
        raise SpecError(f"{path}: no config.json")
    config = read_config_json(path / "config.json")
    expected = from_hf_config(config)
    tensors = _read_checkpoint_tensors(path)
    if config["model_type"] == "gemma3":  # multimodal: the norms of the text model only
        tensors = {name: info for name, info in tensors.items() if "language_model." in name}
    observed, problems = _observe(expected, tensors)
    disagreements = problems + [
        f"{key}: config says {a!r}, tensors say {b!r}" for key, (a, b) in diff(expected, observed).items()
    ]
    if disagreements:
        raise CheckpointMismatchError(path, disagreements)
    return observed


def _observe(spec: ModelNormSpec, tensors: dict):
    """(spec with every field that the tensors determine replaced by what they show, problems)."""
    layers, top = _split_layers(tensors)
    if not layers:
        return spec, [f"no per-layer tensors (names like 'layers.0.*'); found {len(tensors)} tensors"]
    num_layers = max(layers) + 1
    problems = _missing_layers(sorted(layers))
    layer0 = layers[min(layers)]
    block, block_problems = _observe_block_norms(spec, layers)
    qk_norm, qk_problems = _observe_qk(spec, layer0)
    final_norm, final_problems = _observe_final_norm(spec, top)
    other_norms, other_problems = _observe_other_norms(spec, layer0, top)
    other_problems = other_problems + _projection_problems(spec, layer0)
    biases = ProjectionBiases(**{
        key: any(re.fullmatch(pattern, s) for s in layer0) for key, pattern in _BIAS_PATTERNS.items()
    }, lm_head="lm_head.bias" in top)
    observed = dataclasses.replace(
        spec,
        block_norm=dataclasses.replace(spec.block_norm, bias=any(block.values())),
        placement=_placement(set(block)),
        layer_norms=tuple(n for n in spec.layer_norms if n in block) + tuple(sorted(set(block) - set(spec.layer_norms))),
        final_norm=final_norm,
        qk_norm=qk_norm,
        biases=biases,
        other_norms=other_norms,
        attention_sinks=any(s.endswith("self_attn.sinks") for s in layer0),
        num_layers=num_layers,
    )
    return observed, problems + block_problems + qk_problems + final_problems + other_problems


def _missing_layers(indices: list) -> list:
    """One problem per run of layer indices absent below the largest of ``indices`` (sorted)."""
    problems, expected = [], 0
    for index in indices:
        if index > expected:
            first, last = expected, index - 1
            problems.append(f"layer {first} has no tensors" if first == last else
                            f"layers {first} to {last} have no tensors")
        expected = index + 1
    return problems


def _split_layers(tensors: dict):
    """({layer index: {name inside the layer: info}}, {other name: info}); :class:`SpecError` for
    a layer index of more than ``MAX_LAYER_DIGITS`` digits."""
    layers, top = {}, {}
    for name, info in tensors.items():
        m = _LAYER_NAME.match(name)
        if m and len(m.group(1)) > MAX_LAYER_DIGITS:
            raise SpecError(f"tensor {name[:100]!r}: a layer index of {len(m.group(1))} digits "
                            f"(at most {MAX_LAYER_DIGITS})")
        if m:
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = info
        else:
            top[name] = info
    return layers, top


def _observe_block_norms(spec, layers):
    """({block-norm module name: has bias} from the first layer, problems in any layer)."""
    layer0 = layers[min(layers)]
    block, problems = {}, []
    for suffix, info in layer0.items():
        module, _, kind = suffix.rpartition(".")
        last = module.rpartition(".")[2]
        if "norm" not in last.lower() or last in _QK_NORM_MODULES or _is_other_norm(spec, module):
            continue
        block[module] = block.get(module, False) or kind == "bias"
        if kind == "weight" and info.shape != (spec.hidden_size,):
            problems.append(f"{module}.weight has shape {info.shape}, config hidden_size is {spec.hidden_size}")
    for index, layer in sorted(layers.items()):
        missing = sorted(set(block) - {s.rpartition(".")[0] for s in layer})
        if missing:
            problems.append(f"layer {index} lacks {', '.join(missing)}")
    return block, problems


# Attention projections whose (out, in) shape the config fixes: q has num_heads · head_dim rows,
# k and v num_kv_heads · head_dim; checked for unpacked float tensors (a 4-bit tensor is packed).
_PROJECTIONS = {"self_attn.q_proj.weight": "num_heads", "self_attn.k_proj.weight": "num_kv_heads",
                "self_attn.v_proj.weight": "num_kv_heads"}
_UNPACKED_FLOATS = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


def _projection_problems(spec, layer0) -> list:
    """Where the first layer's q/k/v projection shapes disagree with the config's head counts."""
    problems = []
    for name, heads in _PROJECTIONS.items():
        info = layer0.get(name)
        if info is None or info.dtype not in _UNPACKED_FLOATS:
            continue
        expected = (getattr(spec, heads) * spec.head_dim, spec.hidden_size)
        if info.shape != expected:
            problems.append(f"{name} has shape {info.shape}, config {heads} {getattr(spec, heads)} × "
                            f"head_dim {spec.head_dim} and hidden_size {spec.hidden_size} give {expected}")
    return problems


def _observe_final_norm(spec, top):
    """(the final norm the tensors show, or None; problems)."""
    final = {m.group(2): info for name, info in top.items() if (m := _FINAL_NORM.match(name))}
    if "weight" not in final:
        return None, []
    problems = []
    if final["weight"].shape != (spec.hidden_size,):
        problems.append(f"final norm weight has shape {final['weight'].shape}, config hidden_size is {spec.hidden_size}")
    return dataclasses.replace(spec.final_norm or spec.block_norm, bias="bias" in final), problems


def _observe_other_norms(spec, layer0, top):
    """(the spec's other norms with the size and bias the tensors show, problems)."""
    found, problems = [], []
    for other in spec.other_norms:
        where = layer0 if other.per_layer else top
        weight = where.get(f"{other.name}.weight")
        if weight is None:
            problems.append(f"{other.name}.weight is missing")
            continue
        if len(weight.shape) != 1:
            problems.append(f"{other.name}.weight has shape {weight.shape}, expected ({other.dim},)")
            continue
        found.append(dataclasses.replace(other, dim=weight.shape[0],
                                         norm=dataclasses.replace(other.norm, bias=f"{other.name}.bias" in where)))
    return tuple(found), problems


def _is_other_norm(spec, module) -> bool:
    return any(o.per_layer and o.name == module for o in spec.other_norms)


def _placement(names: set) -> str:
    """Block-norm placement from the per-layer norm names (HF naming conventions)."""
    if {"attention.output.LayerNorm", "output.LayerNorm"} <= names:
        return "post"
    if set(SANDWICH_NORMS) <= names:
        return "sandwich"
    if "post_feedforward_layernorm" in names and "input_layernorm" not in names:
        return "post_sublayer"
    if names == {"input_layernorm"}:
        return "parallel"
    if names == set(PRE_NORMS):
        return "pre"
    return "unrecognised: " + ", ".join(sorted(names))


def _observe_qk(spec, layer0):
    """(QKNormSpec seen in layer 0's tensors, shape problems)."""
    weights = {}
    has_bias = False
    for suffix, info in layer0.items():
        module, _, kind = suffix.rpartition(".")
        which = _QK_NORM_MODULES.get(module.rpartition(".")[2])
        if which and kind == "weight":
            weights[which] = info.shape
        has_bias = has_bias or bool(which and kind == "bias")
    if not weights:
        return QKNormSpec(), []
    d, heads = spec.head_dim, {"q": spec.num_heads, "k": spec.num_kv_heads}
    scopes, problems = {}, []
    for which, shape in sorted(weights.items()):
        fits = [scope for scope, expected in (("per_head", (d,)), ("per_layer", (heads[which] * d,)),
                                              ("per_head_weights", (heads[which], d))) if shape == expected]
        if not fits:
            problems.append(f"{which}_norm weight shape {shape} fits none of (head_dim,)={(d,)}, "
                            f"(H*head_dim,)={(heads[which] * d,)}, (H, head_dim)={(heads[which], d)}")
        # with one head, (head_dim,) is both per_head and per_layer: the config decides
        scopes[which] = spec.qk_norm.scope if spec.qk_norm.scope in fits else (fits[0] if fits else "unrecognised")
    if len(set(scopes.values())) != 1:
        problems.append(f"q_norm and k_norm scopes differ: {scopes}")
    base = spec.qk_norm.norm or spec.block_norm
    return QKNormSpec(scopes.get("q", scopes.get("k")), dataclasses.replace(base, bias=has_bias),
                      spec.qk_norm.before_rope), problems


_CONFIG_DIR = resources.files("normtools.cards").joinpath("configs")
def bundled_configs() -> tuple:
    """Names of the published configs shipped in normtools/configs (e.g. "gpt-oss-20b")."""
    return tuple(sorted(p.name[:-5] for p in _CONFIG_DIR.iterdir() if p.name.endswith(".json")))


def load_bundled_config(name: str) -> dict:
    """The config.json dict of a bundled published config (see normtools/configs/SOURCES.md)."""
    if name not in bundled_configs():
        raise SpecError(f"no bundled config {name!r}; bundled: {', '.join(bundled_configs())}")
    return json.loads(_CONFIG_DIR.joinpath(f"{name}.json").read_text())


def load(source) -> tuple:
    """(spec, config dict) from a checkpoint directory, a config.json path or a bundled config name."""
    path = Path(source)
    if path.is_dir():
        spec = from_checkpoint(path)
        return spec, read_config_json(path / "config.json")
    if path.is_file():
        config = read_config_json(path)
        return from_hf_config(config), config
    if str(source) in bundled_configs():
        config = load_bundled_config(str(source))
        return from_hf_config(config), config
    raise SpecError(f"{source}: not a checkpoint directory, a config.json file or a bundled config "
                    f"({', '.join(bundled_configs())})")
