"""Model norm specs: write down every normalization choice of a model before comparing checkpoints.

A :class:`ModelNormSpec` ("norm card") records, for one model, what a reader needs to reproduce the
norms of its forward pass:

* the block norm: kind (RMSNorm ``y = s * x * rsqrt(mean(x^2) + eps)`` or LayerNorm
  ``y = s * (x - mean) * rsqrt(var + eps) + b``), eps, bias, scale parameterization
  ``s = offset + w`` (offset 0 for ``w``, 1 for ``1 + w``) and casting (see below);
* where the block norms sit (placement) and what each layer's norm modules are called;
* the final norm, QK-Norm (scope, its own norm, before or after RoPE), other norms (latent norms,
  embedding norms), projection biases and attention sinks;
* the shapes needed to check a checkpoint against its config, and the config values that the
  source could not confirm.

Casting, with x̂ the normalized row in float32 (``x.float() * r``, r = rsqrt(mean(x.float()**2) + eps),
for RMSNorm; ``(x.float() - mean) * rstd`` for LayerNorm; statistics always float32):

* ``"llama"``: ``(offset + w) * x̂.to(x.dtype)``  (HF Llama, Qwen3, MiniMax-M2, DeepSeek-V3)
* ``"gemma"``: ``(x̂ * (offset + w.float())).to(x.dtype)``  (HF Gemma 2/3, OLMo 2/3, gpt-oss,
  Cohere's LayerNorm)
* ``"torch"``: ``torch.nn.LayerNorm`` in the input dtype (HF BERT, Phi)

Placement: ``"pre"`` ``x + f(norm(x))``; ``"post"`` ``norm(x + f(x))`` (BERT);
``"sandwich"`` ``x + norm2(f(norm1(x)))`` (Gemma 2/3); ``"post_sublayer"`` ``x + norm(f(x))``
(OLMo 2/3); ``"parallel"`` ``x + attn(norm(x)) + mlp(norm(x))`` (Cohere, Phi).

QK-Norm scope: ``"per_head"`` one weight of size head_dim shared by all heads; ``"per_head_weights"``
one weight per head, shape (H, head_dim); ``"per_layer"`` one norm over all H*head_dim features.
"""

import contextlib
import dataclasses
import json
import re
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from normtools.cards.safetensors_header import SafetensorsHeaderError, read_header

SUPPORTED_MODEL_TYPES = (
    "bert", "cohere", "deepseek_v3", "gemma2", "gemma3", "gemma3_text", "gpt_oss", "llama",
    "minimax_m2", "olmo2", "olmo3", "phi", "qwen3",
)
PLACEMENTS = ("pre", "post", "sandwich", "post_sublayer", "parallel")
QK_SCOPES = ("none", "per_head", "per_head_weights", "per_layer")


class SpecError(ValueError):
    """A config or checkpoint whose norm spec cannot be determined."""


class CheckpointMismatchError(SpecError):
    """A checkpoint whose tensors disagree with its config.json; ``.disagreements`` lists them all."""

    def __init__(self, path, disagreements):
        self.disagreements = tuple(disagreements)
        super().__init__(f"{path}: checkpoint disagrees with config.json: " + "; ".join(self.disagreements))


# --------------------------------------------------------------------------------------------
# the spec
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NormSpec:
    """One norm: ``kind`` "rms" | "layer", ``eps``, ``bias``, scale ``offset + w``, ``casting``."""

    kind: str
    eps: float
    bias: bool
    offset: float
    casting: str


@dataclass(frozen=True)
class QKNormSpec:
    """QK-Norm: ``scope`` (see module doc), its ``norm`` (None when scope is "none"), ``before_rope``."""

    scope: str = "none"
    norm: NormSpec | None = None
    before_rope: bool | None = None


@dataclass(frozen=True)
class ProjectionBiases:
    q: bool
    k: bool
    v: bool
    o: bool
    mlp: bool
    router: bool = False
    experts: bool = False
    lm_head: bool = False


