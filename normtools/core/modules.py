"""``RMSNorm`` and ``LayerNorm`` modules over the normtools ops.

Both have a ``backend`` attribute ("auto", "torch" or "triton"; ``normtools.patch`` sets it).
"""

import torch
from torch import nn

from normtools.core import validate
from normtools.core.ops import layer_norm, rms_norm

__all__ = ["RMSNorm", "LayerNorm"]


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension: y = (offset + weight) ⊙ x · rsqrt(mean(x², -1) + eps).

    ``offset=1`` is the Gemma convention of a zero-centred weight: the weight is initialized to
    zeros so that the scale starts at 1; otherwise it is initialized to ones. ``casting`` is
    "llama" or "gemma" (see ``normtools.rms_norm``).
    """

    def __init__(self, dim, eps=1e-6, *, offset=0.0, casting="llama", device=None, dtype=None):
        super().__init__()
        validate.check_eps(eps)
        validate.check_offset(offset)
        validate.check_casting(casting)
        self.eps, self.offset, self.casting = eps, offset, casting
        self.backend = "auto"
        init = torch.zeros if offset == 1 else torch.ones
        self.weight = nn.Parameter(init(dim, device=device, dtype=dtype))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps, offset=self.offset, casting=self.casting,
                        backend=self.backend)

    def extra_repr(self):
        return (f"{self.weight.shape[0]}, eps={self.eps}, offset={self.offset}, "
                f"casting={self.casting!r}, backend={self.backend!r}")


class LayerNorm(nn.Module):
    """LayerNorm over the last dimension: y = (x − mean) · rsqrt(var + eps) ⊙ weight + bias,
    with float32 statistics. ``bias=False`` drops the bias (as ``nn.LayerNorm(bias=False)``)."""

    def __init__(self, dim, eps=1e-5, *, bias=True, device=None, dtype=None):
        super().__init__()
        validate.check_eps(eps)
        self.eps = eps
        self.backend = "auto"
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, x):
        return layer_norm(x, self.weight, self.bias, self.eps, backend=self.backend)

    def extra_repr(self):
        return (f"{self.weight.shape[0]}, eps={self.eps}, bias={self.bias is not None}, "
                f"backend={self.backend!r}")
