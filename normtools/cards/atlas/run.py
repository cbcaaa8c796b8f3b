"""The atlas: a norm card for every causal-LM family of the installed transformers, read from the
running code rather than written as a rule.

For each model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` the probe builds a tiny instance from
the family's config class (its defaults, shrunk to hidden 64 and 2-4 layers; offline, random
weights, CPU) and measures the modules while they run:

* **norm kind**: rows with a non-zero mean are normalized; the output matches exactly one of
  RMSNorm ``s * x * rsqrt(mean(x^2) + eps)`` and LayerNorm ``s * (x - mean) * rsqrt(var + eps) + b``;
* **eps**: read from the module, then measured on rows whose mean square is about eps:
  with ``s = 1``, ``y / x = rsqrt(ms + eps)`` gives ``eps_measured = (x / y)^2 - ms``;
* **scale** ``s = offset + w``: a zero weight that still gives a non-zero output means ``1 + w``;
* **casting**: the bf16 output is compared bit for bit with the "llama" and "gemma" conventions
  of :mod:`normtools.core.reference` (and ``torch.nn.functional.layer_norm`` for LayerNorm);
* **placement**: forward hooks record what each norm and each sublayer of a layer read and
  wrote; a norm whose output is a sublayer's input is an input norm, a norm whose input is a
  sublayer's output is an output norm, a norm whose output is the layer's (or an enclosing
  sublayer's) output after the residual add is a post norm; two sublayers fed from the layer's
  input are parallel. pre = input norms only, sandwich = input and output norms, post_sublayer
  = output norms only, post = post norms; layers that differ make the family "mixed";
* **QK-Norm**: a q/k norm inside attention; scope by perturbing one head of its input and
  seeing which heads of its output move (one head: per head; all: per layer), the weight shape
  ((head_dim,), (H, head_dim), (H*head_dim,)), and before/after RoPE: the same tokens run again
  with every position id moved by the same offset; relative positions do not change, so only
  RoPE's rotation does, and a norm before RoPE reads the same input both times (undetermined
  when the model's rotary embedding ignores the offset). The first layer with a q/k norm is
  probed: in a hybrid (Qwen3-Next, `qwen3_5`) layer 0 may be linear attention, without one;
* **final norm** (the norm whose output is the LM head's input), **other norms** (latent norms,
  embedding norms, norms inside mixers), **projection biases** and **attention sinks**
  (from the parameters).

Families the probe cannot build or run are listed with the reason (never dropped). The result
is the committed ``data/atlas.json`` (:func:`build_atlas`, ``normtools atlas --refresh``), which
records the transformers version and :data:`PROBE_VERSION`; :func:`compare_atlases` diffs two
atlases (a new transformers release against the committed one).
"""

import contextlib
import copy
import json
import re
import signal
import time
from importlib import resources

from normtools.cards.params import is_norm_module
from normtools.cards.types import ModelNormSpec, NormSpec, OtherNorm, ProjectionBiases, QKNormSpec, SpecError

PROBE_VERSION = 3
ATLAS_FILE = resources.files("normtools.cards").joinpath("data", "atlas.json")

# the probe's tiny shapes: hidden 64, 4 heads of 8 (H*D = 32 differs from hidden, so a per-layer
# QK-Norm cannot pass for a block norm), 2 kv heads, MLA latent ranks that differ from both
_HIDDEN, _HEADS, _KV_HEADS, _HEAD_DIM, _FFN, _TOKENS = 64, 4, 2, 8, 96, 7
_POSITION_SHIFT = 5   # the position ids' offset of the before/after-RoPE probe
_Q_LORA, _KV_LORA = 40, 24
_SECONDS_PER_FAMILY = 30


# --------------------------------------------------------------------------------------------
# tiny configs from each family's defaults
# --------------------------------------------------------------------------------------------

_SIZE_RULES = (  # (regex on a config key, value for an int default larger than it)
    (r"(hidden_size|n_embd|d_model|embed_dim|hidden_dim|model_dim|dim|word_embed_proj_dim)", _HIDDEN),
    (r".*(intermediate_size|ffn_dim|ffn_hidden_size|n_inner|d_ff|mlp_dim|inner_hidden_size).*", _FFN),
    (r"(num_hidden_layers|n_layer|n_layers|num_layers|decoder_layers|encoder_layers|num_decoder_layers)", 2),
    (r"(num_attention_heads|n_head|n_heads|num_heads|decoder_attention_heads|encoder_attention_heads)", _HEADS),
    (r"(head_dim|kv_channels|attention_head_dim|attention_head_size)", _HEAD_DIM),
    (r"(num_experts|num_local_experts|n_routed_experts|moe_num_experts)", 4),
    (r"(num_experts_per_tok|moe_topk|top_k|num_selected_experts|moe_k)", 2),
    (r"(n_group|topk_group|first_k_dense_replace)", 1),
    (r"q_lora_rank", _Q_LORA),
    (r"kv_lora_rank", _KV_LORA),
    (r"(qk_rope_head_dim|qk_nope_head_dim)", _HEAD_DIM),
    (r"v_head_dim", _HEAD_DIM),
    (r"rotary_dim", _HEAD_DIM),
    (r".*hash.*vocab.*", 512),
)
_KV_KEYS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num")
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")


