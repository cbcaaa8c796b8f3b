"""What every chapter does in its first cells: deterministic setup and glued numbers.

A chapter calls :func:`setup` once, after its ``parameters`` cell::

    device = normtools.book.notebook.setup(seed=0, threads=2)

and publishes numbers for its prose with :func:`glue_number`, so that no figure in the text is
typed by hand. Its conditions cell shows :func:`normtools.core.sysinfo.environment_versions`.

The environment variable ``NORMBOOK_THREADS`` overrides every chapter's ``threads`` parameter
(CI reruns nbval with ``NORMBOOK_THREADS=1`` to check that the stored outputs do not depend on it).
"""

import os
import random
import warnings

import numpy as np
import torch


def _select_device(requested: str = "auto") -> torch.device:
    """CUDA when present (or when asked for), else CPU."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA device is available")
    return device


def setup(seed: int = 0, threads: int = 2, device: str = "auto") -> torch.device:
    """Seed every generator, fix the CPU thread count, quiet known warnings, set plot defaults.

    ``NORMBOOK_THREADS``, when set, replaces ``threads``. Returns the device the chapter should
    run on (CUDA when present, else CPU).
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(int(os.environ.get("NORMBOOK_THREADS", threads)))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\..*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    try:
        import matplotlib

        matplotlib.rcParams.update(
            {"figure.dpi": 100, "savefig.dpi": 100, "figure.figsize": (7.0, 3.6),
             "axes.grid": True, "grid.alpha": 0.3}
        )
        # Identical bytes from run to run: no date or version in the embedded PNG metadata.
        matplotlib.rcParams["svg.hashsalt"] = "normbook"
    except ImportError:
        pass
    return _select_device(device)


def glue_number(name: str, value: float, fmt: str = "{:.3g}") -> str:
    """Format ``value`` with ``fmt`` and glue the string under ``name`` for the prose ({glue:text}`name`)."""
    from myst_nb import glue

    text = fmt.format(value)
    glue(name, text, display=False)
    return text


def legend_below(fig, axis, ncol: int = 2):
    """Draw ``axis``'s legend under the whole figure, in the figure's text size, centred.

    A legend beside the axes (``bbox_to_anchor=(1, 1)``) widens the saved image and narrows the
    axes: at phone width (390 px) the image is scaled down until the legend's text is about 5 px
    tall, and a long title over the narrowed axes runs into the y-label. Under the figure it
    takes the figure's width instead. Call it after ``fig.tight_layout()``; the legend's top sits
    at the lowest point of any axes' drawn box (x-label and tick labels included). Returns it.
    """
    renderer = fig.canvas.get_renderer()
    to_figure = fig.transFigure.inverted()
    bottom = min(ax.get_tightbbox(renderer).transformed(to_figure).y0 for ax in fig.axes)
    handles, labels = axis.get_legend_handles_labels()
    return fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, bottom),
                      ncol=ncol, frameon=False)


class _FullTable:
    """A table shown by Jupyter as HTML with every cell in full; see :func:`full_table`."""

    def __init__(self, df, name: str):
        self.df, self.name = df, name

    def _repr_html_(self) -> str:
        return self.df.style.set_uuid(self.name).to_html()

    def __repr__(self) -> str:
        rows, columns = self.df.shape
        return f"<table {self.name}: {rows} rows x {columns} columns>"


def full_table(df, name: str) -> _FullTable:
    """``df`` as an HTML table with every cell in full (a displayed DataFrame cuts cells at
    ``display.max_colwidth`` characters), for tables of long strings such as norm cards.

    The HTML's element ids are fixed by ``name`` and the plain-text form names the table and
    its size, so the stored outputs are the same at every run and nbval can compare them.
    Numbers should be formatted before (strings here).
    """
    return _FullTable(df, name)
