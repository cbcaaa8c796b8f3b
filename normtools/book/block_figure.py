"""One Transformer block drawn once per placement of its norms (chapter 1's figure).

A block has two sublayers, attention then MLP, each on a branch of the residual stream,
x ← x + F(x). A norm N sits where :func:`normtools.lab.blocks.norm_names` says: on the branch
before the sublayer (``attn_in``, ``mlp_in``), on the branch after it (``attn_out``,
``mlp_out``), or on the stream after the add (``attn_res``, ``mlp_res``). The parallel block has
one norm (``in``) read by both sublayers, whose outputs join the stream at one add.
"""

from matplotlib.patches import FancyBboxPatch

SUBLAYERS = {"attn": "Attn", "mlp": "MLP"}
_POSITIONS = {f"{s}_{where}" for s in SUBLAYERS for where in ("in", "out", "res")} | {"in"}
_STREAM_X, _BRANCH_X = 0.22, 0.66
_SIDE_BY_SIDE_X = (0.47, 0.85)  # the parallel block's Attn and MLP
_NORM_COLOR, _SUBLAYER_COLOR = "#f4a261", "#e6e6e6"


def block_steps(norm_names):
    """The steps from x to x', in order: (label, lane) with label "N" (a norm), "Attn", "MLP",
    "Attn|MLP" (both side by side) or "+" (the residual add), and lane "stream" or "branch"."""
    unknown = set(norm_names) - _POSITIONS
    if unknown:
        raise ValueError(f"unknown norm positions {sorted(unknown)}; known: {sorted(_POSITIONS)}")
    if "in" in norm_names:
        if len(norm_names) != 1:
            raise ValueError(f"the parallel block has one norm, 'in', got {list(norm_names)}")
        return [("N", "branch"), ("Attn|MLP", "branch"), ("+", "stream")]
    steps = []
    for sublayer, label in SUBLAYERS.items():
        if f"{sublayer}_in" in norm_names:
            steps.append(("N", "branch"))
        steps.append((label, "branch"))
        if f"{sublayer}_out" in norm_names:
            steps.append(("N", "branch"))
        steps.append(("+", "stream"))
        if f"{sublayer}_res" in norm_names:
            steps.append(("N", "stream"))
    return steps


def block_path(norm_names):
    """The block as text, x → ... → x' (the steps of :func:`block_steps`)."""
    return " → ".join(["x", *(label for label, _ in block_steps(norm_names)), "x'"])


def _box(ax, x, y, label, width, color):
    ax.add_patch(FancyBboxPatch((x - width / 2, y - 0.3), width, 0.6, boxstyle="round,pad=0.02",
                                facecolor=color, edgecolor="black", lw=0.8, zorder=3))
    ax.text(x, y, label, ha="center", va="center", fontsize=11, zorder=4,
            fontweight="bold" if label == "N" else "normal")


def draw_block(ax, norm_names, title, top=None):
    """Draw one block on ``ax``, bottom (x) to top (x'): the stream on the left, the branches on
    the right, norms in orange. ``top`` is the y-range to share between panels (default: this
    block's height)."""
    steps = block_steps(norm_names)
    end = len(steps) + 1
    ax.plot([_STREAM_X, _STREAM_X], [0, end], color="black", lw=1.2, zorder=1)
    ax.annotate("", (_STREAM_X, end + 0.35), (_STREAM_X, end), zorder=1,
                arrowprops={"arrowstyle": "->", "lw": 1.2})
    ax.text(_STREAM_X, -0.35, "x", ha="center", va="top", fontsize=11)
    ax.text(_STREAM_X, end + 0.45, "x'", ha="center", va="bottom", fontsize=11)
    branch_start = None
    for y, (label, lane) in enumerate(steps, start=1):
        if lane == "branch" and branch_start is None:
            branch_start = y - 0.5
        if label == "+":
            ax.plot([_STREAM_X, _BRANCH_X, _BRANCH_X, _STREAM_X],
                    [branch_start, branch_start, y, y], color="black", lw=1.2, zorder=1)
            ax.plot(_STREAM_X, y, "o", ms=14, mfc="white", mec="black", zorder=3)
            ax.text(_STREAM_X, y, "+", ha="center", va="center", fontsize=11, zorder=4)
            branch_start = None
        elif label == "Attn|MLP":
            for x, sublayer in zip(_SIDE_BY_SIDE_X, SUBLAYERS.values()):
                ax.plot([_BRANCH_X, x, x, _BRANCH_X], [y - 0.5, y - 0.5, y + 0.5, y + 0.5],
                        color="black", lw=1.2, zorder=1)
                _box(ax, x, y, sublayer, 0.34, _SUBLAYER_COLOR)
        else:
            x = _STREAM_X if lane == "stream" else _BRANCH_X
            _box(ax, x, y, label, 0.3 if label == "N" else 0.5,
                 _NORM_COLOR if label == "N" else _SUBLAYER_COLOR)
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(-1.0, (top or end) + 1.0)
    ax.set_title(title, fontsize=11)
    ax.axis("off")


def draw_blocks(axes, blocks):
    """Draw ``blocks``, a list of (title, norm names), one per axes, on a shared height."""
    top = max(len(block_steps(names)) + 1 for _, names in blocks)
    for ax, (title, names) in zip(axes, blocks, strict=True):
        draw_block(ax, names, title, top)
