"""TinyLM: a small causal decoder with every norm placement, for the stability lab.

Read it top to bottom like nanoGPT. The block of each ``placement`` (post, pre, sandwich,
post_sublayer, parallel, none, and chapter 7's deepnorm, admin, mix_ln, lns and ngpt) is one
short function in :mod:`normtools.lab.blocks`, with its equation; :class:`Block` runs it on
tensors. N is the configured norm (RMSNorm, LayerNorm or ``dyt``). What the designs of chapter 7
add to the model:

* DeepNorm (Wang et al. 2022, decoder-only constants): α = (2·depth)^(1/4), and the init std of
  ``v_proj``, ``o_proj`` and the MLP's three projections is multiplied by β = (8·depth)^(−1/4).
* Admin (Liu et al. 2020, "Understanding the Difficulty of Training Transformers"): Post-LN
  with a learned per-feature residual weight ω_i for every sublayer i (attention and MLP of
  each layer, in order), set by one profiling forward pass at initialization
  (:meth:`TinyLM.initialize_from_data`), as the authors' code (Transformer-Clinic,
  ``adaptive-profiling``) does it: ω_1 = 1 and, sublayer after sublayer,

      ω_{i+1} = sqrt(Var[ω_i ⊙ x_{i−1}] + Var[f_i(x_{i−1})])    (variances over all elements)

  with the ω already set (each x_{i−1} = N(…) of unit variance for i > 1, so ω_i² =
  Var[x_0] + Σ_{1≤j<i} Var[f_j(x_{j−1})]: the paper's ω_i = sqrt(Σ_{j<i} Var[f_j]) with the
  input as the term j = 0). Before that pass ω = 1 (plain Post-LN).
* nGPT (Loshchilov et al. 2025, "nGPT: Normalized Transformer with Representation Learning on
  the Hypersphere"): S(v) = v / ‖v‖ over the embedding dimension. Every hidden state is on the
  unit sphere; so is every row of the embedding, of the output head and of every matrix along
  its embedding dimension (q/k/v/gate/up: the input rows; o/down: the output columns), put
  there at initialization and after every optimizer step (:meth:`TinyLM.normalize_weights`,
  which :func:`normtools.lab.train.train` calls after each step). Attention: q and k are
  normalized per head after RoPE and scaled by s_qk, and the softmax scale is √d_k (not
  1/√d_k). MLP: u = s_u ⊙ up(h), ν = s_v ⊙ gate(h) · √width, out = down(u ⊙ silu(ν)). Logits:
  s_z ⊙ (h · E_outᵀ). No final norm and no norm weights. The learned vectors use the paper's
  parameterization (a stored p = s_scale · s/s_init, read as s = p · s_init/s_scale):
  α_A, α_M (init 0.05 = ``ngpt_alpha``, scale 1/√width), s_qk (init 1, scale 1/√width), s_u,
  s_v (init 1, scale 1), s_z (init 1, scale 1/√width). Left out: the paper trains without
  weight decay and warm-up; TinyLM trains every design with the same loop (AdamW with weight
  decay 0.1 on matrices, 10 % warm-up), and its eigen learning rates are not passed through
  |·| (the authors' code takes their absolute value).
* ``norm="dyt"``: Dynamic Tanh (Zhu et al. 2025), DyT(x) = w ⊙ tanh(α·x) + b with α one learned
  scalar (init ``dyt_alpha``), in place of every block norm and the final norm (QK-Norm stays
  an RMSNorm).

Attention: causal, grouped-query (``kv_heads`` ≤ ``heads``), rotary positions (RoPE, rotate-half
convention as in Llama) and explicit logits ``s = q kᵀ / √d`` (no fused kernel), so the probes
can read them: set ``attn.keep_logits = True`` and the pre-mask logits of the last forward pass
are kept in ``attn.logits`` (B, H, T, T). Optional QK-Norm (``qk_norm``): an RMSNorm of q and
k after their projections and before RoPE, over each head (``per_head``, Qwen3/Gemma 3) or
over the whole projection (``per_layer``, OLMo 2); it is always an RMSNorm, as in those models.
Optional soft-capping (``attn_softcap`` = c, Gemma 2): the softmax sees c · tanh(s / c), so
every logit it sees lies in (−c, c); ``attn.logits`` keeps s itself, before the cap.

MLP: SwiGLU, ``down(silu(gate(x)) * up(x))``, hidden width ≈ 8/3 · width (Llama); with
``mlp="relu"`` the original FFN ``down(relu(up(x)))``, hidden width 4 · width.

Init (GPT-2 / nanoGPT; ``init_scheme="xavier"``: every linear layer Glorot-normal instead,
std √(2 / (fan_in + fan_out))): every linear and embedding weight ~ N(0, init_std²), init_std = 0.02
by default (``embed_std``, when set, replaces it for the embedding: 1.0 gives embeddings of unit
RMS, the initialization OLMo 2 §3.4.2 and Xiong et al. assume); with ``scaled_residual_init`` (off by default) the two projections that write into
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
from normtools.core.ops import rms_norm
from normtools.core.qk import QKNorm
from normtools.core.reference import rope_reference, rope_tables
from normtools.core import validate
from normtools.lab.blocks import (PLACEMENT_NAMES, RELATED_PLACEMENTS, block_equation, block_program,
                                  norm_names)

_NORM_NAMES = ("rms", "layer", "dyt")
_QK_NORM_SCOPES = ("none", "per_head", "per_layer")

#: The smallest useful TinyLM (:meth:`TinyLMConfig.tiny`: unit tests, chapter 1's printouts). The
#: sizes of the chapters' experiments are the chapters' settings (``normtools.book.sizes``).
_TINY = dict(width=32, depth=2, heads=2, max_seq_len=32)


@dataclass(frozen=True)
class TinyLMConfig:
    """Everything that defines a TinyLM; the forward pass and the printed equation read it."""

    vocab_size: int = 256
    width: int = 128
    depth: int = 4
    heads: int = 4
    kv_heads: int | None = None       # None: as many as heads (multi-head attention)
    mlp_hidden: int | None = None     # None: 8/3 · width rounded up to a multiple of 8 (relu: 4 · width)
    mlp: str = "swiglu"               # "swiglu" (Llama) or "relu" (the original Transformer's FFN)
    init_scheme: str = "normal"       # "normal": N(0, init_std²); "xavier": Glorot normal
    max_seq_len: int = 128
    placement: str = "pre"
    norm: str = "rms"                 # "rms" (RMSNorm), "layer" (LayerNorm with bias), "dyt"
    qk_norm: str = "none"             # "none", "per_head" or "per_layer"
    final_norm: bool | None = None    # None: on for pre, sandwich, post_sublayer, parallel
    eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    embed_std: float | None = None    # std of the embedding's init; None: init_std (GPT-2)
    scaled_residual_init: bool = False  # True: residual projections std / √(2·depth) (nanoGPT)
    backend: str = "auto"             # normtools backend of every norm: "auto", "torch", "triton"
    attn_softcap: float | None = None  # c: softmax of c·tanh(s/c) (Gemma 2: 50); None: no cap
    post_ln_fraction: float = 0.25    # mix_ln: the first ⌊fraction · depth⌋ layers are post
    dyt_alpha: float = 0.5            # norm="dyt": initial α of tanh(α·x)
    ngpt_alpha: float = 0.05          # ngpt: initial eigen learning rates α_A, α_M

    def __post_init__(self):
        validate.check_choice("placement", self.placement, PLACEMENT_NAMES + RELATED_PLACEMENTS)
        validate.check_choice("norm", self.norm, _NORM_NAMES)
        validate.check_choice("qk_norm", self.qk_norm, _QK_NORM_SCOPES)
        validate.check_choice("mlp", self.mlp, ("swiglu", "relu"))
        validate.check_choice("init_scheme", self.init_scheme, ("normal", "xavier"))
        if self.mlp == "relu" and self.placement == "ngpt":
            raise ValueError("ngpt's MLP is its scaled SwiGLU; mlp must stay 'swiglu'")
        if self.width % self.heads:
            raise ValueError(f"width ({self.width}) must be divisible by heads ({self.heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if self.heads % self.n_kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.n_kv_heads})")
        if min(self.vocab_size, self.depth, self.max_seq_len) < 1:
            raise ValueError("vocab_size, depth and max_seq_len must be positive")
        if not 0.0 <= self.post_ln_fraction <= 1.0:
            raise ValueError(f"post_ln_fraction must be in [0, 1], got {self.post_ln_fraction}")
        if self.dyt_alpha <= 0 or self.ngpt_alpha <= 0:
            raise ValueError("dyt_alpha and ngpt_alpha must be positive")
        if self.placement == "ngpt" and self.norm != "rms":
            raise ValueError(f"ngpt's norms are its own (SphereNorm); norm must stay 'rms', got {self.norm!r}")
        if self.placement == "ngpt" and self.qk_norm != "none":
            raise ValueError(f"ngpt normalizes q and k itself; qk_norm must stay 'none', got {self.qk_norm!r}")
        if self.init_std <= 0 or (self.embed_std is not None and self.embed_std <= 0):
            raise ValueError(f"init_std and embed_std must be positive, got {self.init_std}, {self.embed_std}")
        validate.check_eps(self.eps)
        validate.check_backend(self.backend)
        if self.attn_softcap is not None and not self.attn_softcap > 0:
            raise ValueError(f"attn_softcap must be positive or None, got {self.attn_softcap}")

    @classmethod
    def tiny(cls, **overrides) -> "TinyLMConfig":
        """A tiny TinyLM (width 32, depth 2, 2 heads, 32 positions) with any field overridden."""
        return cls(**{**_TINY, **overrides})

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
        if self.mlp_hidden:
            return self.mlp_hidden
        return 4 * self.width if self.mlp == "relu" else 8 * ((8 * self.width // 3 + 7) // 8)

    @property
    def has_final_norm(self) -> bool:
        if self.final_norm is None:
            return self.placement in ("pre", "sandwich", "post_sublayer", "parallel", "mix_ln", "lns")
        return self.final_norm

    @property
    def post_ln_layers(self) -> int:
        """Mix-LN: how many of the first layers are post (⌊post_ln_fraction · depth⌋)."""
        return math.floor(self.post_ln_fraction * self.depth) if self.placement == "mix_ln" else 0

    def layer_placement(self, layer: int) -> str:
        """The block placement of decoder layer ``layer`` (0-based): the configured placement,
        except in ``mix_ln``: ``post`` in its first :attr:`post_ln_layers` layers, then ``pre``."""
        if self.placement != "mix_ln":
            return self.placement
        return "post" if layer < self.post_ln_layers else "pre"


def deepnorm_constants(depth: int) -> tuple[float, float]:
    """DeepNorm's (α, β) for a decoder-only stack of ``depth`` layers (Wang et al. 2022, table
    1): residual weight α = (2·depth)^(1/4), init gain β = (8·depth)^(−1/4)."""
    return (2 * depth) ** 0.25, (8 * depth) ** -0.25


class DyT(nn.Module):
    """Dynamic Tanh (Zhu et al. 2025), a norm-free replacement of a norm layer, elementwise:

        DyT(x) = w ⊙ tanh(α · x) + b,   α one learned scalar (init ``alpha``), w = 1, b = 0.
    """

    def __init__(self, width: int, alpha: float = 0.5):
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(float(alpha)))
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * torch.tanh(self.alpha * x) + self.bias


class SphereNorm(nn.Module):
    """nGPT's normalization, S(v) = v / ‖v‖ over the last dim (d features): the row on the unit
    sphere, computed as a weightless RMSNorm divided by √d, v · rsqrt(mean(v²) + eps) / √d.
    eps is tiny (nGPT divides by ‖v‖ alone): an eps near mean(v²) would leave small rows off
    the sphere, and a unit row has mean(v²) = 1/d."""

    def __init__(self, eps: float = 1e-12, backend: str = "auto"):
        super().__init__()
        self.eps, self.backend = eps, backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, None, self.eps, backend=self.backend) * x.shape[-1] ** -0.5


class ScaledVector(nn.Module):
    """nGPT's parameterization of a learned vector s (Loshchilov et al. 2025, section 2.6):
    stored as ``weight`` = p, initialized to ``scale``, and read as s = p · init / scale, so
    that s starts at ``init`` and an optimizer's step on p moves s by init/scale times as much.
    Calling the module returns s."""

    def __init__(self, size: int, init: float, scale: float):
        super().__init__()
        self.weight = nn.Parameter(torch.full((size,), float(scale)))
        self.gain = init / scale

    def forward(self) -> torch.Tensor:
        return self.weight * self.gain


def _make_norm(config: TinyLMConfig) -> nn.Module:
    """The configured norm over the model width: normtools RMSNorm, LayerNorm with bias, or
    :class:`DyT` (``norm="dyt"``); :class:`SphereNorm` in every ``ngpt`` block."""
    if config.placement == "ngpt":
        return SphereNorm(backend=config.backend)
    if config.norm == "dyt":
        return DyT(config.width, config.dyt_alpha)
    if config.norm == "rms":
        norm = RMSNorm(config.width, config.eps)
    else:
        norm = LayerNorm(config.width, config.eps)
    norm.backend = config.backend
    return norm


def causal_mask(T: int, device=None) -> torch.Tensor:
    """(T, T) bool, True where query i may attend key j (j ≤ i)."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


