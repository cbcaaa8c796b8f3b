"""The computations behind chapters 1 and 2: RMSNorm vs LayerNorm gaps (measure.rms_vs_layer_norm),
cost counts (measure.op_costs), the amplifier chain (lab.amplifier_chain), equations from specs
(lab.tinylm_from_spec), QK-Norm footprints (book.qk_norm_scopes),
residual growth (lab.probes)."""

import math

import pytest
import torch
import torch.nn.functional as F

import normtools
from normtools.book import qk_norm_scopes
from normtools.lab import amplifier_chain, probes, tinylm_from_spec
from normtools.measure import bench, op_costs, rms_vs_layer_norm
from normtools import cards
from normtools.lab.blocks import block_equation
from normtools.lab.tinylm import TinyLM


# ------------------------------------------------------------------ RMSNorm against LayerNorm

def test_rms_equals_layer_norm_on_zero_mean_rows():
    x = torch.randn(16, 64, dtype=torch.float64)
    x = (x - x.mean(-1, keepdim=True)).float()
    gap = rms_vs_layer_norm.rms_layer_gap(x)
    assert gap["rel_gap"].max() < 1e-5
    assert gap["mean_to_std"].max() < 1e-5


def test_rms_layer_gap_against_torch_and_theory():
    g = torch.Generator().manual_seed(0)
    shift = torch.linspace(-3, 3, 32)[:, None]
    x = torch.randn(32, 256, generator=g) * 2.0 + shift
    gap = rms_vs_layer_norm.rms_layer_gap(x, eps=1e-6)
    # independent: PyTorch's own ops, float64
    x64 = x.double()
    rms_out = F.rms_norm(x64, (256,), eps=1e-6)
    layer_out = F.layer_norm(x64, (256,), eps=1e-6)
    expected = (rms_out - layer_out).norm(dim=-1) / layer_out.norm(dim=-1)
    torch.testing.assert_close(gap["rel_gap"].double(), expected, rtol=1e-4, atol=1e-6)
    rho = x64.mean(-1).abs() / x64.std(-1, unbiased=False)
    torch.testing.assert_close(gap["mean_to_std"].double(), rho, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(rms_vs_layer_norm.rms_layer_gap_theory(rho), expected, rtol=1e-4, atol=1e-6)


def test_norm_inputs_sees_what_the_norms_receive():
    model = cards.build_model(cards.tiny_config("llama")).eval()
    ids = torch.randint(0, 64, (2, 8))
    inputs = rms_vs_layer_norm.norm_inputs(model, lambda: model(ids))
    names = {f"model.layers.{i}.{n}" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")}
    assert set(inputs) == names | {"model.norm"}
    embedded = model.model.embed_tokens(ids).detach().reshape(-1, 32)
    torch.testing.assert_close(inputs["model.layers.0.input_layernorm"], embedded)


# ------------------------------------------------------------------ cost per row

def test_count_flops_on_known_expressions():
    a, b = torch.randn(3, 100), torch.randn(3, 100)
    out, flops = op_costs.count_flops(lambda u, v: (u * v).sum(-1), a, b)
    assert flops == 2 * 300
    torch.testing.assert_close(out, (a * b).sum(-1))
    _, flops = op_costs.count_flops(lambda u: u.double().view(300).float(), a)
    assert flops == 0
    _, flops = op_costs.count_flops(lambda u, v: torch.addcmul(u, u, v, value=-1), a, b)
    assert flops == 2 * 300
    _, flops = op_costs.count_flops(lambda u, v: torch.linalg.vecdot(u, v), a, b)
    assert flops == 2 * 300
    _, flops = op_costs.count_flops(torch.mv, a, b[0])                # matrix-vector
    assert flops == 2 * 300
    _, flops = op_costs.count_flops(lambda u, v: u.clone().addcmul_(u, v), a, b)
    assert flops == 2 * 300
    with pytest.raises(NotImplementedError):
        op_costs.count_flops(torch.exp, a)


@pytest.mark.parametrize("n", [64, 4096])
def test_row_costs_against_the_equations(n):
    rows = 256
    costs = {(c["op"], c["direction"]): c for c in op_costs.row_costs(n, torch.bfloat16, rows=rows)}
    # Operations of the reference code, counted by hand from normtools/reference.py:
    # RMSNorm fwd: x², mean, +eps, rsqrt, x·r, offset + w (once per call), ·scale
    # RMSNorm bwd: x̂ = x·r, p = dy·x̂, g = dy·s (offset + w only for an offset), Σ x̂·g as the
    #   row's p·s (a matrix-vector product: two), g − x̂·c/N (one addcmul: two), r·(…), Σ_rows p
    # LayerNorm fwd: mean, x − μ (once, for the variance and for y), ², mean, +eps, rsqrt, ·r, ·w, +b
    # LayerNorm bwd: x − μ, ·r, w·dy, mean g, x̂·g, mean, g − mean g, x̂·c, −, r·, dy·x̂, Σ, Σ dy
    expected_flops = {
        ("rms_norm", "forward"): 4 * n + 2 + n / rows,
        ("rms_norm", "backward"): 9 * n,
        ("layer_norm", "forward"): 7 * n + 2,
        ("layer_norm", "backward"): 13 * n,
    }
    for key, flops in expected_flops.items():
        assert costs[key]["flops_per_row"] == pytest.approx(flops), key
    s = 2  # bfloat16
    # forward bytes: the benchmark's independent bytes model (inputs once, outputs once)
    for op in ("rms_norm", "layer_norm"):
        moved = bench.bytes_moved(op, {"M": rows, "N": n}, torch.bfloat16)
        assert costs[(op, "forward")]["bytes_per_row"] == pytest.approx(moved / rows)
    # backward: dy, x in and dx out; w in and dw out (+ db out); float32 statistics in
    assert costs[("rms_norm", "backward")]["bytes_per_row"] == pytest.approx(3 * n * s + 2 * n * s / rows + 4)
    assert costs[("layer_norm", "backward")]["bytes_per_row"] == pytest.approx(3 * n * s + 3 * n * s / rows + 8)


# ------------------------------------------------------------------ the amplifier chain

def test_signal_through_scaled_identity_stages():
    x = torch.randn(32)
    gain, depth = 1.1, 20
    stages = torch.eye(32).expand(depth, 32, 32) * gain
    levels = amplifier_chain.signal_through_stages(x, stages)
    rms0 = x.double().pow(2).mean().sqrt().item()
    expected = torch.tensor([rms0 * gain**k for k in range(depth + 1)], dtype=torch.float64)
    torch.testing.assert_close(levels.double(), expected, rtol=1e-5, atol=0)
    levelled = amplifier_chain.signal_through_stages(x, stages, level=normtools.rms_norm)
    torch.testing.assert_close(levelled[1:].double(), torch.ones(depth, dtype=torch.float64), rtol=1e-5, atol=0)


def test_random_amplifiers_gain_and_errors():
    g = torch.Generator().manual_seed(0)
    amps = amplifier_chain.random_amplifiers(4, 256, 1.5, g)
    assert amps.shape == (4, 256, 256)
    assert amps.std().item() == pytest.approx(1.5 / math.sqrt(256), rel=0.02)
    with pytest.raises(ValueError):
        amplifier_chain.random_amplifiers(0, 8, 1.0)
    with pytest.raises(ValueError):
        amplifier_chain.signal_through_stages(torch.randn(8), torch.randn(3, 4, 4))


# ------------------------------------------------------------------ equations from norm cards

DECODER_FAMILIES = ["llama", "qwen3", "olmo2", "gemma3_text", "gpt_oss", "cohere", "phi"]


def _record_layer0(model, ids):
    """Inputs and outputs of layer 0's self_attn, mlp and every norm module, from hooks."""
    layer = model.model.layers[0]
    seen = {}

    def pre(name):
        def hook(module, args, kwargs):
            seen[name + ".in"] = (args[0] if args else kwargs["hidden_states"]).detach()
        return hook

    def post(name):
        def hook(module, args, kwargs, out):
            seen[name + ".out"] = (out[0] if isinstance(out, tuple) else out).detach()
        return hook

    handles = []
    for name, module in layer.named_modules():
        if name and ("." not in name or name.count(".") == 1 and "norm" in name.split(".")[-1]):
            handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
            handles.append(module.register_forward_hook(post(name), with_kwargs=True))
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("model_type", DECODER_FAMILIES)
def test_norm_legend_matches_what_the_hf_modules_compute(model_type):
    """Each symbol of the block equation sits where the equation says, in the real HF module."""
    torch.manual_seed(0)
    s = cards.from_hf_config(cards.tiny_config(model_type))
    model = cards.build_model(cards.tiny_config(model_type)).eval()
    seen = _record_layer0(model, torch.randint(3, 64, (1, 6)))
    legend = tinylm_from_spec.norm_legend(s)
    equation = tinylm_from_spec.block_equation_from_spec(s, "text")
    for symbol, module in legend:
        assert symbol + "(" in equation
        where = symbol.removeprefix("N_")
        if where in ("attn_in", "in"):
            torch.testing.assert_close(seen[module + ".out"], seen["self_attn.in"])
        if where in ("mlp_in", "in"):
            torch.testing.assert_close(seen[module + ".out"], seen["mlp.in"])
        if where == "attn_out":
            torch.testing.assert_close(seen[module + ".in"], seen["self_attn.out"])
        if where == "mlp_out":
            torch.testing.assert_close(seen[module + ".in"], seen["mlp.out"])
    block_norms = {n for n in seen if n.endswith(".in") and "norm" in n and "." not in n[:-3]}
    assert {m + ".in" for _, m in legend} == block_norms


@pytest.mark.parametrize("name", cards.bundled_configs())
def test_tinylm_config_from_spec_builds_the_same_layout(name):
    s, _ = cards.load(name)
    config = tinylm_from_spec.tinylm_config_from_spec(s, width=32, depth=1, heads=2)
    model = TinyLM(config)
    assert len(model.layers[0].norms) == len(s.layer_norms)
    assert (model.layers[0].self_attn.qk_norm is None) == (s.qk_norm.scope == "none")
    assert block_equation(config, "latex") == tinylm_from_spec.block_equation_from_spec(s, "latex")


# ------------------------------------------------------------------ QK-Norm footprints

def test_statistic_footprint_per_head_and_per_layer():
    per_head = qk_norm_scopes.statistic_footprint("per_head", 3, 4, 8, at=(1, 2, 5))
    expected = torch.zeros(3, 4, 8, dtype=torch.bool)
    expected[1, 2, :] = True
    assert torch.equal(per_head, expected)
    per_layer = qk_norm_scopes.statistic_footprint("per_layer", 3, 4, 8, at=(2, 0, 0))
    expected = torch.zeros(3, 4, 8, dtype=torch.bool)
    expected[2] = True
    assert torch.equal(per_layer, expected)


# ------------------------------------------------------------------ residual growth

def test_residual_growth_reads_the_stream_after_the_last_block():
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 9))
    df = probes.residual_growth(ids, depths=(1, 3), seeds=(0,), width=32, heads=2, max_seq_len=8)
    assert list(df["depth"]) == [1, 3]
    # independent computation: the model's own hidden state after the last block
    for row in df.itertuples():
        torch.manual_seed(row.seed)
        model = TinyLM(placement="pre", depth=row.depth, width=32, heads=2, max_seq_len=8)
        captured = {}
        handle = model.layers[-1].register_forward_hook(lambda m, i, o: captured.setdefault("x", o))
        with torch.no_grad():
            model(ids[:, :-1])
        handle.remove()
        out = captured["x"][0] if isinstance(captured["x"], tuple) else captured["x"]
        assert row.residual_rms_last == pytest.approx(out.pow(2).mean().sqrt().item(), rel=1e-5)


