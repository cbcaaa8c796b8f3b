"""One norm module, measured: its kind, eps, scale, bias and casting from its outputs
(:func:`probe_norm`; the equations are in :mod:`normtools.cards.atlas`), and the card's
:class:`NormSpec` of such a measurement (:func:`norm_spec`)."""

import copy

from normtools.cards.types import NormSpec, SpecError

_EPS_ATTRS = ("variance_epsilon", "eps", "epsilon", "layer_norm_eps", "norm_eps")


def _read_eps(module):
    """The eps a norm module stores (None: it keeps it elsewhere, and it is measured)."""
    for attr in _EPS_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def scale_param(module):
    """(attribute name, parameter) of a norm's learned scale; (None, None) without one."""
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
    its outputs on inputs of ``input_shape`` (see :mod:`normtools.cards.atlas`)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    m = copy.deepcopy(module).float().eval()
    attr, weight = scale_param(m)
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
        kind, offset, rel_err = _fit_kind(module, m(x).double(), x, weight, bias, eps_fit)
        # zero weight (and bias): a non-zero output means the scale is 1 + w
        zero_weight_output = None
        if weight is not None:
            weight.zero_()
            if bias is not None:
                bias.zero_()
            zero_weight_output = m(x).abs().max().item()
        eps_measured = _measure_eps(m, weight, kind, offset, eps_fit, input_shape, gen)
        casting = _probe_casting(module, kind, offset, eps_fit, input_shape, gen)
    return {
        "class": type(module).__name__, "kind": kind, "eps": eps, "eps_measured": eps_measured,
        "offset": offset, "affine": weight is not None, "bias": bias is not None,
        "casting": casting, "weight_shape": list(weight.shape) if weight is not None else None,
        "scale_attr": attr, "zero_weight_output_max": zero_weight_output, "fit_rel_error": rel_err,
    }


def _fit_kind(module, y, x, weight, bias, eps) -> tuple:
    """(kind, offset, relative error) of the float64 formula closest to the output ``y``: RMSNorm
    or LayerNorm, scale ``offset + w`` with offset 0 or 1; kind "unknown" past 1e-3."""
    import torch

    candidates = {}
    for kind in ("rms", "layer"):
        for offset in ((0.0, 1.0) if weight is not None else (0.0,)):
            scale = torch.ones(()) if weight is None else offset + weight
            try:
                err = (y - _formula(kind, x, scale, bias, eps)).abs().max().item()
            except RuntimeError:
                continue
            candidates[(kind, offset)] = err / (y.abs().max().item() + 1e-30)
    if not candidates:
        raise SpecError(f"{type(module).__name__}: output does not broadcast like a norm of the last dim")
    (kind, offset), rel_err = min(candidates.items(), key=lambda kv: kv[1])
    return ("unknown" if rel_err > 1e-3 else kind), offset, rel_err


def _measure_eps(m, weight, kind, offset, eps_fit, input_shape, gen):
    """eps measured on rows whose mean square is about eps, with scale s = 1: ``y / x =
    rsqrt(ms + eps)`` gives ``(x / y)^2 - ms`` (None for a norm of unknown kind)."""
    import torch

    if kind not in ("rms", "layer"):
        return None
    if weight is not None:
        weight.fill_(1.0 - offset)
    small = torch.randn(input_shape, generator=gen, dtype=torch.float64)
    small = small / small.pow(2).mean(-1, keepdim=True).sqrt() * eps_fit ** 0.5
    ys = _run_in(m, small)
    xs = small if kind == "rms" else small - small.mean(-1, keepdim=True)
    ms = xs.pow(2).mean(-1, keepdim=True)
    ratio = (xs / ys).pow(2) - ms
    return float(ratio[xs.abs() > 0.5 * eps_fit ** 0.5].median())


def _run_in(module, x):
    """module(x) in float64 when the module allows it, else in float32; returned as float64."""
    try:
        return copy.deepcopy(module).double()(x).double()
    except RuntimeError:
        return module(x.float()).double()


