"""TinyLM: a small causal decoder with every norm placement, for the stability lab.

Read it top to bottom like nanoGPT. One block, for each ``placement`` (N is the configured
norm, RMSNorm or LayerNorm; every N is a separate module with its own weight):

    post           x = N(x + Attn(x));        x = N(x + MLP(x))          (original Transformer)
    pre            x = x + Attn(N(x));        x = x + MLP(N(x))          (GPT-2, Llama)
    sandwich       x = x + N(Attn(N(x)));     x = x + N(MLP(N(x)))       (Gemma 2/3, Peri-LN)
    post_sublayer  x = x + N(Attn(x));        x = x + N(MLP(x))          (OLMo 2)
    parallel       x = x + Attn(N(x)) + MLP(N(x)), one shared N           (GPT-J, Cohere, Phi)
    none           x = x + Attn(x);           x = x + MLP(x)

The block is written once, in :func:`block_program`, over a small set of operations (norm,
sublayer, add, assign). The forward pass runs it on tensors; :func:`block_equation` runs the
very same function on strings to print the equation, so the printed form cannot drift from
what the model computes.

Attention: causal, grouped-query (``kv_heads`` ≤ ``heads``), rotary positions (RoPE, rotate-half
convention as in Llama) and explicit logits ``s = q kᵀ / √d`` (no fused kernel), so the probes
can read them: set ``attn.keep_logits = True`` and the pre-mask logits of the last forward pass
are kept in ``attn.logits`` (B, H, T, T). Optional QK-Norm (``qk_norm``): an RMSNorm of q and
k after their projections and before RoPE, over each head (``per_head``, Qwen3/Gemma 3) or
over the whole projection (``per_layer``, OLMo 2); it is always an RMSNorm, as in those models.

MLP: SwiGLU, ``down(silu(gate(x)) * up(x))``, hidden width ≈ 8/3 · width (Llama).

Init (GPT-2 / nanoGPT): every linear and embedding weight ~ N(0, init_std²), init_std = 0.02
by default; with ``scaled_residual_init`` (off by default) the two projections that write into
the residual stream (``o_proj``, ``down_proj``) use std init_std / √(2·depth) instead. Norm
weights start at 1, biases at 0. No biases in linear layers; the embedding and the output head
are not tied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from normtools.core.modules import LayerNorm, RMSNorm
from normtools.core.qk import QKNorm
from normtools.core import _validate

PLACEMENT_NAMES = ("post", "pre", "sandwich", "post_sublayer", "parallel", "none")
NORM_NAMES = ("rms", "layer")
QK_NORM_SCOPES = ("none", "per_head", "per_layer")

#: Size presets: "test" (unit tests), "cpu" (chapters on 2 CPU cores), "gpu" (scaled up).
SIZES = {
    "test": dict(width=32, depth=2, heads=2, max_seq_len=32),
    "cpu": dict(width=128, depth=4, heads=4, max_seq_len=128),
    "gpu": dict(width=512, depth=12, heads=8, kv_heads=4, max_seq_len=512),
}


@dataclass(frozen=True)
class TinyLMConfig:
    """Everything that defines a TinyLM; the forward pass and the printed equation read it."""

    vocab_size: int = 256
    width: int = 128
    depth: int = 4
    heads: int = 4
    kv_heads: int | None = None       # None: as many as heads (multi-head attention)
    mlp_hidden: int | None = None     # None: 8/3 · width rounded up to a multiple of 8
    max_seq_len: int = 128
    placement: str = "pre"
    norm: str = "rms"                 # "rms" (RMSNorm) or "layer" (LayerNorm with bias)
    qk_norm: str = "none"             # "none", "per_head" or "per_layer"
    final_norm: bool | None = None    # None: on for pre, sandwich, post_sublayer, parallel
    eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    scaled_residual_init: bool = False  # True: residual projections std / √(2·depth) (nanoGPT)
    backend: str = "auto"             # normtools backend of every norm: "auto", "torch", "triton"

    def __post_init__(self):
        _check_choice("placement", self.placement, PLACEMENT_NAMES)
        _check_choice("norm", self.norm, NORM_NAMES)
        _check_choice("qk_norm", self.qk_norm, QK_NORM_SCOPES)
        if self.width % self.heads:
            raise ValueError(f"width ({self.width}) must be divisible by heads ({self.heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if self.heads % self.n_kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.n_kv_heads})")
        if min(self.vocab_size, self.depth, self.max_seq_len) < 1:
            raise ValueError("vocab_size, depth and max_seq_len must be positive")
        _validate.check_eps(self.eps)
        _validate.check_backend(self.backend)

    @classmethod
    def from_size(cls, size: str, **overrides) -> "TinyLMConfig":
        """A preset from :data:`SIZES` ("test", "cpu", "gpu") with any field overridden."""
        _check_choice("size", size, tuple(SIZES))
        return cls(**{**SIZES[size], **overrides})

    def replace(self, **changes) -> "TinyLMConfig":
        """A copy with some fields changed (e.g. ``config.replace(placement="post")``)."""
        return replace(self, **changes)

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def n_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def hidden(self) -> int:
        return self.mlp_hidden or 8 * ((8 * self.width // 3 + 7) // 8)

    @property
    def has_final_norm(self) -> bool:
        if self.final_norm is None:
            return self.placement in ("pre", "sandwich", "post_sublayer", "parallel")
        return self.final_norm


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(choices)}")


# ----------------------------------------------------------------------------------------------
# The block, written once


def block_program(placement: str, x, ops):
    """One Transformer block for ``placement``, over the operations that ``ops`` provides:

    ``ops.norm(name, v)``   the norm called ``name`` applied to v
    ``ops.sublayer(f, v)``  the attention (f="attn") or MLP (f="mlp") sublayer applied to v
    ``ops.add(*terms)``     the sum of the terms (a residual connection)
    ``ops.assign(v)``       the new value of the residual stream x

    Norm names: ``attn_in``/``mlp_in`` normalize a sublayer's input, ``attn_out``/``mlp_out``
    its output, ``attn_res``/``mlp_res`` the residual sum; ``in`` is the parallel block's
    shared norm.
    """
    _check_choice("placement", placement, PLACEMENT_NAMES)
    if placement == "parallel":
        h = ops.norm("in", x)
        return ops.assign(ops.add(x, ops.sublayer("attn", h), ops.sublayer("mlp", h)))
    for f in ("attn", "mlp"):
        h = ops.norm(f"{f}_in", x) if placement in ("pre", "sandwich") else x
        h = ops.sublayer(f, h)
        if placement in ("sandwich", "post_sublayer"):
            h = ops.norm(f"{f}_out", h)
        x = ops.add(x, h)
        if placement == "post":
            x = ops.norm(f"{f}_res", x)
        x = ops.assign(x)
    return x


class _EquationOps:
    """Runs :func:`block_program` on strings: each assignment becomes one line."""

    def __init__(self, fmt: str):
        _check_choice("fmt", fmt, ("text", "latex"))
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


def block_equation(config: TinyLMConfig, fmt: str = "text") -> str:
    """The block equation of ``config.placement``, from the same :func:`block_program` that
    the forward pass runs. ``fmt="text"`` gives one assignment per line; ``fmt="latex"`` an
    ``aligned`` environment. N is ``config.norm`` (RMSNorm or LayerNorm)."""
    ops = _EquationOps(fmt)
    block_program(config.placement, "x", ops)
    if fmt == "latex":
        return r"\begin{aligned}" + r" \\ ".join(ops.lines) + r"\end{aligned}"
    return "\n".join(ops.lines)


def norm_names(placement: str) -> list[str]:
    """The names of the norms a block of this placement uses, in the order it applies them."""
    ops = _EquationOps("text")
    block_program(placement, "x", ops)
    return ops.norm_names


# ----------------------------------------------------------------------------------------------
# Modules


def make_norm(config: TinyLMConfig) -> nn.Module:
    """The configured normtools norm (RMSNorm, or LayerNorm with bias) over the model width."""
    if config.norm == "rms":
        norm = RMSNorm(config.width, config.eps)
    else:
        norm = LayerNorm(config.width, config.eps)
    norm.backend = config.backend
    return norm


def causal_mask(T: int, device=None) -> torch.Tensor:
    """(T, T) bool, True where query i may attend key j (j ≤ i)."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, shape (seq_len, head_dim): position t, pair i
    (columns i and i + head_dim/2) turns by t · theta^(−2i/head_dim)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x_i, x_{i+d/2}) of the last dim by its angle: x·cos + rotate_half(x)·sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class CausalSelfAttention(nn.Module):
    """softmax(mask(q kᵀ / √d)) v with RoPE, grouped-query heads and optional QK-Norm."""

    def __init__(self, config: TinyLMConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.heads, config.n_kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.width, bias=False)
        self.qk_norm = None
        if config.qk_norm != "none":
            self.qk_norm = QKNorm(self.head_dim, self.heads, self.kv_heads, scope=config.qk_norm,
                                            eps=config.eps, backend=config.backend)
        cos, sin = rope_tables(config.max_seq_len, self.head_dim, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.keep_logits = False
        self.logits: torch.Tensor | None = None
        self.logit_mask: torch.Tensor | None = None   # None: the causal mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)       # (B, T, heads·d), ...
        if self.qk_norm is not None:
            q, k = self.qk_norm(q, k)
        q = q.view(B, T, self.heads, self.head_dim).transpose(1, 2)    # (B, H, T, d)
        k = k.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = self.heads // self.kv_heads                            # query heads per kv head
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        logits = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, H, T, T)
        if self.keep_logits:
            self.logits = logits.detach()
        probs = torch.softmax(logits.masked_fill(~causal_mask(T, x.device), float("-inf")).float(), dim=-1)
        y = probs.to(v.dtype) @ v                                      # (B, H, T, d)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) ⊙ up(x))."""

    def __init__(self, config: TinyLMConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.width, config.hidden, bias=False)
        self.up_proj = nn.Linear(config.width, config.hidden, bias=False)
        self.down_proj = nn.Linear(config.hidden, config.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One decoder layer: ``self_attn``, ``mlp`` and the norms its placement names."""

    def __init__(self, config: TinyLMConfig):
        super().__init__()
        self.placement = config.placement
        self.self_attn = CausalSelfAttention(config)
        self.mlp = SwiGLU(config)
        self.norms = nn.ModuleDict({name: make_norm(config) for name in norm_names(config.placement)})

    def norm(self, name, v):
        return self.norms[name](v)

    def sublayer(self, f, v):
        return self.self_attn(v) if f == "attn" else self.mlp(v)

    def add(self, *terms):
        return sum(terms[1:], terms[0])

    def assign(self, v):
        return v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return block_program(self.placement, x, self)


class TinyLM(nn.Module):
    """Embedding → ``depth`` blocks (``self.layers``) → optional final norm → output head.

    ``TinyLM(config)`` or ``TinyLM(placement="post", depth=24, ...)`` (keyword arguments
    override the config, or the defaults of :class:`TinyLMConfig`).
    """

    def __init__(self, config: TinyLMConfig | None = None, **overrides):
        super().__init__()
        config = (config or TinyLMConfig()).replace(**overrides)
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.width)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.depth))
        self.final_norm = make_norm(config) if config.has_final_norm else nn.Identity()
        self.lm_head = nn.Linear(config.width, config.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self):
        """GPT-2 init: N(0, std²) weights; residual projections std/√(2·depth) if scaled."""
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.depth) if self.config.scaled_residual_init else std
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                is_residual = name.endswith(("o_proj", "down_proj"))
                nn.init.normal_(module.weight, mean=0.0, std=residual_std if is_residual else std)

    def block_equation(self, fmt: str = "text") -> str:
        """The equation of one block, as :func:`block_equation` prints it for this config."""
        return block_equation(self.config, fmt)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits (B, T, vocab) for token ids (B, T); with targets, also the mean cross-entropy."""
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (batch, seq), got {tuple(idx.shape)}")
        if idx.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds max_seq_len {self.config.max_seq_len}")
        x = self.embed(idx)
        for block in self.layers:
            x = block(x)
        logits = self.lm_head(self.final_norm(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss


def set_backend(model: nn.Module, backend: str) -> nn.Module:
    """Switch every normtools norm of ``model`` (RMSNorm, LayerNorm, QKNorm) to ``backend``."""
    _validate.check_backend(backend)
    norm_types = (RMSNorm, LayerNorm, QKNorm)
    for module in model.modules():
        if isinstance(module, norm_types):
            module.backend = backend
    if isinstance(model, TinyLM):
        model.config = model.config.replace(backend=backend)
    return model