def _shrink_values(defaults: dict) -> dict:
    """Overrides that make a config's defaults tiny (see :data:`_SIZE_RULES`), as a dict.

    Per-layer lists (``layer_types``, ``mlp_layer_types``, per-layer sizes) keep the first layer
    of every distinct kind (at least two layers, at most four); per-layer dicts keyed by layer
    index follow them. A layer pattern given by a period and an offset (Jamba's attention every
    8 layers from layer 4) gets period 2, so that the tiny model has a layer of each kind.
    Unset head sizes get the probe's sizes."""
    out = {}
    heads = next((defaults[k] for k in ("num_attention_heads", "n_head", "n_heads") if isinstance(defaults.get(k), int)), None)
    for key, value in defaults.items():
        if isinstance(value, dict) and key.endswith("_config"):
            out[key] = {**value, **_shrink_values(value)}
            continue
        if value is None and key in ("head_dim",) + _KV_KEYS:
            out[key] = _HEAD_DIM if key == "head_dim" else _HEADS
            continue
        small = _small_int(key, value, heads)
        if small is not None:
            out[key] = small
    if "d_head" in defaults and isinstance(out.get("d_model"), int):  # XLNet: d_head = d_model / n_head
        out["d_head"] = out["d_model"] // out.get("n_head", _HEADS)
    for expand, n_heads, head_dim in (("expand", "num_heads", "head_dim"),
                                      ("mamba_expand", "mamba_n_heads", "mamba_d_head")):
        if all(isinstance(defaults.get(k), int) for k in (expand, n_heads, head_dim)):  # Mamba-2 heads
            out[n_heads] = out.get("hidden_size", _HIDDEN) * defaults[expand] // out.get(head_dim, defaults[head_dim])
    special = [v for k, v in defaults.items() if k.endswith("token_id") and isinstance(v, int)]
    special += [v for k, v in defaults.items() if k.endswith("token_ids") and isinstance(v, list)
                for v in v if isinstance(v, int)]
    if isinstance(defaults.get("vocab_size"), int):
        out["vocab_size"] = min(defaults["vocab_size"], max([256] + [v + 1 for v in special]))
    if "is_decoder" in defaults:
        out["is_decoder"] = True
    out.update(_keep_layer_kinds(defaults, heads))
    for kind in ("attn", "expert"):   # Jamba: layer i is attention if i % period == offset
        period, offset = (defaults.get(f"{kind}_layer_{k}") for k in ("period", "offset"))
        if isinstance(period, int) and isinstance(offset, int) and period > 2:
            out[f"{kind}_layer_period"], out[f"{kind}_layer_offset"] = 2, offset % period and 1
    return out


def _small_int(key, value, heads):
    """The probe's size for an int config value (None: keep the default)."""
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    if key in _KV_KEYS:
        return 1 if value == 1 else (_HEADS if value == heads else _KV_HEADS)
    for pattern, small in _SIZE_RULES:
        if re.fullmatch(pattern, key) and value > small:
            return small
    return None


def _keep_layer_kinds(defaults, heads) -> dict:
    num_layers = next((defaults[k] for k in _LAYER_KEYS if isinstance(defaults.get(k), int)), None)
    if not num_layers:
        return {}
    per_layer = {k: v for k, v in defaults.items() if isinstance(v, list) and len(v) == num_layers and num_layers > 1}
    if not per_layer:
        return {}
    kinds = [tuple(json.dumps(v[i], sort_keys=True) for v in per_layer.values()) for i in range(num_layers)]
    keep = sorted({kinds.index(k) for k in kinds} | {0, 1})[:4]
    out = {k: [_small_int(k, v[i], heads) or v[i] for i in keep] for k, v in per_layer.items()}
    for key, value in defaults.items():
        if key.startswith("per_layer") and isinstance(value, dict):
            out[key] = {str(new) if isinstance(next(iter(value), 0), str) else new: value[old]
                        for new, old in enumerate(keep) for old in (old, str(old)) if old in value}
    for key in _LAYER_KEYS:
        if key in defaults:
            out[key] = len(keep)
    return out


def tiny_family_config(model_type: str, **overrides):
    """The config object of a tiny instance of ``model_type``: its config class's defaults with
    the sizes of :func:`_shrink_values` (hidden 64, 2-4 layers, 4 heads of 8, 4 experts), then
    ``overrides``."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class().to_dict()
    values = {**defaults, **_shrink_values(defaults), **overrides}
    return config_class(**{k: v for k, v in values.items()
                           if k not in ("model_type", "transformers_version", "architectures")})


def causal_lm_model_types() -> tuple:
    """Every causal-LM model type of the installed transformers, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return tuple(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))


# --------------------------------------------------------------------------------------------
# one norm module
# --------------------------------------------------------------------------------------------

_EPS_ATTRS = ("variance_epsilon", "eps", "epsilon", "layer_norm_eps", "norm_eps")


