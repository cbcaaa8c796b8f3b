"""Chapter 1's block figure (normtools.book.block_figure): each panel draws as many norms as the
TinyLM block of that placement has (normtools.lab.blocks.norm_names), in the order it applies them."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

from normtools.book.block_figure import block_path, draw_blocks
from normtools.lab.blocks import PLACEMENT_NAMES, norm_names


@pytest.mark.parametrize("placement", PLACEMENT_NAMES)
def test_each_panel_draws_one_box_per_norm_of_the_block(placement):
    fig, ax = plt.subplots()
    draw_blocks([ax], [(placement, norm_names(placement))])
    drawn = [t.get_text() for t in ax.texts].count("N")
    plt.close(fig)
    assert drawn == len(norm_names(placement))


def test_paths_put_each_norm_where_its_name_says():
    assert block_path(norm_names("pre")) == "x → N → Attn → + → N → MLP → + → x'"
    assert block_path(norm_names("post")) == "x → Attn → + → N → MLP → + → N → x'"
    assert block_path(norm_names("post_sublayer")) == "x → Attn → N → + → MLP → N → + → x'"
    assert block_path(norm_names("parallel")) == "x → N → Attn|MLP → + → x'"


def test_an_unknown_norm_position_is_refused():
    with pytest.raises(ValueError, match="unknown norm positions"):
        block_path(["attn_sideways"])