@dataclass(frozen=True)
class OtherNorm:
    """A norm outside the block/final/QK pattern, e.g. DeepSeek-V3's ``kv_a_layernorm``."""

    name: str  # module name, relative to a layer ("self_attn.kv_a_layernorm") or the model
    per_layer: bool
    dim: int
    norm: NormSpec


@dataclass(frozen=True)
class ModelNormSpec:
    model_type: str
    block_norm: NormSpec
    placement: str
    layer_norms: tuple  # names of each layer's block-norm modules, relative to the layer
    final_norm: NormSpec | None
    qk_norm: QKNormSpec
    biases: ProjectionBiases
    other_norms: tuple = ()
    attention_sinks: bool = False
    hidden_size: int = 0
    num_layers: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    notes: tuple = ()  # other forward-pass facts that touch the norms' inputs or outputs
    unconfirmed: tuple = ()  # config keys whose published values could not be confirmed

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelNormSpec":
        """Inverse of :meth:`to_dict` (also accepts the lists that JSON makes of tuples)."""
        d = dict(d)
        d["block_norm"] = NormSpec(**d["block_norm"])
        d["final_norm"] = NormSpec(**d["final_norm"]) if d["final_norm"] else None
        qk = dict(d["qk_norm"])
        qk["norm"] = NormSpec(**qk["norm"]) if qk["norm"] else None
        d["qk_norm"] = QKNormSpec(**qk)
        d["biases"] = ProjectionBiases(**d["biases"])
        d["other_norms"] = tuple(
            OtherNorm(**{**o, "norm": NormSpec(**o["norm"])}) for o in d["other_norms"]
        )
        for key in ("layer_norms", "notes", "unconfirmed"):
            d[key] = tuple(d[key])
        return cls(**d)


def diff(a: ModelNormSpec, b: ModelNormSpec) -> dict:
    """Every field that differs between two specs: ``{"dotted.path": (value_in_a, value_in_b)}``."""
    return _diff_values(a.to_dict(), b.to_dict(), "")


def _diff_values(a, b, path) -> dict:
    if isinstance(a, dict) and isinstance(b, dict):
        out = {}
        for key in a.keys() | b.keys():
            out.update(_diff_values(a.get(key), b.get(key), f"{path}.{key}" if path else key))
        return dict(sorted(out.items()))
    return {} if a == b else {path: (a, b)}


# --------------------------------------------------------------------------------------------
# from a transformers config
# --------------------------------------------------------------------------------------------


def _transformers_config(config):
    """(transformers config object of the text model, unconfirmed keys) from a config or dict."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig, PretrainedConfig

    unconfirmed = ()
    if isinstance(config, dict):
        model_type = config.get("model_type")
        _check_supported(model_type)
        unconfirmed = tuple(config.get("_unconfirmed", ()))
        values = {k: v for k, v in config.items() if not k.startswith("_") and k != "model_type"}
        try:
            config = AutoConfig.for_model(model_type, **values)
        except (StrictDataclassError, TypeError, ValueError, ArithmeticError) as e:
            raise SpecError(f"{model_type} config rejected by transformers: {' '.join(str(e).split())}") from None
    elif not isinstance(config, PretrainedConfig):
        raise TypeError(f"expected a transformers config or a config.json dict, got {type(config).__name__}")
    _check_supported(config.model_type)
    if config.model_type == "gemma3":  # multimodal wrapper: the norms live in the text model
        config = config.text_config
    return config, unconfirmed


def build_model(config, *, device=None):
    """The transformers model of ``config`` (a config object or a config.json dict), with random
    weights: ``AutoModel`` for BERT (an encoder), ``AutoModelForCausalLM`` otherwise (the text
    model of a multimodal Gemma 3). ``device="meta"`` builds the full-size shapes without memory.
    This is the model whose ``numel`` :func:`count_parameters` must equal."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    config, _ = _transformers_config(config)
    auto = AutoModel if config.model_type == "bert" else AutoModelForCausalLM
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return auto.from_config(config)