def _read_eps(module):
    for attr in _EPS_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _scale_param(module):
    for attr in ("weight", "scale", "gamma", "g"):
        p = getattr(module, attr, None)
        if p is not None and hasattr(p, "shape") and p.dtype.is_floating_point:
            return attr, p
    return None, None


def _formula(kind, x, scale, bias, eps):
    """float64 reference: RMSNorm or LayerNorm of x over its last dim with scale s and bias b."""
    x = x.double()
    if kind == "rms":
        y = x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    else:
        centered = x - x.mean(-1, keepdim=True)
        y = centered * (centered.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    y = y * scale.double()
    return y if bias is None else y + bias.double()


def probe_norm(module, input_shape, seed=0) -> dict:
    """Kind, eps (read and measured), offset, affine, bias and casting of one norm module, from
    its outputs on inputs of ``input_shape`` (see the module docstring)."""
    import torch
    import torch.nn.functional as F
    from normtools.core.reference import layer_norm_reference, rms_norm_reference

    gen = torch.Generator().manual_seed(seed)
    m = copy.deepcopy(module).float().eval()
    attr, weight = _scale_param(m)
    bias = getattr(m, "bias", None)
    bias = bias if isinstance(bias, torch.nn.Parameter) else None
    eps = _read_eps(m)
    eps_fit = 1e-6 if eps is None else eps
    x = torch.randn(input_shape, generator=gen) * 2 + 3  # rows with a mean
    with torch.no_grad():
        if weight is not None:
            weight.copy_(0.5 + torch.rand(weight.shape, generator=gen))
        if bias is not None:
            bias.copy_(0.1 * torch.randn(bias.shape, generator=gen))
        y = m(x).double()
        ones = torch.ones(())
        candidates = {}
        for kind in ("rms", "layer"):
            for offset in ((0.0, 1.0) if weight is not None else (0.0,)):
                scale = ones if weight is None else offset + weight
                try:
                    err = (y - _formula(kind, x, scale, bias, eps_fit)).abs().max().item()
                except RuntimeError:
                    continue
                candidates[(kind, offset)] = err / (y.abs().max().item() + 1e-30)
        if not candidates:
            raise SpecError(f"{type(module).__name__}: output does not broadcast like a norm of the last dim")
        (kind, offset), rel_err = min(candidates.items(), key=lambda kv: kv[1])
        if rel_err > 1e-3:
            kind = "unknown"
        # zero weight (and bias): a non-zero output means the scale is 1 + w
        zero_weight_output = None
        if weight is not None:
            weight.zero_()
            if bias is not None:
                bias.zero_()
            zero_weight_output = m(x).abs().max().item()
        # eps measured on rows whose mean square is about eps, with scale s = 1 and no bias
        eps_measured = None
        if kind in ("rms", "layer"):
            if weight is not None:
                weight.fill_(1.0 - offset)
            small = torch.randn(input_shape, generator=gen, dtype=torch.float64)
            small = small / small.pow(2).mean(-1, keepdim=True).sqrt() * eps_fit ** 0.5
            ys = _run_in(m, small)
            xs = small if kind == "rms" else small - small.mean(-1, keepdim=True)
            ms = xs.pow(2).mean(-1, keepdim=True)
            ratio = (xs / ys).pow(2) - ms
            eps_measured = float(ratio[xs.abs() > 0.5 * eps_fit ** 0.5].median())
        casting = _probe_casting(module, kind, offset, eps_fit, input_shape, gen,
                                 rms_norm_reference, layer_norm_reference, F)
    return {
        "class": type(module).__name__, "kind": kind, "eps": eps, "eps_measured": eps_measured,
        "offset": offset, "affine": weight is not None, "bias": bias is not None,
        "casting": casting, "weight_shape": list(weight.shape) if weight is not None else None,
        "scale_attr": attr, "zero_weight_output_max": zero_weight_output, "fit_rel_error": rel_err,
    }


def _run_in(module, x):
    """module(x) in float64 when the module allows it, else in float32; returned as float64."""
    try:
        return copy.deepcopy(module).double()(x).double()
    except RuntimeError:
        return module(x.float()).double()


def _probe_casting(module, kind, offset, eps, input_shape, gen, rms_ref, ln_ref, F):
    """The casting convention that reproduces the module's bf16 output bit for bit ("other": none)."""
    import torch

    if kind not in ("rms", "layer"):
        return "other"
    m = copy.deepcopy(module).to(torch.bfloat16).eval()
    _, weight = _scale_param(m)
    bias = getattr(m, "bias", None)
    bias = bias if isinstance(bias, torch.nn.Parameter) else None
    x = (torch.randn(input_shape, generator=gen) * 2 + 1).to(torch.bfloat16)
    if weight is not None:
        weight.copy_((torch.randn(weight.shape, generator=gen) * 0.5 + (0.0 if offset else 1.0)).to(torch.bfloat16))
    if bias is not None:
        bias.copy_((0.1 * torch.randn(bias.shape, generator=gen)).to(torch.bfloat16))
    y = m(x)
    if kind == "rms":
        refs = {c: rms_ref(x, weight, eps=eps, offset=offset, casting=c) for c in ("llama", "gemma")}
    else:
        w = weight if weight is not None else None
        refs = {"torch": F.layer_norm(x, x.shape[-1:], w.reshape(-1) if w is not None else None,
                                      bias.reshape(-1) if bias is not None else None, eps),
                "gemma": ln_ref(x, w, bias, eps=eps)}
    matches = [c for c, ref in refs.items() if ref.dtype == y.dtype and torch.equal(ref, y)]
    if len(matches) == 1:
        return matches[0]
    if matches:  # indistinguishable on this input: the module's own class decides
        return "torch" if isinstance(module, torch.nn.LayerNorm) and "torch" in matches else matches[-1]
    return "other"


# --------------------------------------------------------------------------------------------
# one family: build, run with hooks, classify
# --------------------------------------------------------------------------------------------

_ATTN_NAME = re.compile(r".*(attn|attention|self_attention|mixer|linear_attn|mamba|token_mixer|conv).*", re.I)
# QK-Norm modules: one for q and one for k, or one module for both (Llama 4's ``qk_norm``)
_QK_NAME = re.compile(r"^(q|k|qk|query|key)_?(norm|layernorm|layer_norm|ln|rmsnorm)$", re.I)
_SUBLAYER_SKIP = re.compile(r".*(rotary|dropout|act|drop_path).*", re.I)


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


def _same(a, b) -> bool:
    import torch

    return a is not None and b is not None and a.numel() == b.numel() and a.dtype == b.dtype and \
        torch.equal(a.reshape(-1), b.reshape(-1))


def _close(total, part, addend) -> bool:
    """total == part + addend up to float32 rounding of the sum (shapes compared flattened)."""
    import torch

    if total is None or part is None or addend is None or not (total.numel() == part.numel() == addend.numel()):
        return False
    t, p, a = (v.reshape(-1).double() for v in (total, part, addend))
    scale = t.abs().max().item() + 1e-30
    return a.abs().max().item() > 1e-6 * scale and bool(torch.allclose(t - a, p, rtol=0, atol=1e-5 * scale))


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


def _attr(config, name, default=None):
    """getattr that also survives configs whose per-layer attributes raise on the global config."""
    try:
        return getattr(config, name, default)
    except Exception:  # noqa: BLE001 - e.g. AmbiguousGlobalPerLayerAttributeError
        return default


def _text_config(config):
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


class ProbeError(SpecError):
    """A family the probe could not build or run; ``stage`` says where it stopped."""

    def __init__(self, stage, message):
        self.stage = stage
        super().__init__(f"{stage}: {message}")


def probe_family(model_type: str) -> dict:
    """The atlas row of one family: ``{"spec": ModelNormSpec dict, "probe": measured details}``;
    :class:`ProbeError` names the stage (config, build, forward, classify) where it failed."""
    from transformers import CONFIG_MAPPING

    start = time.perf_counter()
    with _time_limit(_SECONDS_PER_FAMILY):
        try:
            defaults = _text_config(CONFIG_MAPPING[model_type]())
            config = tiny_family_config(model_type)
        except Exception as e:  # noqa: BLE001 - every failure is recorded with its text
            raise ProbeError("config", _one_line(e)) from None
        try:
            row = _build_and_probe(config, defaults)
        except ProbeError as first:
            # some families assume heads * head_dim == hidden: one retry with head_dim = hidden / heads
            text = _text_config(config)
            heads = getattr(text, "num_attention_heads", None)
            if first.stage == "classify" or not heads or text is not config:
                raise
            try:
                row = _build_and_probe(tiny_family_config(model_type, head_dim=text.hidden_size // heads), defaults)
            except ProbeError:
                raise first from None
            row["probe"]["retry"] = "head_dim = hidden_size / num_attention_heads"
    row["probe"]["seconds"] = round(time.perf_counter() - start, 2)
    return row


def _build_and_probe(config, defaults) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        if hasattr(model, "set_default_language"):  # X-MOD: one adapter per language
            model.set_default_language(config.languages[0])
    except Exception as e:  # noqa: BLE001 - every failure is recorded with its text
        raise ProbeError("build", _one_line(e)) from None
    try:
        return _probe_model(model, config, defaults)
    except ProbeError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ProbeError("forward", _one_line(e)) from None


def _one_line(e) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= 300 else text[:297] + "..."


def _token_ids(text_config, count):
    import torch

    special = {v for k, v in text_config.to_dict().items() if k.endswith("token_id") and isinstance(v, int)}
    vocab = getattr(text_config, "vocab_size", 256) or 256
    ids = [i for i in range(3, vocab) if i not in special]
    gen = torch.Generator().manual_seed(1)
    return torch.tensor([ids[i] for i in torch.randint(0, min(len(ids), 200), (count,), generator=gen)])[None]


def _probe_model(model, config, defaults) -> dict:
    import torch

    text = _text_config(config)
    num_layers = _attr(text, "num_hidden_layers", None)
    candidates = _layer_lists(model, num_layers)
    if not candidates:
        raise ProbeError("classify", f"no ModuleList of decoder layers found ({num_layers} expected)")
    hidden = _attr(text, "hidden_size", None)
    head_dim = _attr(text, "head_dim", None) or (hidden // text.num_attention_heads
                                                   if _attr(text, "num_attention_heads", None) else None)
    heads = {"q": _attr(text, "num_attention_heads", None),
             "k": _attr(text, "num_key_value_heads", None) or _attr(text, "num_attention_heads", None)}
    norms = {n: m for n, m in model.named_modules() if is_norm_module(m)}
    rec = _Recorder()
    for prefix, layers in candidates:
        for i, layer in enumerate(layers):
            rec.watch(f"{prefix}.{i}", layer)
            for child_name, child in layer.named_children():
                if not is_norm_module(child) and not _SUBLAYER_SKIP.match(child_name):
                    rec.watch(f"{prefix}.{i}.{child_name}", child)
    for name, m in norms.items():
        rec.watch(name, m)
    head = model.get_output_embeddings()
    if head is not None:
        rec.watch("<lm_head>", head)
    rotary = [(n, m) for n, m in model.named_modules()
              if "Rotary" in type(m).__name__ or "Rope" in type(m).__name__]
    for name, m in rotary:
        rec.watch(name, m)
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
    shift_seen = any(a is not None and b is not None and not _same(a, b) for a, b in rotations)
    ran = [(p, ls) for p, ls in candidates if f"{p}.0" in random_calls]
    if not ran:
        raise ProbeError("classify", f"none of the layer lists ran ({', '.join(p for p, _ in candidates)})")
    prefix, layers = ran[0]
    return _classify(model, prefix, layers, norms, random_calls,
                     shifted_calls if shift_seen else {}, bool(rotary), text, defaults, hidden,
                     head_dim, heads)


def _inside(name, parent) -> bool:
    return name.startswith(parent + ".")


def _classify(model, prefix, layers, norms, calls, shifted_calls, has_rope, text, defaults, hidden,
              head_dim, heads):
    """``shifted_calls``: the calls of the run with every position id moved, empty when the
    rotary embedding did not see the shift (or there is none: ``has_rope`` False)."""
    probes, notes = {}, []

    def probe(name):
        if name not in probes:
            inp = calls[name][0][0]
            probes[name] = probe_norm(norms[name], tuple(inp.shape))
        return probes[name]

    layer_labels, per_sublayer, layer0_block, qk, others = [], [], [], {}, []
    other_locals = set()   # the other norms' names within a layer, each kept from its first layer
    qk_layer = None        # the first layer with a q/k norm
    for i in range(len(layers)):
        lname = f"{prefix}.{i}"
        if lname not in calls:
            raise ProbeError("classify", f"layer {i} never ran")
        layer_in, layer_out = calls[lname][0]
        subs = {n: calls[n][0] for n in calls if n.startswith(lname + ".") and n.count(".") == lname.count(".") + 1
                and n not in norms}
        layer_norms = [n for n in norms if _inside(n, lname) and n in calls]
        block, qk_here = [], []
        for n in layer_norms:
            local = n[len(lname) + 1:]
            last = local.rsplit(".", 1)[-1]
            inp = calls[n][0][0]
            dim = inp.shape[-1] if inp is not None else None
            # QK-Norm: a q/k norm held by the attention module itself (not by a helper inside it,
            # such as DeepSeek-V3.2's sparse-attention indexer)
            in_attn = any(n.rpartition(".")[0] == s and _ATTN_NAME.match(s.rsplit(".", 1)[-1]) for s in subs)
            if in_attn and _QK_NAME.match(last):
                qk_here.append(n)
            elif dim == hidden and not any(_inside(n, s) and _ATTN_NAME.match(s.rsplit(".", 1)[-1])
                                            and not _is_post_in(n, s, calls, subs) for s in subs):
                block.append(n)
            elif local not in other_locals:
                other_locals.add(local)
                others.append(n)
        labels, stream = {}, {}
        primary = [s for s in subs if sum(p.numel() for p in _module(model, s).parameters()) > 0
                   and not any(_same(subs[s][0], subs[t][1]) for t in subs if t != s)]
        inputs = [layer_in] + [calls[n][0][0] for n in block] + [subs[t][0] for t in subs]
        later = [layer_out] + inputs[1:]
        outs = [subs[t][1] for t in subs]

        def is_stream(v):  # v is the residual stream: the layer's output, or v + a sublayer output is read
            return _same(v, layer_out) or any(_close(w, v, o) for w in later for o in outs)

        def is_addend(v):  # v is added to the residual stream: stream + v is read later
            return any(_close(w, u, v) for w in later for u in inputs)

        for s in primary:
            s_in, s_out = subs[s]
            outside = [n for n in block if not _inside(n, s)]
            in_norm = next((n for n in outside if _same(calls[n][0][1], s_in) and not is_stream(calls[n][0][1])),
                           None) or next((n for n in block if _inside(n, s) and _same(calls[n][0][0], s_in)), None)
            out_norm = next((n for n in outside if _same(calls[n][0][0], s_out) and is_addend(calls[n][0][1])), None)
            post_norm = next((n for n in block if _inside(n, s) and _same(calls[n][0][1], s_out)), None) or next(
                (n for n in outside if is_stream(calls[n][0][1]) and any(_close(calls[n][0][0], u, s_out)
                                                                         for u in inputs)), None)
            stream[s] = calls[in_norm][0][0] if in_norm else s_in
            labels[s[len(lname) + 1:]] = ("post" if post_norm else "sandwich" if in_norm and out_norm
                                          else "post_sublayer" if out_norm else "pre" if in_norm else "none")
        parallel = sum(_same(stream[s], layer_in) for s in primary) >= 2
        per_sublayer.append(labels)
        kinds = set(labels.values()) - {"none"}
        layer_labels.append("parallel" if parallel else kinds.pop() if len(kinds) == 1 else
                            "none" if not kinds else "mixed")
        if i == 0:
            layer0_block = block
        # QK-Norm from the first layer that has it: in a hybrid (Qwen3-Next) layer 0 may be
        # linear attention, without q/k norms
        if qk_here and qk_layer is None:
            qk_layer = i
            for n in qk_here:
                try:
                    qk[n] = _probe_qk(norms[n], calls[n][0][0],
                                      shifted_calls.get(n, [(None, None)])[0][0],
                                      n[len(lname) + 1:], head_dim, heads)
                except Exception:  # noqa: BLE001 - a q/k norm with other inputs (Zaya's takes q and k)
                    others.append(n)  # is reported among the other norms, with the reason
    placement = layer_labels[0] if len(set(layer_labels)) == 1 else "mixed"
    block_probes = {n[len(f"{prefix}.0") + 1:]: probe(n) for n in layer0_block}
    # the final norm: the norm (outside the layers) whose output is the LM head's input
    head_in = calls.get("<lm_head>", [(None, None)])[0][0]
    outside = [n for n in norms if not _inside(n, prefix) and n in calls]
    final = next((n for n in outside if _same(calls[n][-1][1], head_in)), None)
    for n in outside:
        if n != final:
            others.append(n)
    other_probes = {}
    for n in others:
        try:
            other_probes[n] = probe(n)
        except Exception as e:  # noqa: BLE001 - a norm with extra inputs (gated norms) is reported
            other_probes[n] = {"class": type(norms[n]).__name__, "kind": "not probed", "error": _one_line(e)}
    final_probe = probe(final) if final else None
    row = _spec_row(model, prefix, layers, text, defaults, placement, block_probes, final_probe, qk,
                    other_probes, hidden, notes)
    row["probe"].update(layer_placements=layer_labels, sublayer_placements=per_sublayer,
                        block_norms=block_probes, final_norm=final_probe,
                        final_norm_name=final, other_norms=other_probes, has_rope=has_rope,
                        qk_layer=qk_layer,
                        tiny_config=_tiny_summary(text))
    return row


def _is_post_in(norm_name, sub, calls, subs) -> bool:
    """A block norm nested in a sublayer that reads the sublayer's input (pre-LN BERT variants) or
    writes its output (BERT's post-LN)."""
    return _same(calls[norm_name][0][1], subs[sub][1]) or _same(calls[norm_name][0][0], subs[sub][0])


def _module(model, name):
    return model.get_submodule(name)


def _probe_qk(module, inp, shifted_inp, local_name, head_dim, heads) -> dict:
    """QK-Norm scope by perturbing one head; weight shape; before/after RoPE (``shifted_inp``:
    its input with every position id moved, None when undetermined). ``which``: "q", "k", or
    "qk" for one module applied to both (probed on q's heads)."""
    import torch

    last = local_name.rsplit(".", 1)[-1].lower()
    which = "qk" if last.startswith("qk") else "q" if last.startswith("q") else "k"
    h = heads["q" if which == "qk" else which]
    d = head_dim
    m = copy.deepcopy(module).float().eval()
    x = inp.float()
    if x.shape[-1] == d:  # per-head rows: the head axis is the one of size h (tokens differ)
        axis = next((a for a in range(x.dim() - 1) if x.shape[a] == h), None)
        view = x
    elif h and d and x.shape[-1] == h * d:
        axis, view = x.dim() - 1, x.unflatten(-1, (h, d))
    else:
        axis, view = None, None
    scope = "unrecognised"
    moved_heads = None
    if axis is not None:
        gen = torch.Generator().manual_seed(2)
        with torch.no_grad():
            base = m(x)
            bumped = view.clone()
            bumped.select(axis, 0).add_(torch.randn(bumped.select(axis, 0).shape, generator=gen))
            out = m(bumped.reshape(x.shape))
            diff = (out - base).abs()
            diff = diff if x.shape[-1] == d else diff.unflatten(-1, (h, d))
            moved = diff.movedim(axis, 0).reshape(h, -1).amax(1) > 1e-6
        moved_heads = int(moved.sum())
        _, weight = _scale_param(module)
        if moved_heads == 1:
            scope = "per_head_weights" if weight is not None and weight.numel() == h * d else "per_head"
        elif moved_heads == h:
            scope = "per_layer"
    before_rope = None
    if shifted_inp is not None:
        # the same GEMMs on the same tokens: equal up to rounding before RoPE; RoPE moves them by
        # O(1) of the rows' scale
        scale = inp.abs().max().item() + 1e-30
        before_rope = bool(torch.allclose(inp, shifted_inp, rtol=0, atol=1e-4 * scale))
    norm = probe_norm(module, tuple(inp.shape))
    _, weight = _scale_param(module)
    return {"which": which, "scope": scope, "moved_heads": moved_heads, "heads": h,
            "weight_shape": list(weight.shape) if weight is not None else None,
            "before_rope": before_rope, "norm": norm, "name": local_name}


def _default_size(tiny: int, text, defaults) -> int:
    """The default-config value of the config key whose tiny value is ``tiny`` (the probe's sizes
    are distinct: hidden 64, latent ranks 40 and 24, ...); ``tiny`` itself when no key has it."""
    keys = [k for k, v in text.to_dict().items() if v == tiny and not isinstance(v, bool)
            and isinstance(_attr(defaults, k), int)]
    return int(_attr(defaults, "hidden_size" if "hidden_size" in keys else keys[0])) if keys else tiny


def _tiny_summary(text) -> dict:
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
    return {k: _attr(text, k, None) for k in keys if isinstance(_attr(text, k, None), int)}


def _norm_spec(p) -> NormSpec:
    """NormSpec of a probed norm; an eps the module does not expose is the measured one (3 digits)."""
    eps = p["eps"] if p["eps"] is not None else float(f"{p['eps_measured'] or 0.0:.3g}")
    return NormSpec(p["kind"], float(eps), bool(p["bias"]), float(p["offset"]), p["casting"])


_BIAS_NAMES = (  # (regex on a Linear's local name in the attention module, projections it holds)
    (r".*(qkv|c_attn|query_key_value|in_proj|wqkv).*", "qkv"),
    (r"(kv_a_proj_with_mqa|kv_b_proj|kv_proj|wkv.*)", "kv"),
    (r"(q_proj|query|query_proj|q|wq|q_a_proj|q_b_proj|q_lin)", "q"),
    (r"(k_proj|key|key_proj|k|wk|k_lin)", "k"),
    (r"(v_proj|value|value_proj|v|wv|v_lin)", "v"),
    (r"(o_proj|dense|out_proj|c_proj|wo|o|out_lin|output|proj|out)", "o"),
)


def _biases(model, prefix, layers, notes) -> tuple:
    """(ProjectionBiases from the parameters of every layer with an attention or another token
    mixer, a bias found in any of them; the unnamed linears, each once). A hybrid's layers differ:
    Qwen3-Next's first layers are linear attention, its fourth full attention."""
    import torch

    found = dict(q=False, k=False, v=False, o=False, mlp=False, router=False, experts=False)
    unnamed = []
    for layer in layers:
        attn = [(n, m) for n, m in layer.named_children() if _ATTN_NAME.match(n) and not is_norm_module(m)]
        if not attn:
            continue
        for name, module in layer.named_modules():
            top = name.split(".")[0]
            is_attn = any(top == a for a, _ in attn)
            for pname, p in module.named_parameters(recurse=False):
                if "bias" not in pname or is_norm_module(module):
                    continue
                local = name.rsplit(".", 1)[-1]
                # a bias of one value per expert shifts the routing scores (AFMoE's expert_bias;
                # DeepSeek-V3 keeps its e_score_correction_bias as a buffer, not a parameter, so
                # it is not counted): the router's, not the experts'
                per_expert_score = p.dim() == 1 and "expert" in pname
                if ("expert" in name or "expert" in pname) and not per_expert_score:
                    found["experts"] = True
                elif re.fullmatch(r"(gate|router|wg|gating)", local) or "router" in pname or \
                        per_expert_score:
                    found["router"] = True
                elif is_attn and isinstance(module, (torch.nn.Linear, torch.nn.Conv1d)) or \
                        (is_attn and type(module).__name__ == "Conv1D"):
                    for pattern, which in _BIAS_NAMES:
                        if re.fullmatch(pattern, local):
                            for w in ("qkv" if which == "qkv" else "kv" if which == "kv" else which):
                                found[{"q": "q", "k": "k", "v": "v", "o": "o"}[w]] = True
                            break
                    else:
                        if name not in unnamed:
                            unnamed.append(name)
                elif not is_attn and isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D":
                    found["mlp"] = True
    head = model.get_output_embeddings()
    lm_head = head is not None and getattr(head, "bias", None) is not None
    return ProjectionBiases(**found, lm_head=lm_head), unnamed


def _spec_row(model, prefix, layers, text, defaults, placement, block_probes, final_probe, qk, other_probes,
              hidden, notes) -> dict:
    if not block_probes:
        raise ProbeError("classify", "no block norm found in the first layer")
    first = next(iter(block_probes.values()))
    block_specs = {n: _norm_spec(p) for n, p in block_probes.items()}
    if len(set(block_specs.values())) > 1:
        notes.append("block norms differ: " + "; ".join(f"{n}: {s.kind}, eps {s.eps:g}, offset {s.offset:g}, "
                                                        f"{s.casting}" for n, s in block_specs.items()))
    if any(not p["affine"] for p in block_probes.values()):
        notes.append("block norms have no learned scale (y = x̂)")
    qk_spec = QKNormSpec()
    if qk:
        q = next((v for v in qk.values() if v["which"] == "q"), next(iter(qk.values())))
        qk_spec = QKNormSpec(q["scope"], _norm_spec(q["norm"]), q["before_rope"])
        scopes = {v["which"]: v["scope"] for v in qk.values()}
        if len(set(scopes.values())) > 1:
            notes.append(f"q and k norms differ in scope: {scopes}")
    biases, unnamed = _biases(model, prefix, layers, notes)
    if unnamed:
        notes.append("attention linears with a bias that no name rule maps: " + ", ".join(unnamed))
    other = []
    for n, p in other_probes.items():
        per_layer = n.startswith(prefix + ".")
        base = getattr(model, "base_model_prefix", "") + "."
        local = n[len(prefix) + 1:].split(".", 1)[1] if per_layer else n.removeprefix(base)
        if p.get("kind") not in ("rms", "layer"):
            notes.append(f"{local if per_layer else n}: {p['class']} not probed "
                         f"({p.get('error', p.get('kind'))})")
            continue
        if p["class"].endswith("NormGated"):
            notes.append(f"{local if per_layer else n}: {p['class']} is gated (its input or "
                         "output times silu(gate)); probed without a gate")
        dim = p["weight_shape"][-1] if p["weight_shape"] else 0
        other.append(OtherNorm(local, per_layer, _default_size(int(dim), text, defaults), _norm_spec(p)))
    sinks = any("sink" in n for n, _ in layers[0].named_parameters())
    num_heads = _attr(defaults, "num_attention_heads", 0) or 0
    spec = ModelNormSpec(
        model_type=text.model_type if text.model_type else model.config.model_type,
        block_norm=_norm_spec(first), placement=placement, layer_norms=tuple(block_probes),
        final_norm=_norm_spec(final_probe) if final_probe else None, qk_norm=qk_spec, biases=biases,
        other_norms=tuple(other), attention_sinks=sinks,
        hidden_size=int(_attr(defaults, "hidden_size", 0) or 0),
        num_layers=int(_attr(defaults, "num_hidden_layers", 0) or 0), num_heads=int(num_heads),
        num_kv_heads=int(_attr(defaults, "num_key_value_heads", None) or num_heads),
        head_dim=int(_attr(defaults, "head_dim", None) or (defaults.hidden_size // num_heads if num_heads
                                                              and _attr(defaults, "hidden_size", None) else 0)),
        notes=tuple(notes) + ("probed on a tiny random instance of the config class's defaults; "
                              "shapes are the defaults",),
    )
    return {"spec": spec.to_dict(), "probe": {"qk_norms": qk}}


# --------------------------------------------------------------------------------------------
# the whole atlas
# --------------------------------------------------------------------------------------------

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
    mapping = dict(_causal_mapping())
    logging.getLogger("transformers").setLevel(logging.ERROR)
    for model_type in model_types or causal_lm_model_types():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                families[model_type] = probe_family(model_type)
                families[model_type]["probe"]["class"] = mapping.get(model_type)
                result = "probed"
            except ProbeError as e:
                not_probed[model_type] = str(e)
                result = str(e)
        if progress is not None:
            progress(model_type, result)
    return {"transformers": transformers.__version__, "probe_version": PROBE_VERSION,
            "families": families, "not_probed": not_probed}


def _causal_mapping():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()


def load_atlas(path=None) -> dict:
    """The committed atlas (``normtools/cards/data/atlas.json``) or the one at ``path``."""
    text = ATLAS_FILE.read_text() if path is None else open(path).read()
    return json.loads(text)


def save_atlas(atlas: dict, path=None) -> None:
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
        rows.append({
            "model_type": model_type, "norm": b.kind, "eps": b.eps, "scale": "1+w" if b.offset == 1 else "w",
            "bias": b.bias, "casting": b.casting, "placement": s.placement,
            "final_norm": s.final_norm is not None, "qk_norm": s.qk_norm.scope,
            "qk_before_rope": s.qk_norm.before_rope, "qk_weight": _qk_weight(row["probe"]),
            "other_norms": len(s.other_norms),
            "attn_bias": s.biases.q or s.biases.k or s.biases.v, "sinks": s.attention_sinks,
        })
    return rows


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
    from normtools.cards.derive import _FAMILIES, from_hf_config
    from normtools.cards.types import diff

    atlas = atlas or load_atlas()
    out = {}
    for model_type in sorted(set(_FAMILIES) & set(atlas["families"])):
        d = diff(from_hf_config({"model_type": model_type}), atlas_spec(model_type, atlas))
        d = {k: list(v) for k, v in d.items() if k.split(".")[0] in _RULE_FIELDS}
        if d:
            out[model_type] = d
    return out
