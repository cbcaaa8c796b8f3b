"""Experiment drivers (normtools.lab.grid), on a tiny grid; checked against independent
computations (autograd gradients, the model's own logits recomputed from its weights)."""

import math

import numpy as np
import pytest
import torch

from normtools.lab import grid
from normtools.lab.data import TextData, encode
from normtools.lab.tinylm import TinyLM, TinyLMConfig
from normtools.lab.train import lr_sensitivity

# backend="torch": the tests run with TRITON_INTERPRET=1, where "auto" would pick the interpreter
TINY = TinyLMConfig(width=16, depth=2, heads=2, max_seq_len=8, backend="torch")


@pytest.fixture(scope="module")
def data():
    text = encode("the quick brown fox jumps over the lazy dog; " * 40)
    return TextData(train=text[:1500], val=text[1500:])


def test_grid_is_the_cartesian_product_in_order():
    cells = grid.cells(placement=["pre", "post"], lr=[1e-3, 1e-2, 1e-1])
    assert len(cells) == 6
    assert cells[0] == {"placement": "pre", "lr": 1e-3}
    assert cells[2] == {"placement": "pre", "lr": 1e-1}
    assert cells[3] == {"placement": "post", "lr": 1e-3}


def test_grid_rejects_a_bare_value():
    with pytest.raises(TypeError, match="placement"):
        grid.cells(placement="pre")
    with pytest.raises(ValueError):
        grid.cells()


def test_cell_key_ignores_order():
    assert grid.cell_key({"a": 1, "b": 2}) == grid.cell_key({"b": 2, "a": 1})


def test_layer_grad_norms_match_autograd(data):
    torch.manual_seed(0)
    model = TinyLM(TINY)
    x, y = data.get_batch("train", 2, 8, torch.Generator().manual_seed(0))
    with grid.layer_grad_norms(model) as rows:
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            logits, loss = model(x, y)
            loss.backward()
    assert len(rows) == 2
    # independent: the norm of the gradients autograd left in .grad, layer by layer, in float64
    expected = [math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in layer.parameters()))
                for layer in model.layers]
    np.testing.assert_allclose(rows[-1], expected, rtol=1e-5)
    # the hooks are gone after the block
    model.zero_grad(set_to_none=True)
    model(x, y)[1].backward()
    assert len(rows) == 2


def test_attention_logits_are_the_causal_scores_of_every_layer():
    torch.manual_seed(0)
    model = TinyLM(TINY)
    ids = torch.randint(0, 256, (2, 7))
    got = grid.attention_logits(model, ids)
    # independent recomputation of layer 0 from its weights: pre placement, RMSNorm, RoPE
    attn = model.layers[0].self_attn
    h = model.embed(ids[:, :-1])
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + TINY.eps) * model.layers[0].norms["attn_in"].weight
    B, T, _ = h.shape
    q = attn.q_proj(h).view(B, T, 2, 8).transpose(1, 2)
    k = attn.k_proj(h).view(B, T, 2, 8).transpose(1, 2)
    angles = torch.outer(torch.arange(T).float(), 10000.0 ** (-torch.arange(0, 8, 2).float() / 8))
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rope(v):
        return v * cos + torch.cat([-v[..., 4:], v[..., :4]], -1) * sin

    s = rope(q) @ rope(k).transpose(-2, -1) / math.sqrt(8)
    layer0 = s[torch.ones(T, T, dtype=torch.bool).tril().expand_as(s)]
    n_pairs = B * 2 * T * (T + 1) // 2
    assert got.shape == (TINY.depth * n_pairs,)
    np.testing.assert_allclose(got[:n_pairs], layer0.detach().numpy(), rtol=1e-4, atol=1e-5)
    assert model.training


