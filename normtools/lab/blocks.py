"""TinyLM's block: one short function per norm placement, over a few operations.

N is the configured norm (RMSNorm, LayerNorm or DyT); every N is a separate module with its own
weight, named by where it sits (``attn_in``, ``mlp_out``, ``attn_res``, ...):

    post           x = N(x + Attn(x));        x = N(x + MLP(x))          (original Transformer)
    pre            x = x + Attn(N(x));        x = x + MLP(N(x))          (GPT-2, Llama)
    sandwich       x = x + N(Attn(N(x)));     x = x + N(MLP(N(x)))       (Gemma 2/3, Peri-LN)
    post_sublayer  x = x + N(Attn(x));        x = x + N(MLP(x))          (OLMo 2)
    parallel       x = x + Attn(N(x)) + MLP(N(x)), one shared N           (GPT-J, Cohere, Phi)
    none           x = x + Attn(x);           x = x + MLP(x)

The designs of chapter 7 ("Related") add five placements (:data:`RELATED_PLACEMENTS`):

    deepnorm  x = N(α·x + Attn(x));  x = N(α·x + MLP(x))                  (DeepNet, GLM-130B)
    admin     x = N(ω_attn ⊙ x + Attn(x));  x = N(ω_mlp ⊙ x + MLP(x))      (Admin)
    mix_ln    post in the first ⌊post_ln_fraction · depth⌋ layers, pre in the others  (Mix-LN)
    lns       x = x + Attn(N(x)/√ℓ);  x = x + MLP(N(x)/√ℓ)     (LayerNorm Scaling, ℓ = 1..depth)
    ngpt      x = S(x + α_A ⊙ (S(Attn(x)) − x));  x = S(x + α_M ⊙ (S(MLP(x)) − x))   (nGPT)

(``mix_ln`` is no block of its own: each of its layers is a ``post`` or a ``pre`` block.) What α,
ω, S and the learned rates are, and how they are initialized, is in :mod:`normtools.lab.tinylm`.

Each block function (:data:`BLOCKS`) takes the residual stream x and ``ops``, which provides

    ops.norm(name, v)    the norm called ``name`` applied to v
    ops.sublayer(f, v)   the attention (f="attn") or MLP (f="mlp") sublayer applied to v
    ops.add(*terms)      the sum of the terms (a residual connection)
    ops.assign(v)        the new value of the residual stream x
    ops.scale(c, v)      v times the block's constant ``c``: "alpha" (DeepNorm's α) or "depth"
                         (LayerNorm Scaling's 1/√ℓ)
    ops.step(f, x, h)    x + α_f ⊙ (h − x), nGPT's step towards h with learned α_f
    ops.weigh(f, v)      ω_f ⊙ v, Admin's learned residual weight of sublayer f

The forward pass runs a block function on tensors (``normtools.lab.tinylm.Block`` is its
``ops``); :func:`block_equation` runs the very same function on strings to print the equation,
and :func:`norm_names` to list the norms a block needs, so that neither can drift from what the
model computes.
"""

from __future__ import annotations

from normtools.core.validate import check_choice

PLACEMENT_NAMES = ("post", "pre", "sandwich", "post_sublayer", "parallel", "none")
#: The placements of chapter 7 ("Related"); ``mix_ln`` mixes two of the above across layers.
RELATED_PLACEMENTS = ("deepnorm", "admin", "mix_ln", "lns", "ngpt")
#: The two sublayers of a block, in the order they run.
SUBLAYERS = ("attn", "mlp")


def post_block(x, ops):
    """Post-LN: x = N_res(x + Attn(x)); x = N_res(x + MLP(x))."""
    for f in SUBLAYERS:
        x = ops.assign(ops.norm(f"{f}_res", ops.add(x, ops.sublayer(f, x))))
    return x


def pre_block(x, ops):
    """Pre-LN: x = x + Attn(N_in(x)); x = x + MLP(N_in(x))."""
    for f in SUBLAYERS:
        x = ops.assign(ops.add(x, ops.sublayer(f, ops.norm(f"{f}_in", x))))
    return x


def sandwich_block(x, ops):
    """Sandwich (Peri-LN): x = x + N_out(Attn(N_in(x))); x = x + N_out(MLP(N_in(x)))."""
    for f in SUBLAYERS:
        x = ops.assign(ops.add(x, ops.norm(f"{f}_out", ops.sublayer(f, ops.norm(f"{f}_in", x)))))
    return x


def post_sublayer_block(x, ops):
    """Post-sublayer (OLMo 2): x = x + N_out(Attn(x)); x = x + N_out(MLP(x))."""
    for f in SUBLAYERS:
        x = ops.assign(ops.add(x, ops.norm(f"{f}_out", ops.sublayer(f, x))))
    return x


def parallel_block(x, ops):
    """Parallel: h = N_in(x); x = x + Attn(h) + MLP(h), one norm shared by both sublayers."""
    h = ops.norm("in", x)
    return ops.assign(ops.add(x, ops.sublayer("attn", h), ops.sublayer("mlp", h)))


def none_block(x, ops):
    """No norm: x = x + Attn(x); x = x + MLP(x)."""
    for f in SUBLAYERS:
        x = ops.assign(ops.add(x, ops.sublayer(f, x)))
    return x


def deepnorm_block(x, ops):
    """DeepNorm: x = N_res(α·x + Attn(x)); x = N_res(α·x + MLP(x))."""
    for f in SUBLAYERS:
        h = ops.sublayer(f, x)
        x = ops.assign(ops.norm(f"{f}_res", ops.add(ops.scale("alpha", x), h)))
    return x