def _check_supported(model_type):
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise SpecError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def _head_dim(c) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def from_hf_config(config) -> ModelNormSpec:
    """The norm spec of the model that transformers builds from ``config`` (object or dict).

    An unknown ``model_type`` raises :class:`SpecError` naming the supported ones.
    """
    c, unconfirmed = _transformers_config(config)
    family = _FAMILIES[c.model_type]
    fields = family(c)
    return ModelNormSpec(
        model_type=c.model_type,
        hidden_size=c.hidden_size,
        num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        head_dim=_head_dim(c),
        unconfirmed=unconfirmed,
        **fields,
    )


def _rms(eps, casting, offset=0.0) -> NormSpec:
    return NormSpec("rms", float(eps), False, float(offset), casting)


_PRE = ("input_layernorm", "post_attention_layernorm")
_SANDWICH = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
_POST_SUBLAYER = ("post_attention_layernorm", "post_feedforward_layernorm")


def _attn_biases(c, mlp=False, **extra) -> ProjectionBiases:
    b = bool(c.attention_bias)
    return ProjectionBiases(q=b, k=b, v=b, o=b, mlp=mlp, **extra)


def _llama(c):
    norm = _rms(c.rms_norm_eps, "llama")
    return dict(block_norm=norm, placement="pre", layer_norms=_PRE, final_norm=norm,
                qk_norm=QKNormSpec(), biases=_attn_biases(c, mlp=bool(c.mlp_bias)))


def _qwen3(c):
    norm = _rms(c.rms_norm_eps, "llama")
    return dict(block_norm=norm, placement="pre", layer_norms=_PRE, final_norm=norm,
                qk_norm=QKNormSpec("per_head", norm, True), biases=_attn_biases(c))


def _olmo2(c):
    norm = _rms(c.rms_norm_eps, "gemma")
    return dict(block_norm=norm, placement="post_sublayer", layer_norms=_POST_SUBLAYER, final_norm=norm,
                qk_norm=QKNormSpec("per_layer", norm, True), biases=_attn_biases(c))


def _gemma_notes(c):
    notes = [f"embeddings scaled by sqrt(hidden_size) = {c.hidden_size ** 0.5:.4g} (rounded to the model dtype)",
             f"attention scale query_pre_attn_scalar**-0.5 with query_pre_attn_scalar = {c.query_pre_attn_scalar}"]
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(c, key, None) is not None:
            notes.append(f"{key} = {getattr(c, key)}")
    return tuple(notes)


def _gemma2(c):
    norm = _rms(c.rms_norm_eps, "gemma", offset=1.0)
    return dict(block_norm=norm, placement="sandwich", layer_norms=_SANDWICH, final_norm=norm,
                qk_norm=QKNormSpec(), biases=_attn_biases(c), notes=_gemma_notes(c))


def _gemma3(c):
    norm = _rms(c.rms_norm_eps, "gemma", offset=1.0)
    return dict(block_norm=norm, placement="sandwich", layer_norms=_SANDWICH, final_norm=norm,
                qk_norm=QKNormSpec("per_head", norm, True), biases=_attn_biases(c), notes=_gemma_notes(c))


def _gpt_oss(c):
    norm = _rms(c.rms_norm_eps, "gemma")
    return dict(block_norm=norm, placement="pre", layer_norms=_PRE, final_norm=norm, qk_norm=QKNormSpec(),
                biases=_attn_biases(c, router=True, experts=True), attention_sinks=True,
                notes=("one learned attention-sink logit per head joins each softmax",))


def _minimax_m2(c):
    # transformers' MiniMaxM2Attention always builds per-layer q_norm/k_norm; a config asking for
    # anything else describes a model transformers does not build, so refuse rather than guess.
    if getattr(c, "use_qk_norm", True) is not True or getattr(c, "qk_norm_type", "per_layer") != "per_layer":
        raise SpecError(
            "minimax_m2: transformers builds per_layer QK-Norm only; config has "
            f"use_qk_norm={getattr(c, 'use_qk_norm', None)!r}, qk_norm_type={getattr(c, 'qk_norm_type', None)!r}"
        )
    norm = _rms(c.rms_norm_eps, "llama")
    return dict(block_norm=norm, placement="pre", layer_norms=_PRE, final_norm=norm,
                qk_norm=QKNormSpec("per_layer", norm, True),
                biases=ProjectionBiases(q=False, k=False, v=False, o=False, mlp=False),
                notes=("router e_score_correction_bias is a buffer (not a parameter): it shifts expert "
                       "choice, not the routing weights",))


