"""Each chapter's experiment sizes: ``"cpu"`` (2 CPU cores, the stored outputs) and ``"gpu"`` (a
GPU), and the gpu sizes divided by a chapter's ``gpu_shrink`` parameter.

A size table is a dict {size: settings}. The chapters' own tables are :data:`CHAPTER_SIZES`; the
settings of chapters 4a and 7 live with the lab code that runs them (``grid.STABILITY_SIZES``,
``designs.RELATED_SIZES``, which the lab's CLI also reads). Every chapter reads its settings the
same way, as a copy: ``sizes.chapter_settings("05", size, gpu_shrink)``, or for a lab table
``sizes.settings_at(grid.STABILITY_SIZES, "stability", size, gpu_shrink)``, and passes them to
the lab functions it calls; no table is ever changed. ``gpu_shrink`` (default 1: the gpu sizes as they are) divides every size marked
shrinkable, so that ``tests/book/test_gpu_path.py`` runs a chapter's ``size="gpu"`` code path on a
CPU in seconds and that path cannot rot unseen. A shrunk value is ``value // gpu_shrink``
rounded down to a multiple of its floor and never below it, so that widths stay divisible by
their head counts (the floors are multiples of them) and nothing reaches zero::

    shrunk(v) = max(floor, ⌊⌊v / k⌋ / floor⌋ · floor)        (k = gpu_shrink > 1)
"""

import copy

__all__ = ["CHAPTER_SIZES", "SHRINK_FLOORS", "chapter_settings", "settings_at", "shrink"]

#: {chapter: {"cpu": settings, "gpu": settings}}; chapter 6 has no size-dependent cell.
CHAPTER_SIZES = {
    "01": {
        "cpu": dict(cost_n=4096, time_shape={"M": 256, "N": 4096}, time_reps=60, amp_width=64),
        "gpu": dict(cost_n=4096, time_shape={"M": 4096, "N": 4096}, time_reps=200,
                    amp_width=512),
    },
    "02": {
        "cpu": dict(width=64, depth=12, heads=4, batch=8, seq_len=64, hf_hidden=64,
                    hf_layers=12, growth_depths=(2, 4, 8, 16, 32), growth_seeds=(0, 1, 2)),
        "gpu": dict(width=512, depth=48, heads=8, batch=16, seq_len=256, hf_hidden=512,
                    hf_layers=48, growth_depths=(3, 6, 12, 24, 48, 96),
                    growth_seeds=(0, 1, 2, 3, 4)),
    },
    "03": {
        "cpu": dict(rows=64, qk_tokens=32),
        "gpu": dict(rows=4096, qk_tokens=1024),
    },
    "04b": {   # parity input batch × tokens × features; the model step's batch and samples
        "cpu": dict(parity=dict(batch=4, tokens=16, features=256),
                    model_steps=dict(batch=2, seq=64, warmup=2, reps=20)),
        "gpu": dict(parity=dict(batch=8, tokens=1024, features=4096),
                    model_steps=dict(batch=4, seq=2048, warmup=5, reps=100)),
    },
    "05": {
        "cpu": dict(model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               vocab_size=128),
                    batch=2, seq_len=16),
        "gpu": dict(model=dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                               num_attention_heads=16, num_key_value_heads=8, head_dim=64,
                               vocab_size=4096),
                    batch=8, seq_len=256),
    },
    "06": {"cpu": {}, "gpu": {}},
}

#: The shrinkable sizes of each settings table and their floors (absent: kept as they are).
#: Head counts, depth lists and seeds are kept; widths have floors that their heads divide.
SHRINK_FLOORS = {
    "01": dict(time_shape={"M": 64, "N": 256}, time_reps=5, amp_width=16),
    "02": dict(width=32, depth=2, batch=1, seq_len=8, hf_hidden=32, hf_layers=2),
    "03": dict(rows=16, qk_tokens=8),
    "04b": dict(parity=dict(batch=1, tokens=16, features=256),
                model_steps=dict(batch=1, seq=16, warmup=1, reps=5)),
    "05": dict(model=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                          vocab_size=128),
               batch=1, seq_len=8),
    "06": {},
    # normtools.lab.grid.STABILITY_SIZES["gpu"] (chapter 4a): 8 heads divide 32
    "stability": dict(model=dict(width=32, depth=2, max_seq_len=16), steps=10, batch_size=2,
                      xiong=dict(model=dict(width=32, max_seq_len=16), batch_size=2)),
    # normtools.lab.designs.RELATED_SIZES["gpu"] (chapter 7): 4 and 8 heads divide 32
    # (steps: more than the adapted spike score's window of 50)
    "related": dict(probe_model=dict(width=32, depth=4, max_seq_len=16), probe_batch_size=2,
                    model=dict(width=32, depth=2, max_seq_len=16), steps=60, batch_size=2),
}


def shrink(settings: dict, floors: dict, gpu_shrink: int) -> dict:
    """A copy of ``settings`` with every size named in ``floors`` divided by ``gpu_shrink``
    (see the module docstring); nested dicts are shrunk by the nested floors."""
    if not isinstance(gpu_shrink, int) or gpu_shrink < 1:
        raise ValueError(f"gpu_shrink must be a positive integer, got {gpu_shrink!r}")
    unknown = set(floors) - set(settings)
    if unknown:
        raise KeyError(f"floors for sizes that the settings do not have: {sorted(unknown)}")
    out = copy.deepcopy(settings)
    if gpu_shrink == 1:
        return out
    for key, floor in floors.items():
        if isinstance(floor, dict):
            out[key] = shrink(settings[key], floor, gpu_shrink)
        else:
            out[key] = max(floor, settings[key] // gpu_shrink // floor * floor)
    return out


def settings_at(table: dict, kind: str, size: str = "cpu", gpu_shrink: int = 1) -> dict:
    """A copy of ``table[size]`` (``table``: {"cpu": settings, "gpu": settings}); the gpu settings
    divided by ``gpu_shrink`` within the floors ``SHRINK_FLOORS[kind]`` (the cpu ones never are:
    they make the stored outputs). ``table`` is left as it is."""
    if size not in ("cpu", "gpu"):
        raise ValueError(f"size must be 'cpu' or 'gpu', got {size!r}")
    if size == "cpu":
        return copy.deepcopy(table[size])
    return shrink(table[size], SHRINK_FLOORS[kind], gpu_shrink)


def chapter_settings(chapter: str, size: str = "cpu", gpu_shrink: int = 1) -> dict:
    """The settings of ``chapter`` ("01", "02", ...) at ``size``: :func:`settings_at` of
    ``CHAPTER_SIZES[chapter]``."""
    return settings_at(CHAPTER_SIZES[chapter], chapter, size, gpu_shrink)
