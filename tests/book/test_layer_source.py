"""normtools.book.layer_source (chapter 2's side-by-side forward()) against the installed
transformers: the trimmed listing must call the norms and sublayers in the order a real layer
runs them (forward hooks on a tiny model), keep every norm call and residual add of the source,
and the side-by-side table must keep each listing whole and in order."""

import inspect
import re

import pytest
import torch

from normtools import cards
from normtools.book.layer_source import residual_path_lines, side_by_side

llama = pytest.importorskip("transformers.models.llama.modeling_llama")
olmo2 = pytest.importorskip("transformers.models.olmo2.modeling_olmo2")

LAYERS = {"llama": llama.LlamaDecoderLayer, "olmo2": olmo2.Olmo2DecoderLayer}


def _called_modules(lines):
    return [name for line in lines for name in re.findall(r"self\.(\w+)\(", line)]


def _run_order(model_type):
    """The child modules of the first decoder layer in the order a forward pass calls them."""
    torch.manual_seed(0)
    model = cards.build_model(cards.tiny_config(model_type)).eval()
    layer = model.model.layers[0]
    order = []
    for name, child in layer.named_children():
        child.register_forward_pre_hook(lambda module, args, name=name: order.append(name))
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4]]))
    return order


@pytest.mark.parametrize("model_type", sorted(LAYERS))
def test_listing_calls_modules_in_the_order_the_layer_runs_them(model_type):
    lines = residual_path_lines(inspect.getsource(LAYERS[model_type].forward))
    assert _called_modules(lines) == _run_order(model_type)


@pytest.mark.parametrize("model_type", sorted(LAYERS))
def test_listing_keeps_every_norm_call_and_residual_add_of_the_source(model_type):
    source = inspect.getsource(LAYERS[model_type].forward)
    lines = residual_path_lines(source)
    code = [line.strip() for line in source.splitlines() if not line.strip().startswith("#")]
    for needle in ("norm(", "residual +", "residual = "):
        assert [c for c in code if needle in c] == [line for line in lines if needle in line]
    for line in lines:  # verbatim, or a call folded to its first line
        assert line in code or line.removesuffix("...)") in code
    assert lines[-1] == "return hidden_states"


def test_post_attention_layernorm_sits_on_opposite_sides_of_the_attention_add():
    listings = {name: residual_path_lines(inspect.getsource(cls.forward))
                for name, cls in LAYERS.items()}
    table = side_by_side(listings)
    for name, lines in listings.items():  # each column is its listing, whole and in order
        assert [line for line in table[name] if line] == lines
    shared = table[(table["llama"] != "") & (table["olmo2"] != "")]
    assert (shared["llama"] == shared["olmo2"]).all()
    add = table.index[table["llama"] == "hidden_states = residual + hidden_states"][0]
    trap = "hidden_states = self.post_attention_layernorm(hidden_states)"
    assert table.index[table["llama"] == trap][0] > add  # Llama: the MLP's input norm
    assert table.index[table["olmo2"] == trap][0] < add  # OLMo 2: the attention output's norm


def test_folds_multiline_calls_and_drops_unrelated_statements():
    source = '''
    def forward(self, x):
        """doc"""
        y = self.helper(x)  # neither norm nor residual
        residual = x
        x = self.self_attn(
            x,
            mask=None,
        )
        return residual + x
    '''
    assert residual_path_lines(source) == ["residual = x", "x = self.self_attn(...)",
                                           "return residual + x"]
    with pytest.raises(ValueError, match="function"):
        residual_path_lines("x = 1")
