"""One family, probed: build its tiny model (:func:`normtools.cards.tiny_config` with
``from_defaults=True``), run it twice with forward hooks on every layer, sublayer, norm and
rotary embedding (random tokens, then the same tokens with every position id moved), and hand
what the hooks saw (a :class:`ProbedModel`) to :func:`normtools.cards.atlas.card.classify`."""

import contextlib
import re
import signal
import time

from normtools.cards.atlas.card import classify
from normtools.cards.atlas.norm import behaves_as_norm
from normtools.cards.atlas.probed import ProbedModel, ProbeError, config_attr, one_line, same
from normtools.cards.params import is_norm_module
from normtools.cards.tiny import tiny_config

_TOKENS = 7            # the probe's sequence length
_POSITION_SHIFT = 5    # the position ids' offset of the before/after-RoPE probe
_SECONDS_PER_FAMILY = 30
_SUBLAYER_SKIP = re.compile(r".*(rotary|dropout|act|drop_path).*", re.I)


def probe_family(model_type: str, **overrides) -> dict:
    """The atlas row of one family: ``{"spec": ModelNormSpec dict, "probe": measured details}``;
    :class:`ProbeError` names the stage (config, build, forward, classify) where it failed.
    ``overrides``: config values over the tiny defaults (the atlas itself uses none)."""
    from transformers import CONFIG_MAPPING

    start = time.perf_counter()
    with _time_limit(_SECONDS_PER_FAMILY):
        try:
            defaults = _text_config(CONFIG_MAPPING[model_type]())
            config = _tiny_config_object(model_type, **overrides)
        except Exception as e:  # noqa: BLE001 - every failure is recorded with its text
            raise ProbeError("config", one_line(e)) from None
        try:
            row = _build_and_probe(config, defaults)
        except ProbeError as first:
            # some families assume heads * head_dim == hidden: one retry with head_dim = hidden / heads
            text = _text_config(config)
            heads = getattr(text, "num_attention_heads", None)
            if first.stage == "classify" or not heads or text is not config:
                raise
            try:
                row = _build_and_probe(_tiny_config_object(model_type, **{**overrides,
                                                                           "head_dim": text.hidden_size // heads}),
                                       defaults)
            except ProbeError:
                raise first from None
            row["probe"]["retry"] = "head_dim = hidden_size / num_attention_heads"
    row["probe"]["seconds"] = round(time.perf_counter() - start, 2)
    return row


def _tiny_config_object(model_type, **overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model(**tiny_config(model_type, from_defaults=True, **overrides))


def _text_config(config):
    """The config of the text model (the config itself unless it is multimodal)."""
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get()
    except ValueError:  # an encoder and a decoder text config (MusicGen): the decoder generates
        return get(decoder=True)


@contextlib.contextmanager
def _time_limit(seconds):
    def fail(signum, frame):
        raise TimeoutError(f"probe took more than {seconds} s")
    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _build_and_probe(config, defaults) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        if hasattr(model, "set_default_language"):  # X-MOD: one adapter per language
            model.set_default_language(config.languages[0])
    except Exception as e:  # noqa: BLE001 - every failure is recorded with its text
        raise ProbeError("build", one_line(e)) from None
    try:
        return classify(_run(model, config, defaults))
    except ProbeError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ProbeError("forward", one_line(e)) from None


def _run(model, config, defaults) -> ProbedModel:
    """Run ``model`` on random tokens, then with every position id moved, hooks on every layer,
    sublayer, norm and rotary embedding; the decoder layers are the first candidate list that ran."""
    import torch

    text = _text_config(config)
    num_layers = config_attr(text, "num_hidden_layers", None)
    candidates = _layer_lists(model, num_layers)
    if not candidates:
        raise ProbeError("classify", f"no ModuleList of decoder layers found ({num_layers} expected)")
    norms = {n: m for n, m in model.named_modules() if is_norm_module(m) or behaves_as_norm(m)}
    rotary = [(n, m) for n, m in model.named_modules()
              if "Rotary" in type(m).__name__ or "Rope" in type(m).__name__]
    rec = _Recorder()
    _watch(rec, model, candidates, norms, rotary)
    ids = _token_ids(text, _TOKENS)
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        random_calls = rec.calls
        rec.calls = {}
        try:   # the same tokens, every position id moved by _POSITION_SHIFT (before/after RoPE)
            with torch.no_grad():
                model(input_ids=ids, position_ids=torch.arange(_TOKENS)[None] + _POSITION_SHIFT,
                      use_cache=False)
            shifted_calls = rec.calls
        except Exception:  # noqa: BLE001 - a forward without position_ids: RoPE undetermined
            shifted_calls = {}
    finally:
        rec.remove()
    # the shift reached the rotary embedding (its cos/sin moved): otherwise nothing can tell
    rotations = [(random_calls[n][0][1], shifted_calls[n][0][1]) for n, _ in rotary
                 if n in random_calls and n in shifted_calls]
    shift_seen = any(a is not None and b is not None and not same(a, b) for a, b in rotations)
    ran = [(p, ls) for p, ls in candidates if f"{p}.0" in random_calls]
    if not ran:
        raise ProbeError("classify", f"none of the layer lists ran ({', '.join(p for p, _ in candidates)})")
    prefix, layers = ran[0]
    return ProbedModel(model=model, text=text, defaults=defaults, prefix=prefix, layers=layers, norms=norms,
                       calls=random_calls, shifted_calls=shifted_calls if shift_seen else {},
                       has_rope=bool(rotary))


def _watch(rec, model, candidates, norms, rotary) -> None:
    """Hooks on every candidate layer, its sublayers and the linears with a bias inside them,
    every norm, the LM head and the rotary embeddings."""
    import torch

    norm_ids = {id(m) for m in norms.values()}
    for prefix, layers in candidates:
        for i, layer in enumerate(layers):
            rec.watch(f"{prefix}.{i}", layer)
            for child_name, child in layer.named_children():
                if id(child) not in norm_ids and not _SUBLAYER_SKIP.match(child_name):
                    rec.watch(f"{prefix}.{i}.{child_name}", child)
            for name, m in layer.named_modules():
                if name.count(".") >= 1 and id(m) not in norm_ids and isinstance(getattr(m, "bias", None),
                                                                               torch.nn.Parameter):
                    rec.watch(f"{prefix}.{i}.{name}", m)
    for name, m in norms.items():
        rec.watch(name, m)
    head = model.get_output_embeddings()
    if head is not None:
        rec.watch("<lm_head>", head)
    for name, m in rotary:
        rec.watch(name, m)


class _Recorder:
    """Forward hooks that keep (first tensor input, first tensor output) of every call."""

    def __init__(self):
        self.calls = {}
        self.handles = []

    def watch(self, name, module):
        def hook(mod, args, kwargs, output):
            self.calls.setdefault(name, []).append((_first_tensor(args, kwargs), _first_tensor((output,), {})))
        self.handles.append(module.register_forward_hook(hook, with_kwargs=True))

    def remove(self):
        for h in self.handles:
            h.remove()


def _first_tensor(args, kwargs):
    import torch

    for value in list(args) + [kwargs.get("hidden_states")] + list(kwargs.values()):
        if isinstance(value, torch.Tensor) and _is_real_or_complex(value):
            return value.detach().clone()
        if isinstance(value, (tuple, list)):
            for v in value:
                if isinstance(v, torch.Tensor) and _is_real_or_complex(v):
                    return v.detach().clone()
        if hasattr(value, "last_hidden_state") or hasattr(value, "logits"):
            return _first_tensor((getattr(value, "last_hidden_state", None) or value.logits,), {})
    return None


def _is_real_or_complex(tensor) -> bool:
    """A floating-point or complex tensor (Llama 4's rotary embedding returns complex freqs)."""
    return tensor.dtype.is_floating_point or tensor.dtype.is_complex


def _layer_lists(model, num_layers) -> list:
    """Candidate (prefix, ModuleList) of decoder layers, largest first: lists of ``num_layers``
    blocks, else any list of two or more blocks of one class (the probe keeps the first that runs)."""
    import torch

    def blocks(m):
        return isinstance(m, torch.nn.ModuleList) and len(m) > 0 and \
            sum(p.numel() for p in m[0].parameters()) > 0

    lists = [(n, m) for n, m in model.named_modules() if blocks(m) and len(m) == num_layers]
    if not lists:
        lists = [(n, m) for n, m in model.named_modules() if blocks(m) and len(m) >= 2
                 and len({type(x) for x in m}) == 1]
    return sorted(lists, key=lambda nm: -sum(p.numel() for p in nm[1].parameters()))


def _token_ids(text, count):
    """``count`` random token ids of the vocabulary (1, count), none of them a special token."""
    import torch

    special = {v for k, v in text.to_dict().items() if k.endswith("token_id") and isinstance(v, int)}
    vocab = getattr(text, "vocab_size", 256) or 256
    ids = [i for i in range(3, vocab) if i not in special]
    gen = torch.Generator().manual_seed(1)
    return torch.tensor([ids[i] for i in torch.randint(0, min(len(ids), 200), (count,), generator=gen)])[None]