def _probe_casting(module, kind, offset, eps, input_shape, gen):
    """The casting convention that reproduces the module's bf16 output bit for bit ("other": none)."""
    import torch
    import torch.nn.functional as F

    from normtools.core.reference import layer_norm_reference, rms_norm_reference

    if kind not in ("rms", "layer"):
        return "other"
    m = copy.deepcopy(module).to(torch.bfloat16).eval()
    _, weight = scale_param(m)
    bias = getattr(m, "bias", None)
    bias = bias if isinstance(bias, torch.nn.Parameter) else None
    x = (torch.randn(input_shape, generator=gen) * 2 + 1).to(torch.bfloat16)
    if weight is not None:
        weight.copy_((torch.randn(weight.shape, generator=gen) * 0.5 + (0.0 if offset else 1.0)).to(torch.bfloat16))
    if bias is not None:
        bias.copy_((0.1 * torch.randn(bias.shape, generator=gen)).to(torch.bfloat16))
    y = m(x)
    if kind == "rms":
        refs = {c: rms_norm_reference(x, weight, eps=eps, offset=offset, casting=c) for c in ("llama", "gemma")}
    else:
        # scale offset + w: in the input dtype for torch's layer_norm (Nemotron's weight + 1.0), in
        # float32 for the float32 convention
        refs = {"torch": F.layer_norm(x, x.shape[-1:], (weight + offset).reshape(-1) if weight is not None else None,
                                      bias.reshape(-1) if bias is not None else None, eps),
                "gemma": layer_norm_reference(x, weight.float() + offset if weight is not None else None, bias,
                                              eps=eps)}
    matches = [c for c, ref in refs.items() if ref.dtype == y.dtype and torch.equal(ref, y)]
    if len(matches) == 1:
        return matches[0]
    if matches:  # indistinguishable on this input: the module's own class decides
        return "torch" if isinstance(module, torch.nn.LayerNorm) and "torch" in matches else matches[-1]
    return "other"


def norm_spec(p) -> NormSpec:
    """NormSpec of a probed norm; an eps the module does not expose is the measured one (3 digits)."""
    eps = p["eps"] if p["eps"] is not None else float(f"{p['eps_measured'] or 0.0:.3g}")
    return NormSpec(p["kind"], float(eps), bool(p["bias"]), float(p["offset"]), p["casting"], bool(p["affine"]))


def behaves_as_norm(module) -> bool:
    """A leaf module whose parameters are one or two vectors of one width ``d`` (a scale, a bias)
    and whose output on rows of width ``d`` is an RMSNorm or a LayerNorm of them
    (:func:`probe_norm` fits one): a norm whatever its class is called (Nemotron's
    ``LayerNorm1P``, ``F.layer_norm`` with ``1 + w`` and a bias)."""
    params = list(module.parameters())
    if list(module.children()) or not 1 <= len(params) <= 2 or any(p.dim() != 1 for p in params) \
            or len({p.numel() for p in params}) != 1 or params[0].numel() < 8:
        return False
    try:
        return probe_norm(module, (2, 5, params[0].numel()))["kind"] in ("rms", "layer")
    except Exception:  # noqa: BLE001 - a module that does not take one tensor of rows is no norm
        return False


# a gate of 32: sigmoid(32) is 1.0 in float32, so silu(32) = 32 exactly, and a power of two
# scales every float exactly
GATE = 32.0


def with_gate(module):
    """A gated norm (``norm(x) * silu(gate)`` or ``norm(x * silu(gate))``) as a norm of one input,
    for :func:`probe_norm`: called with the gate :data:`GATE`, whose SiLU is exactly the identity
    in float32, its output divided by the gate (gate after the norm) or its input (gate before
    the norm), both exact. Which one: after the norm the output doubles with the gate; before it
    (scale invariance) it does not. The wrapper shows the norm's class name, weight, bias, eps."""
    import torch

    class Gated(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.gate_before = None

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(super().__getattr__("inner"), name)

        def _gated(self, x, gate):
            return self.inner(x, torch.full_like(x, gate))

        def forward(self, x):
            if self.gate_before is None:
                once, twice = self._gated(x, GATE).float(), self._gated(x, 2 * GATE).float()
                self.gate_before = not torch.allclose(twice, 2 * once, rtol=1e-3, atol=0)
            return self._gated(x / GATE, GATE) if self.gate_before else self._gated(x, GATE) / GATE

    Gated.__name__ = type(module).__name__
    return Gated(module)


def takes_a_gate(module) -> bool:
    """The norm's forward takes a second tensor (a gate), required or optional."""
    import inspect

    params = list(inspect.signature(module.forward).parameters.values())[1:]
    return any(p.name == "gate" or p.default is inspect.Parameter.empty for p in params
               if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