def _cohere(c):
    norm = NormSpec("layer", float(c.layer_norm_eps), False, 0.0, "gemma")
    qk = QKNormSpec("per_head_weights", norm, True) if c.use_qk_norm else QKNormSpec()
    return dict(block_norm=norm, placement="parallel", layer_norms=("input_layernorm",), final_norm=norm,
                qk_norm=qk, biases=_attn_biases(c), notes=(f"logits multiplied by logit_scale = {c.logit_scale}",))


def _phi(c):
    norm = NormSpec("layer", float(c.layer_norm_eps), True, 0.0, "torch")
    qk = QKNormSpec("per_head", norm, True) if c.qk_layernorm else QKNormSpec()
    factor = c.rope_parameters.get("partial_rotary_factor", 1.0)
    return dict(block_norm=norm, placement="parallel", layer_norms=("input_layernorm",), final_norm=norm,
                qk_norm=qk, biases=ProjectionBiases(q=True, k=True, v=True, o=True, mlp=True, lm_head=True),
                notes=(f"partial rotary: RoPE on {factor:g} of each head's features",))


def _deepseek_v3(c):
    norm = _rms(c.rms_norm_eps, "llama")
    latent = _rms(1e-6, "llama")  # DeepseekV3RMSNorm's default eps: the config's rms_norm_eps is not passed
    others = []
    if c.q_lora_rank is not None:
        others.append(OtherNorm("self_attn.q_a_layernorm", True, c.q_lora_rank, latent))
    others.append(OtherNorm("self_attn.kv_a_layernorm", True, c.kv_lora_rank, latent))
    b = bool(c.attention_bias)
    biases = ProjectionBiases(q=b and c.q_lora_rank is not None, k=b, v=b, o=b, mlp=False)
    return dict(block_norm=norm, placement="pre", layer_norms=_PRE, final_norm=norm, qk_norm=QKNormSpec(),
                biases=biases, other_norms=tuple(others),
                notes=("MLA: q and kv are norms of low-rank latents (other norms), not QK-Norm on heads",
                       "router e_score_correction_bias is a buffer (not a parameter)"))


def _bert(c):
    norm = NormSpec("layer", float(c.layer_norm_eps), True, 0.0, "torch")
    return dict(block_norm=norm, placement="post", layer_norms=("attention.output.LayerNorm", "output.LayerNorm"),
                final_norm=None, qk_norm=QKNormSpec(),
                biases=ProjectionBiases(q=True, k=True, v=True, o=True, mlp=True),
                other_norms=(OtherNorm("embeddings.LayerNorm", False, c.hidden_size, norm),))


_FAMILIES = {
    "llama": _llama, "qwen3": _qwen3, "olmo2": _olmo2, "olmo3": _olmo2, "gemma2": _gemma2,
    "gemma3_text": _gemma3, "gpt_oss": _gpt_oss, "minimax_m2": _minimax_m2, "cohere": _cohere,
    "phi": _phi, "deepseek_v3": _deepseek_v3, "bert": _bert,
}


# --------------------------------------------------------------------------------------------
# from a checkpoint directory (safetensors headers only)
# --------------------------------------------------------------------------------------------

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


def read_config_json(path) -> dict:
    """The JSON object in the file ``path``; :class:`SpecError` if it is not one."""
    try:
        config = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise SpecError(f"{path}: not a JSON object")
    return config