def admin_block(x, ops):
    """Admin: x = N_res(ω_attn ⊙ x + Attn(x)); x = N_res(ω_mlp ⊙ x + MLP(x))."""
    for f in SUBLAYERS:
        h = ops.sublayer(f, x)
        x = ops.assign(ops.norm(f"{f}_res", ops.add(ops.weigh(f, x), h)))
    return x


def lns_block(x, ops):
    """LayerNorm Scaling: x = x + Attn(N_in(x)/√ℓ); x = x + MLP(N_in(x)/√ℓ), ℓ the layer (1-based)."""
    for f in SUBLAYERS:
        x = ops.assign(ops.add(x, ops.sublayer(f, ops.scale("depth", ops.norm(f"{f}_in", x)))))
    return x


def ngpt_block(x, ops):
    """nGPT: h = N_out(Attn(x)); x = N_res(x + α_attn ⊙ (h − x)); the same with the MLP (N = S,
    the unit-norm map)."""
    for f in SUBLAYERS:
        h = ops.norm(f"{f}_out", ops.sublayer(f, x))
        x = ops.assign(ops.norm(f"{f}_res", ops.step(f, x, h)))
    return x


#: placement → its block function; every placement but ``mix_ln`` (a mix of post and pre).
BLOCKS = {"post": post_block, "pre": pre_block, "sandwich": sandwich_block,
          "post_sublayer": post_sublayer_block, "parallel": parallel_block, "none": none_block,
          "deepnorm": deepnorm_block, "admin": admin_block, "lns": lns_block, "ngpt": ngpt_block}
#: What one block can be (``mix_ln`` is not one: each of its layers is ``post`` or ``pre``).
BLOCK_PLACEMENTS = tuple(BLOCKS)


def block_program(placement: str, x, ops):
    """One Transformer block for ``placement`` (one of :data:`BLOCK_PLACEMENTS`): its function
    in :data:`BLOCKS` applied to x with ``ops``."""
    check_choice("placement", placement, BLOCK_PLACEMENTS)
    return BLOCKS[placement](x, ops)


class _EquationOps:
    """Runs a block function on strings: each assignment becomes one line."""

    def __init__(self, fmt: str):
        check_choice("fmt", fmt, ("text", "latex"))
        self.fmt = fmt
        self.lines: list[str] = []
        self.norm_names: list[str] = []

    def norm(self, name, v):
        self.norm_names.append(name)
        if self.fmt == "latex":
            return rf"\mathrm{{N}}_{{\mathrm{{{name.replace('_', ',')}}}}}\left({v}\right)"
        return f"N_{name}({v})"

    def sublayer(self, f, v):
        label = {"attn": "Attn", "mlp": "MLP"}[f]
        return rf"\mathrm{{{label}}}\left({v}\right)" if self.fmt == "latex" else f"{label}({v})"

    def add(self, *terms):
        return " + ".join(terms)

    def assign(self, v):
        self.lines.append(rf"x &\leftarrow {v}" if self.fmt == "latex" else f"x = {v}")
        return "x"

    def scale(self, c, v):
        if self.fmt == "latex":
            return {"alpha": rf"\alpha\, {v}", "depth": rf"\tfrac{{1}}{{\sqrt{{\ell}}}}\, {v}"}[c]
        return {"alpha": f"α·{v}", "depth": f"{v}/√ℓ"}[c]

    def step(self, f, x, h):
        if self.fmt == "latex":
            return rf"{x} + \alpha_{{\mathrm{{{f}}}}} \odot \left({h} - {x}\right)"
        return f"{x} + α_{f} ⊙ ({h} − {x})"

    def weigh(self, f, v):
        if self.fmt == "latex":
            return rf"\omega_{{\mathrm{{{f}}}}} \odot {v}"
        return f"ω_{f} ⊙ {v}"


def _program_lines(placement: str, fmt: str) -> list[str]:
    ops = _EquationOps(fmt)
    block_program(placement, "x", ops)
    return ops.lines


def block_equation(config, fmt: str = "text", layer: int | None = None) -> str:
    """The block equation of ``config.placement`` (``config``: a
    :class:`normtools.lab.tinylm.TinyLMConfig`), from the same block function that the forward
    pass runs. ``fmt="text"`` gives one assignment per line; ``fmt="latex"`` an ``aligned``
    environment. N is ``config.norm`` (RMSNorm, LayerNorm or DyT).

    ``mix_ln``'s layers differ: ``layer`` picks one; without it both forms are given, each
    after a line naming its layers (``layers 0-0 (post):``)."""
    if config.placement == "mix_ln" and layer is None:
        n_post, parts = config.post_ln_layers, []
        for placement, first, last in (("post", 0, n_post - 1), ("pre", n_post, config.depth - 1)):
            if first <= last:
                head = f"layers {first}-{last} ({placement})"
                parts.append(rf"&\text{{{head}:}}" if fmt == "latex" else f"{head}:")
                parts += _program_lines(placement, fmt)
    else:
        parts = _program_lines(config.layer_placement(layer or 0), fmt)
    if fmt == "latex":
        return r"\begin{aligned}" + r" \\ ".join(parts) + r"\end{aligned}"
    return "\n".join(parts)


def norm_names(placement: str) -> list[str]:
    """The names of the norms a block of this placement uses, in the order it applies them."""
    ops = _EquationOps("text")
    block_program(placement, "x", ops)
    return ops.norm_names