class CausalSelfAttention(nn.Module):
    """softmax(mask(q kᵀ / √d)) v with RoPE, grouped-query heads and optional QK-Norm.

    In an ``ngpt`` model: q ← s_qk ⊙ S(RoPE(q)) and k ← s_qk ⊙ S(RoPE(k)) per head (S: unit
    norm over head_dim; s_qk one learned vector of width features, seen as (heads, head_dim))
    and the logits are q kᵀ · √d (nGPT's softmax scale)."""

    def __init__(self, config: TinyLMConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.heads, config.n_kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.width, bias=False)
        self.softcap = config.attn_softcap
        self.ngpt = config.placement == "ngpt"
        if self.ngpt:
            self.s_qk = ScaledVector(self.heads * self.head_dim, 1.0, config.width ** -0.5)
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
        q, k = rope_reference(q, cos, sin), rope_reference(k, cos, sin)
        group = self.heads // self.kv_heads                            # query heads per kv head
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if self.ngpt:
            s_qk = self.s_qk().view(self.heads, 1, self.head_dim)       # (H, 1, d)
            q, k = s_qk * F.normalize(q, dim=-1), s_qk * F.normalize(k, dim=-1)
            logits = (q @ k.transpose(-2, -1)) * math.sqrt(self.head_dim)
        else:
            logits = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, H, T, T)
        if self.keep_logits:
            self.logits = logits.detach()
        if self.softcap is not None:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        probs = torch.softmax(logits.masked_fill(~causal_mask(T, x.device), float("-inf")).float(), dim=-1)
        y = probs.to(v.dtype) @ v                                      # (B, H, T, d)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) ⊙ up(x)); in an ``ngpt`` model down(silu(ν) ⊙ u) with
    u = s_u ⊙ up(x) and ν = s_v ⊙ gate(x) · √width (nGPT's scalings)."""

    def __init__(self, config: TinyLMConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.width, config.hidden, bias=False)
        self.up_proj = nn.Linear(config.width, config.hidden, bias=False)
        self.down_proj = nn.Linear(config.hidden, config.width, bias=False)
        self.ngpt = config.placement == "ngpt"
        if self.ngpt:
            self.s_u = ScaledVector(config.hidden, 1.0, 1.0)
            self.s_v = ScaledVector(config.hidden, 1.0, 1.0)
            self.sqrt_width = math.sqrt(config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.ngpt:
            gate, up = self.s_v() * gate * self.sqrt_width, self.s_u() * up
        return self.down_proj(F.silu(gate) * up)


class ReLUMLP(nn.Module):
    """down(relu(up(x))): the original Transformer's FFN (Vaswani et al. 2017; Xiong et al.
    2020 analyse this one), hidden width 4 · width by default."""

    def __init__(self, config: TinyLMConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.width, config.hidden, bias=False)
        self.down_proj = nn.Linear(config.hidden, config.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)))


