"""The amplifier analogy of chapter 1: a signal through a chain of random linear stages, with or
without a leveller after each stage.

Each stage A_i has entries N(0, gain²/width), so that it multiplies the mean square of a signal
by gain² in expectation; after d stages the RMS has grown (or shrunk) like gain^d, unless a
leveller (a norm) brings it back after every stage.
"""

from __future__ import annotations

import torch


def random_amplifiers(depth: int, width: int, gain: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """``depth`` random stages (depth, width, width), float32 entries N(0, gain²/width): each stage
    multiplies the mean square of a signal by gain² in expectation, with a random deviation."""
    if depth < 1 or width < 1 or gain <= 0:
        raise ValueError(f"depth and width must be positive and gain > 0, got {depth}, {width}, {gain}")
    return torch.randn(depth, width, width, generator=generator) * (gain / width**0.5)


def signal_through_stages(x: torch.Tensor, amplifiers: torch.Tensor, level=None) -> torch.Tensor:
    """RMS of the signal at the input and after each stage: x ← A_i x, then x ← level(x) when a
    leveller is given (e.g. ``normtools.rms_norm``), in float32. Returns a (depth + 1,) tensor."""
    if amplifiers.dim() != 3 or amplifiers.shape[1:] != (x.shape[-1], x.shape[-1]):
        raise ValueError(f"amplifiers must be (depth, {x.shape[-1]}, {x.shape[-1]}), got {tuple(amplifiers.shape)}")
    x = x.to(torch.float32)
    levels = [x.pow(2).mean().sqrt()]
    for a in amplifiers:
        x = x @ a.T
        if level is not None:
            x = level(x)
        levels.append(x.pow(2).mean().sqrt())
    return torch.stack(levels)