def read_checkpoint_tensors(path) -> dict:
    """``{name: TensorInfo}`` merged over every ``*.safetensors`` file in the directory ``path``."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise SpecError(f"{path}: no *.safetensors files")
    tensors = {}
    for file in files:
        tensors.update(read_header(file))
    index = Path(path) / "model.safetensors.index.json"
    if index.is_file():  # a sharded checkpoint: every tensor its index names must be there
        weight_map = read_config_json(index).get("weight_map", {})
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
    tensors = read_checkpoint_tensors(path)
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
    problems = [f"layer {i} has no tensors" for i in range(num_layers) if i not in layers]
    layer0 = layers[min(layers)]
    block, block_problems = _observe_block_norms(spec, layers)
    qk_norm, qk_problems = _observe_qk(spec, layer0)
    final_norm, final_problems = _observe_final_norm(spec, top)
    other_norms, other_problems = _observe_other_norms(spec, layer0, top)
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


def _split_layers(tensors: dict):
    """({layer index: {name inside the layer: info}}, {other name: info})."""
    layers, top = {}, {}
    for name, info in tensors.items():
        m = _LAYER_NAME.match(name)
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
    if set(_SANDWICH) <= names:
        return "sandwich"
    if "post_feedforward_layernorm" in names and "input_layernorm" not in names:
        return "post_sublayer"
    if names == {"input_layernorm"}:
        return "parallel"
    if names == set(_PRE):
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


# --------------------------------------------------------------------------------------------
# exact parameter counts
# --------------------------------------------------------------------------------------------

COUNT_KEYS = (
    "embeddings", "attention_weights", "attention_biases", "norms", "mlp_weights", "mlp_biases",
    "router_weights", "router_biases", "attention_sinks", "lm_head", "lm_head_bias",
    "pooler_weights", "pooler_biases",
)
# the weight matrices: what the bias-free "textbook" formula counts
TEXTBOOK_KEYS = ("embeddings", "attention_weights", "mlp_weights", "router_weights", "lm_head", "pooler_weights")


def count_parameters(config) -> dict:
    """Exact parameter count of the model transformers builds from ``config``, broken down.

    The model is ``AutoModelForCausalLM.from_config(config)`` for decoders (for a multimodal Gemma 3
    config: its text model, ``Gemma3ForCausalLM``) and ``BertModel`` (with pooler) for BERT; tied
    embeddings are counted once. ``total`` equals ``sum(p.numel() for p in model.parameters())``.
    Every key of :data:`COUNT_KEYS` is present (0 where a model has none), plus ``total`` and
    ``textbook_bias_free``: the weight matrices only (embeddings, attention and MLP/expert/router
    matrices, lm_head), i.e. the usual formula that drops biases, norms and attention sinks.
    """
    c, _ = _transformers_config(config)
    spec = from_hf_config(c)
    counts = dict.fromkeys(COUNT_KEYS, 0)
    H, L, V = c.hidden_size, c.num_hidden_layers, c.vocab_size
    counts["embeddings"] = V * H
    if not c.tie_word_embeddings:
        counts["lm_head"] = V * H
    counts["lm_head_bias"] = V if spec.biases.lm_head else 0
    counts["norms"] = _norm_parameters(spec)
    counts["attention_sinks"] = L * spec.num_heads if spec.attention_sinks else 0
    _ATTENTION_COUNTERS.get(c.model_type, _mha_counts)(c, spec, counts)
    _MLP_COUNTERS.get(c.model_type, _gated_mlp_counts)(c, spec, counts)
    counts["total"] = sum(counts[k] for k in COUNT_KEYS)
    counts["textbook_bias_free"] = sum(counts[k] for k in TEXTBOOK_KEYS)
    return counts


def _norm_parameters(spec: ModelNormSpec) -> int:
    def size(norm, numel):
        return numel * (2 if norm.bias else 1)

    n = spec.num_layers * len(spec.layer_norms) * size(spec.block_norm, spec.hidden_size)
    if spec.final_norm is not None:
        n += size(spec.final_norm, spec.hidden_size)
    qk, d = spec.qk_norm, spec.head_dim
    if qk.scope == "per_head":
        n += spec.num_layers * 2 * size(qk.norm, d)
    elif qk.scope in ("per_head_weights", "per_layer"):
        n += spec.num_layers * size(qk.norm, (spec.num_heads + spec.num_kv_heads) * d)
    for other in spec.other_norms:
        n += (spec.num_layers if other.per_layer else 1) * size(other.norm, other.dim)
    return n


def _mha_counts(c, spec, counts):
    """q, k, v, o projections: (H -> nh*d), 2 x (H -> nkv*d), (nh*d -> H)."""
    H, L = c.hidden_size, c.num_hidden_layers
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    counts["attention_weights"] = L * (2 * H * q + 2 * H * kv)
    b = spec.biases
    counts["attention_biases"] = L * (q * b.q + kv * b.k + kv * b.v + H * b.o)


def _mla_counts(c, spec, counts):
    """DeepSeek MLA: q via a q_lora_rank latent (or one matrix), kv via a kv_lora_rank latent."""
    H, L, nh = c.hidden_size, c.num_hidden_layers, c.num_attention_heads
    qk_head = c.qk_nope_head_dim + c.qk_rope_head_dim
    if c.q_lora_rank is None:
        q = H * nh * qk_head
    else:
        q = H * c.q_lora_rank + c.q_lora_rank * nh * qk_head
    kv = H * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank * nh * (c.qk_nope_head_dim + c.v_head_dim)
    o = nh * c.v_head_dim * H
    counts["attention_weights"] = L * (q + kv + o)
    b = spec.biases
    q_bias = c.q_lora_rank if b.q else 0
    kv_bias = (c.kv_lora_rank + c.qk_rope_head_dim) if b.k else 0
    counts["attention_biases"] = L * (q_bias + kv_bias + (H if b.o else 0))


def _bert_attention_counts(c, spec, counts):
    _mha_counts(c, spec, counts)
    counts["embeddings"] += (c.max_position_embeddings + c.type_vocab_size) * c.hidden_size
    counts["pooler_weights"] = c.hidden_size * c.hidden_size
    counts["pooler_biases"] = c.hidden_size


def _gated_mlp_counts(c, spec, counts):
    """SwiGLU/GeGLU MLP: gate and up (H -> I), down (I -> H)."""
    H, I, L = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    counts["mlp_weights"] = L * 3 * H * I
    counts["mlp_biases"] = L * (2 * I + H) if spec.biases.mlp else 0


def _two_layer_mlp_counts(c, spec, counts):
    """fc1 (H -> I), activation, fc2 (I -> H), both with bias (Phi, BERT)."""
    H, I, L = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    counts["mlp_weights"] = L * 2 * H * I
    counts["mlp_biases"] = L * (I + H)


def _gpt_oss_mlp_counts(c, spec, counts):
    """E experts of gate_up (H -> 2I) and down (I -> H), each with bias; router (H -> E) with bias."""
    H, I, L, E = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_local_experts
    counts["mlp_weights"] = L * E * 3 * H * I
    counts["mlp_biases"] = L * E * (2 * I + H)
    counts["router_weights"] = L * E * H
    counts["router_biases"] = L * E


def _minimax_mlp_counts(c, spec, counts):
    """E bias-free experts of gate_up (H -> 2I) and down (I -> H); bias-free router (H -> E)."""
    H, I, L, E = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_local_experts
    counts["mlp_weights"] = L * E * 3 * H * I
    counts["router_weights"] = L * E * H


def _deepseek_mlp_counts(c, spec, counts):
    """first_k_dense_replace dense layers, then MoE layers: routed + shared experts and a router."""
    H, L, E = c.hidden_size, c.num_hidden_layers, c.n_routed_experts
    dense = min(c.first_k_dense_replace, L)
    moe_experts = E * 3 * H * c.moe_intermediate_size + 3 * H * c.moe_intermediate_size * c.n_shared_experts
    counts["mlp_weights"] = dense * 3 * H * c.intermediate_size + (L - dense) * moe_experts
    counts["router_weights"] = (L - dense) * E * H


_ATTENTION_COUNTERS = {"deepseek_v3": _mla_counts, "bert": _bert_attention_counts}
_MLP_COUNTERS = {
    "phi": _two_layer_mlp_counts, "bert": _two_layer_mlp_counts, "gpt_oss": _gpt_oss_mlp_counts,
    "minimax_m2": _minimax_mlp_counts, "deepseek_v3": _deepseek_mlp_counts,
}


# --------------------------------------------------------------------------------------------
# tiny configs (random-weight models for demos and tests; nothing is downloaded)
# --------------------------------------------------------------------------------------------

_TINY_COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2)
_TINY_MOE = dict(num_local_experts=4, num_experts_per_tok=2)
_TINY_EXTRA = {
    "gemma2": dict(query_pre_attn_scalar=8, sliding_window=16),
    "gemma3_text": dict(query_pre_attn_scalar=8, sliding_window=16),
    "gpt_oss": dict(_TINY_MOE, sliding_window=16, max_position_embeddings=131072),
    "minimax_m2": dict(_TINY_MOE),
    "cohere": dict(use_qk_norm=True),
    "phi": dict(qk_layernorm=True),
    "deepseek_v3": dict(num_key_value_heads=4, head_dim=None, rms_norm_eps=1e-5, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
                        qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                        n_group=1, topk_group=1, first_k_dense_replace=1, moe_intermediate_size=16),
    "bert": dict(num_key_value_heads=None, head_dim=None, type_vocab_size=2),
}


def tiny_config(model_type: str, **overrides) -> dict:
    """A config.json dict of a tiny model (hidden 32, 2 layers, 4 heads) of a supported family."""
    _check_supported(model_type)
    if model_type == "gemma3":
        model_type = "gemma3_text"
    values = {**_TINY_COMMON, **_TINY_EXTRA.get(model_type, {}), **overrides}
    return {"model_type": model_type, **{k: v for k, v in values.items() if v is not None}}


# --------------------------------------------------------------------------------------------
# the card (Markdown) and the command line
# --------------------------------------------------------------------------------------------

_CONFIG_DIR = resources.files("normtools.cards").joinpath("configs")
# x̂: the normalized row in float32 (x.float() * r for RMSNorm, (x.float() - mean) * rstd for LayerNorm)
CASTING_FORMULAS = {
    "llama": "(offset + w) * x̂.to(x.dtype)",
    "gemma": "(x̂ * (offset + w.float())).to(x.dtype)",
    "torch": "torch.nn.LayerNorm in the input dtype",
}
# config keys behind each card row, to flag rows whose source value is unconfirmed
_EPS_KEYS = ("rms_norm_eps", "layer_norm_eps")
_SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
_COUNT_SOURCE_KEYS = _SHAPE_KEYS + ("intermediate_size", "vocab_size", "tie_word_embeddings", "num_local_experts",
                                    "attention_bias", "mlp_bias")
_ROW_KEYS = {
    "eps": _EPS_KEYS,
    "Final norm": _EPS_KEYS,
    "QK-Norm": _EPS_KEYS + ("use_qk_norm", "qk_norm_type", "qk_layernorm"),
    "Projection biases": ("attention_bias", "mlp_bias"),
    "Shape": _SHAPE_KEYS,
    "Parameters": _COUNT_SOURCE_KEYS,
    "Textbook (bias-free) count": _COUNT_SOURCE_KEYS,
}


def _describe_norm(norm: NormSpec | None) -> str:
    if norm is None:
        return "none"
    kind = "RMSNorm" if norm.kind == "rms" else "LayerNorm"
    scale = "1 + w" if norm.offset == 1 else ("w" if norm.offset == 0 else f"{norm.offset:g} + w")
    bias = "with bias" if norm.bias else "no bias"
    return f"{kind}, eps={norm.eps:g}, scale {scale}, {bias}, {norm.casting} casting"


def card_rows(spec: ModelNormSpec, counts: dict | None = None) -> list:
    """(field, value) rows of the norm card; values whose config source is unconfirmed say so."""
    b = spec.block_norm
    qk = spec.qk_norm
    if qk.scope == "none":
        qk_text = "none"
    else:
        rope = "before RoPE" if qk.before_rope else "after RoPE"
        qk_text = f"{qk.scope}, {rope}: {_describe_norm(qk.norm)}"
    biases = [k for k, v in dataclasses.asdict(spec.biases).items() if v]
    rows = [
        ("Model type", spec.model_type),
        ("Block norm", "RMSNorm" if b.kind == "rms" else "LayerNorm"),
        ("eps", f"{b.eps:g}"),
        ("Bias", "yes" if b.bias else "no"),
        ("Scale", "1 + w (offset 1)" if b.offset == 1 else f"w (offset {b.offset:g})"),
        ("Casting", f"{b.casting}: {CASTING_FORMULAS[b.casting]}"),
        ("Placement", spec.placement),
        ("Per-layer norms", ", ".join(spec.layer_norms)),
        ("Final norm", _describe_norm(spec.final_norm)),
        ("QK-Norm", qk_text),
        ("Other norms", "; ".join(f"{o.name} ({o.dim}): {_describe_norm(o.norm)}" for o in spec.other_norms) or "none"),
        ("Projection biases", ", ".join(biases) or "none"),
        ("Attention sinks", "yes" if spec.attention_sinks else "no"),
        ("Shape", f"hidden {spec.hidden_size}, {spec.num_layers} layers, {spec.num_heads} heads "
                  f"({spec.num_kv_heads} kv), head_dim {spec.head_dim}"),
    ]
    rows += [("Note", note) for note in spec.notes]
    if counts is not None:
        rows += [("Parameters", f"{counts['total']:,}"),
                 ("Textbook (bias-free) count", f"{counts['textbook_bias_free']:,} "
                  f"(misses {counts['total'] - counts['textbook_bias_free']:,})")]
    if spec.unconfirmed:
        rows = [(name, value + (" (unconfirmed)" if set(_ROW_KEYS.get(name, ())) & set(spec.unconfirmed) else ""))
                for name, value in rows]
        rows.append(("Unconfirmed config values", ", ".join(spec.unconfirmed)))
    return rows


def _markdown_table(header, rows) -> str:
    def cell(value):
        return str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def card(spec: ModelNormSpec, counts: dict | None = None) -> str:
    """The norm card as a Markdown table (with parameter counts when ``counts`` is given)."""
    return _markdown_table(("Field", "Value"), card_rows(spec, counts))


def diff_table(a: ModelNormSpec, b: ModelNormSpec, names=("A", "B")) -> str:
    """:func:`diff` as a Markdown table."""
    return _markdown_table(("Field", *names), [(k, json.dumps(x), json.dumps(y)) for k, (x, y) in diff(a, b).items()])


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


def _run_card(args) -> int:
    spec, config = load(args.source)
    if args.json:
        print(json.dumps({"spec": spec.to_dict(), "parameters": count_parameters(config)}, indent=2))
    else:
        print(card(spec, count_parameters(config)))
    return 0


def _run_diff(args) -> int:
    a, _ = load(args.a)
    b, _ = load(args.b)
    if args.json:
        print(json.dumps({k: list(v) for k, v in diff(a, b).items()}, indent=2))
    else:
        print(diff_table(a, b, (args.a, args.b)) if diff(a, b) else "no differences")
    return 0


def _reporting_errors(run):
    """Run a command; bad input prints one line on stderr and exits with code 2."""
    def wrapper(args) -> int:
        try:
            return run(args)
        except (SpecError, SafetensorsHeaderError, OSError) as e:
            print(f"normtools {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
            return 2
    return wrapper


def add_cli(subparsers) -> None:
    """Register ``normtools card`` and ``normtools diff``."""
    card_parser = subparsers.add_parser(
        "card", help="print a model's norm card",
        description="Print the norm card of a checkpoint directory, a config.json or a bundled config "
                    f"({', '.join(bundled_configs())}).")
    card_parser.add_argument("source", metavar="PATH_OR_CONFIG")
    card_parser.add_argument("--json", action="store_true", help="print the spec and counts as JSON")
    card_parser.set_defaults(func=_reporting_errors(_run_card))
    diff_parser = subparsers.add_parser("diff", help="print every norm-spec field that differs")
    diff_parser.add_argument("a", metavar="A")
    diff_parser.add_argument("b", metavar="B")
    diff_parser.add_argument("--json", action="store_true", help="print {field: [A, B]} as JSON")
    diff_parser.set_defaults(func=_reporting_errors(_run_diff))