def test_run_grid_trains_each_distinct_cell_once(data):
    cells = grid.cells(qk_norm=["none", "per_head"], lr=[1e-3, 3e-2])
    cells += [{"lr": 1e-3, "qk_norm": "none"}]  # a duplicate, in another key order
    runs = grid.run_grid(cells, data, TINY, steps=4, batch_size=2, seed=0, eval_batches=1)
    assert len(runs) == 4
    run = runs[grid.cell_key({"qk_norm": "per_head", "lr": 3e-2})]
    assert run.config.qk_norm == "per_head"
    assert list(run.records["step"]) == [0, 1, 2, 3]
    assert {"grad_norm_0", "grad_norm_1", "act_rms_1", "logit_max_0"} <= set(run.records.columns)
    # the global gradient norm (train's, before clipping) is the root sum of squares of the
    # layers' norms plus those of the parameters outside the layers, so it is at least as large
    per_layer = np.sqrt((run.records[["grad_norm_0", "grad_norm_1"]] ** 2).sum(axis=1))
    assert (run.records["grad_norm"] >= per_layer * (1 - 1e-6)).all()
    assert run.logits_init.shape == run.logits_final.shape
    assert not np.array_equal(run.logits_init, run.logits_final)


def test_same_seed_same_initialization_across_cells(data):
    a = grid.run_cell({"lr": 1e-3}, data, TINY, steps=1, batch_size=2, seed=3, eval_batches=0)
    b = grid.run_cell({"lr": 3e-2}, data, TINY, steps=1, batch_size=2, seed=3, eval_batches=0)
    np.testing.assert_array_equal(a.logits_init, b.logits_init)
    assert a.records["loss"].iloc[0] == b.records["loss"].iloc[0]


def test_run_cell_rejects_bad_cells(data):
    with pytest.raises(ValueError, match="lr"):
        grid.run_cell({"placement": "pre"}, data, TINY, steps=1, batch_size=2)
    with pytest.raises(ValueError, match="widht"):
        grid.run_cell({"lr": 1e-3, "widht": 8}, data, TINY, steps=1, batch_size=2)


def test_summarize_and_lr_sensitivity(data):
    cells = grid.cells(placement=["pre"], qk_norm=["none"], lr=[1e-3, 3e-2])
    runs = grid.run_grid(cells, data, TINY, steps=25, batch_size=2, seed=0, eval_batches=1)
    summary = grid.summarize(runs)
    assert list(summary["lr"]) == [1e-3, 3e-2]
    rec = runs[grid.cell_key(cells[1])].records
    assert summary["logit_max_peak"].iloc[1] == rec["logit_max"].max()
    assert summary["final_loss"].iloc[1] == rec.attrs["final_loss"]
    assert not summary["diverged"].any()
    table = grid.lr_sensitivity_table(summary)
    assert len(table) == 1 and table["n_lrs"].iloc[0] == 2
    losses = dict(zip(summary["lr"], summary["final_loss"]))
    expected = np.mean([min(v, summary["initial_loss"].mean()) for v in losses.values()]) \
        - min(min(losses.values()), summary["initial_loss"].mean())
    assert table["lr_sensitivity"].iloc[0] == pytest.approx(expected)
    assert table["best_final_loss"].iloc[0] == min(losses.values())


def test_sizes_grow_from_cpu_to_gpu():
    cpu, gpu = grid.STABILITY_SIZES["cpu"], grid.STABILITY_SIZES["gpu"]
    for key in ("width", "depth", "max_seq_len"):
        assert gpu["model"][key] > cpu["model"][key]
    assert gpu["steps"] > cpu["steps"]
    for size in grid.STABILITY_SIZES.values():
        TinyLMConfig(**size["model"])  # valid configs
        assert size["normal_lr"] in size["sweep_lrs"] and size["high_lr"] in size["sweep_lrs"]


def test_summarize_gives_nan_spike_scores_to_runs_too_short_to_score(data):
    runs = grid.run_grid([{"lr": 1e-3}], data, TINY, steps=5, batch_size=2, seed=0, eval_batches=0)
    row = grid.summarize(runs, spike_window=20).iloc[0]
    assert math.isnan(row["grad_norm_spike_score"]) and math.isnan(row["loss_spike_score"])
    assert math.isnan(row["final_loss"])  # no evaluation asked for
