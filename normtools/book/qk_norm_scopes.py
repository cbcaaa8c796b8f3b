"""What each QK-Norm scope normalizes: the elements one statistic covers, and each head's RMS.

* :func:`statistic_footprint`: which elements of a (T, H, d) projection feed the statistic of
  one element, read from the gradient of ``normtools.qk_norm``; :func:`draw_statistic_footprint`
  draws that region (chapter 2).
* :func:`head_rms`: each head's RMS of a (..., H·head_dim) projection, the quantity that a
  per-head QK-Norm sets to 1 and a per-layer one leaves free (chapter 3).
"""

import torch

from normtools.core import validate
from normtools.core.qk import qk_norm


def statistic_footprint(scope: str, tokens: int, heads: int, head_dim: int, at=(0, 0, 0)) -> torch.Tensor:
    """Bool (tokens, heads, head_dim): the elements of q whose value changes the output of
    ``normtools.qk_norm`` at element ``at`` = (token, head, feature), i.e. the features that one
    statistic covers under ``scope``. Read from the gradient of that one output (reference
    backend, float32 random q); the element itself is included."""
    q = torch.randn(tokens, heads, head_dim, requires_grad=True)
    k = torch.randn(tokens, head_dim)  # one key head: its weight has head_dim entries either way
    q_width = head_dim if scope == "per_head" else heads * head_dim
    q_out, _ = qk_norm(q.flatten(-2), k, torch.ones(q_width), torch.ones(head_dim), 1e-6,
                       head_dim=head_dim, scope=scope, backend="torch")
    (grad,) = torch.autograd.grad(q_out.view(tokens, heads, head_dim)[at], q)
    footprint = grad != 0
    footprint[at] = True
    return footprint


def draw_statistic_footprint(ax, footprint: torch.Tensor, title: str) -> None:
    """Draw a (T, H, d) footprint as T rows of H·d cells, heads separated by thick lines, the
    covered cells shaded."""
    tokens, heads, head_dim = footprint.shape
    ax.imshow(footprint.reshape(tokens, heads * head_dim).float().numpy(), cmap="Blues", vmin=-0.3,
              vmax=1.2, aspect="equal", interpolation="nearest")
    ax.set_xticks([h * head_dim + (head_dim - 1) / 2 for h in range(heads)],
                  [f"head {h}" for h in range(heads)])
    ax.set_yticks(range(tokens), [f"token {t}" for t in range(tokens)])
    ax.set_xticks([x - 0.5 for x in range(heads * head_dim + 1)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(tokens + 1)], minor=True)
    ax.grid(which="minor", color="white", lw=0.8)
    ax.grid(which="major", visible=False)
    ax.tick_params(which="minor", length=0)
    for h in range(heads + 1):
        ax.axvline(h * head_dim - 0.5, color="black", lw=2)
    ax.set_title(title)


def head_rms(x, head_dim):
    """RMS of each head of x (..., H·head_dim), in float32: shape (..., H).

    rms_h = sqrt(mean over the head's head_dim features of x²)
    """
    validate.check_input(x)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    if x.shape[-1] % head_dim:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of head_dim={head_dim}")
    heads = x.to(torch.float32).unflatten(-1, (x.shape[-1] // head_dim, head_dim))
    return heads.pow(2).mean(-1).sqrt()