def test_plot_profile_rows_stacks_panels_and_labels_each_line_at_its_end():
    import matplotlib

    matplotlib.use("Agg")
    import pandas as pd

    # pre and parallel coincide (as they do at initialization): both must stay visible
    df = pd.DataFrame({"layer": [0, 1] * 3,
                       "placement": ["pre"] * 2 + ["parallel"] * 2 + ["post"] * 2,
                       "residual_rms": [1.0, 2.0, 1.0, 2.0, 1.0, 1.0],
                       "grad_norm": [0.5, 0.4, 0.5, 0.4, 0.3, 0.2]})
    fig = probes.plot_profile_rows(df, ("residual_rms", "grad_norm"), by="placement", title="t")
    axes = fig.get_axes()
    assert len(axes) == 2 and all(a.get_legend() is None for a in axes) and not fig.legends
    assert axes[0].get_position().y0 > axes[1].get_position().y1  # stacked, not side by side
    for axis in axes:
        lines = axis.get_lines()
        styles = {(line.get_marker(), str(line.get_linestyle())) for line in lines}
        assert len(styles) == len(lines) == 3  # each line its own marker and dash
        labels = {text.get_text(): text for text in axis.texts}
        assert sorted(labels) == ["parallel", "post", "pre"]
        for line in lines:  # in the line's colour, right of the data
            assert labels[line.get_label()].get_color() == line.get_color()
            assert labels[line.get_label()].get_position()[0] > 1
        heights = sorted(text.get_position()[1] for text in axis.texts)
        assert min(b - a for a, b in zip(heights, heights[1:])) > 0.05  # no label on another


def test_full_table_keeps_long_cells_and_stable_html():
    import pandas as pd

    from normtools.book.notebook import full_table

    df = pd.DataFrame({"value": ["x" * 80, "short"]}, index=["a", "b"])
    assert "x" * 80 not in df._repr_html_()  # what a displayed DataFrame shows: a cut cell
    html = full_table(df, "card")._repr_html_()
    assert "x" * 80 in html and "short" in html
    assert html == full_table(df, "card")._repr_html_()
    assert repr(full_table(df, "card")) == "<table card: 2 rows x 1 columns>"  # no address