class Block(nn.Module):
    """One decoder layer: ``self_attn``, ``mlp`` and the norms its placement names. It is the
    ``ops`` of its placement's block function (:data:`normtools.lab.blocks.BLOCKS`) on tensors.

    ``layer`` (0-based) sets the placement of a ``mix_ln`` layer and LayerNorm Scaling's
    ``scales["depth"]`` = 1/√(layer + 1); ``scales["alpha"]`` is DeepNorm's α; an ``ngpt``
    block has its eigen learning rates α_A, α_M in ``rates`` ("attn", "mlp", each a
    :class:`ScaledVector`); an ``admin`` block its residual weights ω in ``omegas`` ("attn",
    "mlp", 1 until :meth:`TinyLM.initialize_from_data` profiles them)."""

    def __init__(self, config: TinyLMConfig, layer: int = 0):
        super().__init__()
        self.placement = config.layer_placement(layer)
        self.self_attn = CausalSelfAttention(config)
        self.mlp = ReLUMLP(config) if config.mlp == "relu" else SwiGLU(config)
        self.norms = nn.ModuleDict({name: _make_norm(config) for name in norm_names(self.placement)})
        self.scales = {"alpha": deepnorm_constants(config.depth)[0], "depth": 1 / math.sqrt(layer + 1)}
        self.rates = nn.ModuleDict()
        if self.placement == "ngpt":
            self.rates.update({f: ScaledVector(config.width, config.ngpt_alpha, config.width ** -0.5)
                               for f in ("attn", "mlp")})
        self.omegas = nn.ParameterDict()
        if self.placement == "admin":
            self.omegas.update({f: nn.Parameter(torch.ones(config.width)) for f in ("attn", "mlp")})
        self.admin_profile: dict | None = None  # set by TinyLM.initialize_from_data while it runs

    def norm(self, name, v):
        return self.norms[name](v)

    def sublayer(self, f, v):
        return self.self_attn(v) if f == "attn" else self.mlp(v)

    def add(self, *terms):
        if self.admin_profile is not None:  # Admin's profiling: ω⊙x and f(x) are the terms
            var = [t.detach().double().var(unbiased=False).item() for t in terms]
            self.admin_profile["sublayer_variance"].append(var[1])
            self.admin_profile["ratio"] = math.sqrt(sum(var))
        return sum(terms[1:], terms[0])

    def assign(self, v):
        return v

    def scale(self, c, v):
        return self.scales[c] * v

    def step(self, f, x, h):
        return x + self.rates[f]() * (h - x)

    def weigh(self, f, v):
        if self.admin_profile is not None:  # ω_i: the ratio the sublayers before it left
            with torch.no_grad():
                self.omegas[f].fill_(self.admin_profile["ratio"])
            self.admin_profile["omega"].append(self.admin_profile["ratio"])
        return self.omegas[f] * v

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
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.depth))
        self.final_norm = _make_norm(config) if config.has_final_norm else nn.Identity()
        self.lm_head = nn.Linear(config.width, config.vocab_size, bias=False)
        if config.placement == "ngpt":  # nGPT's logit scaling s_z
            self.s_z = ScaledVector(config.vocab_size, 1.0, config.width ** -0.5)
        self.reset_parameters()

    def reset_parameters(self):
        """GPT-2 init: N(0, std²) weights; residual projections std/√(2·depth) if scaled;
        ``deepnorm``: v_proj, o_proj and the MLP's projections std·β (:func:`deepnorm_constants`)."""
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.depth) if self.config.scaled_residual_init else std
        beta = deepnorm_constants(self.config.depth)[1] if self.config.placement == "deepnorm" else 1.0
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                is_residual = name.endswith(("o_proj", "down_proj"))
                gain = beta if name.endswith(("v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")) else 1.0
                if name == "embed" and self.config.embed_std is not None:
                    nn.init.normal_(module.weight, mean=0.0, std=self.config.embed_std)
                    continue
                if self.config.init_scheme == "xavier" and isinstance(module, nn.Linear):
                    nn.init.xavier_normal_(module.weight, gain=gain)  # std √(2 / (fan_in + fan_out))
                    continue
                nn.init.normal_(module.weight, mean=0.0, std=gain * (residual_std if is_residual else std))
        self.normalize_weights()

    #: nGPT: the dim of each matrix that is its embedding dimension (the one normalized).
    NGPT_EMBEDDING_DIM = {"embed": 1, "lm_head": 1, "q_proj": 1, "k_proj": 1, "v_proj": 1,
                          "gate_proj": 1, "up_proj": 1, "o_proj": 0, "down_proj": 0}

    @torch.no_grad()
    def normalize_weights(self) -> None:
        """nGPT: put every matrix back on the unit sphere along its embedding dimension
        (:data:`NGPT_EMBEDDING_DIM`: the rows of the embedding and of the output head, the
        input rows of q/k/v/gate/up, the output columns of o/down). Nothing for other
        placements. :func:`normtools.lab.train.train` calls it after every optimizer step."""
        if self.config.placement != "ngpt":
            return
        for name, module in self.named_modules():
            dim = self.NGPT_EMBEDDING_DIM.get(name.rsplit(".", 1)[-1])
            if dim is not None:
                module.weight.copy_(F.normalize(module.weight, dim=dim))

    @torch.no_grad()
    def initialize_from_data(self, idx: torch.Tensor) -> "list[dict] | None":
        """The data-dependent part of the initialization: Admin's profiling pass. For an
        ``admin`` model, one forward pass on the token ids ``idx`` (B, T) that sets each
        sublayer's ω in order (ω_1 = 1, ω_{i+1} = sqrt(Var[ω_i ⊙ x_{i−1}] + Var[f_i(x_{i−1})]),
        module docs) and returns one dict per sublayer (layer, sublayer, omega,
        sublayer_variance); for any other placement it does nothing and returns None."""
        if self.config.placement != "admin":
            return None
        profile = {"ratio": 1.0, "omega": [], "sublayer_variance": []}
        for block in self.layers:
            block.admin_profile = profile
        try:
            self(idx)
        finally:
            for block in self.layers:
                block.admin_profile = None
        return [{"layer": i // 2, "sublayer": ("attn", "mlp")[i % 2], "omega": w, "sublayer_variance": v}
                for i, (w, v) in enumerate(zip(profile["omega"], profile["sublayer_variance"]))]

    def after_optimizer_step(self) -> None:
        """What :func:`normtools.lab.train.train` runs after every optimizer step: nGPT's
        :meth:`normalize_weights` (nothing for other placements)."""
        self.normalize_weights()

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
        if self.config.placement == "ngpt":
            logits = self.s_z() * logits
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss


def set_backend(model: nn.Module, backend: str) -> nn.Module:
    """Switch every normtools norm of ``model`` (RMSNorm, LayerNorm, QKNorm, SphereNorm) to
    ``backend``."""
    validate.check_backend(backend)
    norm_types = (RMSNorm, LayerNorm, QKNorm, SphereNorm)
    for module in model.modules():
        if isinstance(module, norm_types):
            module.backend = backend
    if isinstance(model, TinyLM):
        model.config = model.config.replace(backend=backend)
    return model
