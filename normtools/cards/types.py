"""The norm card's data types: one norm (:class:`NormSpec`), QK-Norm, projection biases, other
norms, the whole card (:class:`ModelNormSpec`), its errors, and :func:`diff` of two cards."""

import dataclasses
from dataclasses import dataclass

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


@dataclass(frozen=True)
class NormSpec:
    """One norm: ``kind`` "rms" | "layer", ``eps``, ``bias``, scale ``offset + w``, ``casting``;
    ``affine`` False for a norm without a learned scale (``y = x̂``, an L2 norm)."""

    kind: str
    eps: float
    bias: bool
    offset: float
    casting: str
    affine: bool = True


@dataclass(frozen=True)
class QKNormSpec:
    """QK-Norm: ``scope`` (see module doc), its ``norm`` (None when scope is "none"), ``before_rope``."""

    scope: str = "none"
    norm: NormSpec | None = None
    before_rope: bool | None = None


@dataclass(frozen=True)
class ProjectionBiases:
    """Which projections add a bias; None: unknown (a biased linear whose role the atlas probe
    could not tell, see ``notes``)."""

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
    # per-layer pattern over the default depth, ((field, run-length text), ...): "placement",
    # "qk_norm", "attention" (atlas cards; empty when every layer is alike or unknown)
    layer_pattern: tuple = ()
    notes: tuple = ()  # other forward-pass facts that touch the norms' inputs or outputs
    unconfirmed: tuple = ()  # config keys whose published values could not be confirmed

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

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
        d["layer_pattern"] = tuple(tuple(p) for p in d.get("layer_pattern", ()))
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
