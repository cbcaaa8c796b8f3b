"""What the probe saw of one family's tiny model (:class:`ProbedModel`), the error of a family it
could not probe (:class:`ProbeError`), and the comparisons of recorded tensors that the
classification is made of (:func:`same`, :func:`close`)."""

from dataclasses import dataclass, field

from normtools.cards.atlas.norm import probe_norm
from normtools.cards.types import SpecError


class ProbeError(SpecError):
    """A family the probe could not build or run; ``stage`` says where it stopped."""

    def __init__(self, stage, message):
        self.stage = stage
        super().__init__(f"{stage}: {message}")


@dataclass
class ProbedModel:
    """One tiny model and what its forward passes recorded.

    ``calls[name]`` lists (first tensor input, first tensor output) of every call of the module
    ``name`` (the decoder layers, their sublayers, every norm, the rotary embeddings, and
    ``"<lm_head>"``) in a run on random tokens; ``shifted_calls`` the same in a run with every
    position id moved by the same offset, empty when the rotary embedding did not see the shift
    (or the model has none, ``has_rope`` False)."""

    model: object               # the transformers model, random weights, eval mode
    text: object                # its text config (the tiny sizes)
    defaults: object            # the text config of the family's defaults (the card's sizes)
    prefix: str                 # the name of the ModuleList of decoder layers
    layers: object              # that ModuleList
    norms: dict                 # name: every norm module of the model
    calls: dict
    shifted_calls: dict
    has_rope: bool
    _norm_probes: dict = field(default_factory=dict, repr=False)

    @property
    def hidden(self):
        return config_attr(self.text, "hidden_size", None)

    @property
    def head_dim(self):
        return config_attr(self.text, "head_dim", None) or (
            self.hidden // self.text.num_attention_heads if config_attr(self.text, "num_attention_heads", None)
            else None)

    @property
    def heads(self) -> dict:
        """{"q": query heads, "k": key heads}."""
        q = config_attr(self.text, "num_attention_heads", None)
        return {"q": q, "k": config_attr(self.text, "num_key_value_heads", None) or q}

    def seen(self, name) -> tuple:
        """(input, output) of the first call of module ``name``."""
        return self.calls[name][0]

    def norm_probe(self, name) -> dict:
        """:func:`probe_norm` of the norm ``name`` on inputs of the shape it saw (once per name)."""
        if name not in self._norm_probes:
            self._norm_probes[name] = probe_norm(self.norms[name], tuple(self.seen(name)[0].shape))
        return self._norm_probes[name]


def config_attr(config, name, default=None):
    """getattr that also survives configs whose per-layer attributes raise on the global config."""
    try:
        return getattr(config, name, default)
    except Exception:  # noqa: BLE001 - e.g. AmbiguousGlobalPerLayerAttributeError
        return default


def inside(name, parent) -> bool:
    """Module ``name`` is a descendant of module ``parent``."""
    return name.startswith(parent + ".")


def same(a, b) -> bool:
    """Two recorded tensors are equal (shapes compared flattened)."""
    import torch

    return a is not None and b is not None and a.numel() == b.numel() and a.dtype == b.dtype and \
        torch.equal(a.reshape(-1), b.reshape(-1))


def close(total, part, addend) -> bool:
    """total == part + addend up to float32 rounding of the sum (shapes compared flattened)."""
    import torch

    if total is None or part is None or addend is None or not (total.numel() == part.numel() == addend.numel()):
        return False
    t, p, a = (v.reshape(-1).double() for v in (total, part, addend))
    scale = t.abs().max().item() + 1e-30
    return a.abs().max().item() > 1e-6 * scale and bool(torch.allclose(t - a, p, rtol=0, atol=1e-5 * scale))


def one_line(e) -> str:
    """An exception as one line of at most 300 characters."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= 300 else text[:297] + "..."
