"""The stability lab's measures, each against an independent computation: attention soft-capping,
PaLM's z-loss, bfloat16 training and rounding, aggregation over seeds, Xiong et al.'s
initialization probe and the per-seed LR sensitivity."""

import math

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from normtools.lab import grid
from normtools.lab import probes
from normtools.lab.data import TextData, encode
from normtools.lab.tinylm import CausalSelfAttention, TinyLM, TinyLMConfig
from normtools.lab.train import autocast_for, loss_terms, lr_sensitivity, train, z_loss

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# backend="torch": the tests run with TRITON_INTERPRET=1, where "auto" would pick the interpreter
TINY = TinyLMConfig(width=16, depth=2, heads=2, max_seq_len=8, backend="torch")


@pytest.fixture(scope="module")
def data():
    text = encode("the quick brown fox jumps over the lazy dog; " * 40)
    return TextData(train=text[:1500], val=text[1500:])


# ------------------------------------------------------------------------------ soft-cap

@torch.no_grad()
def attention_float64(attn, x, softcap):
    """Causal attention written out in float64 from the module's weights: RoPE (rotate-half),
    s = q·kᵀ/√d, c·tanh(s/c), softmax over j ≤ i, then o_proj."""
    B, T, _ = x.shape
    H, d = attn.heads, attn.head_dim
    x = x.double()
    q = (x @ attn.q_proj.weight.double().T).view(B, T, H, d).transpose(1, 2)
    k = (x @ attn.k_proj.weight.double().T).view(B, T, H, d).transpose(1, 2)
    v = (x @ attn.v_proj.weight.double().T).view(B, T, H, d).transpose(1, 2)
    pos = torch.arange(T, dtype=torch.float64)[:, None]
    freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.cat([pos * freq, pos * freq], dim=-1)

    def rope(u):
        return u * angle.cos() + torch.cat([-u[..., d // 2:], u[..., :d // 2]], -1) * angle.sin()

    s = rope(q) @ rope(k).transpose(-1, -2) / math.sqrt(d)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    y = torch.softmax(s, -1) @ v
    return y.transpose(1, 2).reshape(B, T, H * d) @ attn.o_proj.weight.double().T


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_softcap_attention_matches_float64(softcap):
    torch.manual_seed(0)
    attn = CausalSelfAttention(TINY.replace(attn_softcap=softcap))
    with torch.no_grad():
        attn.q_proj.weight.mul_(20.0)            # logits of tens: the cap (2) changes them
    x = torch.randn(2, 8, 16)
    attn.keep_logits = True
    out = attn(x)
    np.testing.assert_allclose(out.detach().double(), attention_float64(attn, x, softcap),
                               rtol=1e-4, atol=1e-5)
    assert attn.logits.abs().max() > 5.0         # the kept logits are s itself, before the cap


def test_softcap_changes_the_output_and_rejects_bad_values():
    torch.manual_seed(0)
    capped, plain = CausalSelfAttention(TINY.replace(attn_softcap=2.0)), CausalSelfAttention(TINY)
    plain.load_state_dict(capped.state_dict())
    with torch.no_grad():
        for m in (capped, plain):
            m.q_proj.weight.mul_(20.0)
    x = torch.randn(1, 8, 16)
    assert not torch.allclose(capped(x), plain(x), atol=1e-3)
    with pytest.raises(ValueError, match="attn_softcap"):
        TINY.replace(attn_softcap=0.0)


# -------------------------------------------------------------------------------- z-loss

def test_z_loss_is_mean_squared_log_partition_function():
    logits = torch.randn(3, 5, 11) * 4
    expected = np.mean(np.log(np.exp(logits.double().numpy()).sum(-1)) ** 2)
    assert z_loss(logits).item() == pytest.approx(expected, rel=1e-6)
    # its gradient: ∂/∂logit_v of mean (log Z)² = 2 log Z · softmax_v / n
    logits.requires_grad_(True)
    z_loss(logits).backward()
    log_z = torch.logsumexp(logits.detach().double(), -1, keepdim=True)
    expected_grad = 2 * log_z * torch.softmax(logits.detach().double(), -1) / 15
    np.testing.assert_allclose(logits.grad.double(), expected_grad, rtol=1e-5, atol=1e-9)


def test_train_with_z_loss_minimizes_cross_entropy_plus_z(data):
    """One step of plain SGD-like AdamW is hard to predict; instead check the gradient the loop
    follows: the first step's global gradient norm equals that of CE + coef · z computed here."""
    coef = 0.5
    torch.manual_seed(0)
    model = TinyLM(TINY)
    batch = data.get_batch("train", 4, 8, torch.Generator().manual_seed(3))
    x, y = batch
    logits, _ = model(x)
    ce = F.cross_entropy(logits.flatten(0, 1).double(), y.flatten())
    z = torch.logsumexp(logits.double(), -1).pow(2).mean()
    (ce + coef * z).backward()
    expected = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.parameters()))
    torch.manual_seed(0)
    records = train(TinyLM(TINY), data, 1, 1e-3, batch_size=4, seed=3, z_loss_coef=coef,
                    quiet=True, eval_batches=0, grad_clip=None)
    assert records["grad_norm"].iloc[0] == pytest.approx(expected, rel=1e-4)
    assert records["loss"].iloc[0] == pytest.approx(ce.item(), rel=1e-5)   # CE, not CE + z
    assert records["log_z"].iloc[0] == pytest.approx(
        torch.logsumexp(logits.detach().double(), -1).mean().item(), rel=1e-5)


# ---------------------------------------------------------------------------- bfloat16

def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bfloat16 (ties to even) with integer arithmetic on the bits."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bias = 0x7FFF + ((bits >> 16) & 1)
    return ((bits + bias) & 0xFFFF0000).astype(np.uint32).view(np.float32)


def test_bf16_autocast_runs_on_cpu_and_computes_logits_in_bf16(data):
    precision, context = autocast_for("bf16", torch.device("cpu"))
    assert precision == "bf16"
    torch.manual_seed(0)
    model = TinyLM(TINY)
    x, _ = data.get_batch("train", 2, 8, torch.Generator().manual_seed(0))
    for layer in model.layers:
        layer.self_attn.keep_logits = True
    with context:
        model(x)
    assert model.layers[0].self_attn.logits.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="fp16"):
        autocast_for("fp16", torch.device("cpu"))
    torch.manual_seed(0)
    records = train(TinyLM(TINY), data, 3, 1e-3, batch_size=2, precision="bf16", quiet=True,
                    eval_batches=1)
    torch.manual_seed(0)
    fp32 = train(TinyLM(TINY), data, 3, 1e-3, batch_size=2, precision="fp32", quiet=True,
                 eval_batches=1)
    assert records.attrs["precision"] == "bf16"
    # same model, same batch: the losses agree to bf16's precision, and are not identical
    assert records["loss"].iloc[0] == pytest.approx(fp32["loss"].iloc[0], rel=2e-2)
    assert records["loss"].iloc[0] != fp32["loss"].iloc[0]


def test_low_precision_attention_against_numpy():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 6, 6) * torch.tensor([1.0, 30.0, 900.0])[None, :, None, None]
    valid = torch.ones(6, 6, dtype=torch.bool).tril()
    got = probes.low_precision_attention(logits, valid)
    s = logits.numpy().astype(np.float32)
    r = round_to_bf16(s).astype(np.float64)
    mask = np.broadcast_to(valid.numpy(), s.shape)

    def softmax(v):
        v = np.where(mask, v, -np.inf)
        e = np.exp(v - v.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p, pr = softmax(s.astype(np.float64)), softmax(r)
    ent = lambda q: np.mean(-np.sum(np.where(mask, q * np.log(np.where(q > 0, q, 1)), 0), -1))
    assert got["logit_max"] == pytest.approx(np.abs(s[mask]).max(), rel=1e-6)
    assert got["rounding_error_max"] == pytest.approx(np.abs(s - r)[mask].max(), rel=1e-6)
    assert got["entropy"] == pytest.approx(ent(p), abs=1e-5)
    assert got["entropy_rounded"] == pytest.approx(ent(pr), abs=1e-5)
    assert got["prob_error_max"] == pytest.approx(np.abs(p - pr)[mask].max(), abs=1e-5)
    assert got["saturated"] == pytest.approx(np.mean(p.max(-1) >= 0.99))
    top = np.abs(s[mask]).max()
    assert got["spacing_at_max"] == 2.0 ** (math.floor(math.log2(top)) - 7)


# ------------------------------------------------------------------- aggregation over seeds

def test_over_seeds_median_and_range_against_numpy():
    rng = np.random.default_rng(0)
    table = pd.DataFrame([{"variant": v, "lr": lr, "seed": s, "loss": rng.normal(), "peak": rng.normal()}
                          for v in ("a", "b") for lr in (0.1, 1.0) for s in range(5)])
    table.loc[3, "peak"] = np.nan
    out = grid.over_seeds(table, ["loss", "peak"])
    assert list(out.columns[:3]) == ["variant", "lr", "n_seeds"] and len(out) == 4
    for _, row in out.iterrows():
        part = table[(table["variant"] == row["variant"]) & (table["lr"] == row["lr"])]
        for m in ("loss", "peak"):
            values = part[m].dropna().to_numpy()
            assert row[f"{m}_median"] == pytest.approx(np.median(values))
            assert row[f"{m}_min"] == values.min() and row[f"{m}_max"] == values.max()
        assert row["n_seeds"] == 5
    with pytest.raises(ValueError, match="no columns"):
        grid.over_seeds(table, "nope")


def test_lr_sensitivity_table_is_per_seed(data):
    cells = grid.cells(qk_norm=["none"], lr=[1e-3, 3e-2])
    runs = grid.run_grid(cells, data, TINY, seeds=(0, 1), steps=3, batch_size=2, eval_batches=1)
    summary = grid.summarize(runs)
    assert sorted(summary["seed"]) == [0, 0, 1, 1]
    table = grid.lr_sensitivity_table(summary, by=("qk_norm",))
    assert list(table["seed"]) == [0, 1]
    for seed in (0, 1):
        part = summary[summary["seed"] == seed]
        expected = lr_sensitivity(dict(zip(part["lr"], part["final_loss"])),
                                  float(part["initial_loss"].mean()))
        assert table.set_index("seed").loc[seed, "lr_sensitivity"] == pytest.approx(expected)
    # different seeds: different initializations and batches
    assert summary["final_loss"].iloc[0] != summary["final_loss"].iloc[1]


# --------------------------------------------------------------- Xiong et al. at initialization

def test_init_gradients_match_autograd(data):
    batch = data.get_batch("val", 2, 8, torch.Generator().manual_seed(0))
    config = dict(width=16, heads=2, max_seq_len=8, backend="torch", norm="layer")
    table = probes.init_gradients(batch, placements=("post", "pre"), depths=(2, 3), seeds=(0, 1),
                                  **config)
    assert len(table) == 2 * (2 + 3) * 2
    for placement in ("post", "pre"):
        torch.manual_seed(1)
        model = TinyLM(placement=placement, depth=3, **config)
        x, y = batch
        logits, _ = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        grads = torch.autograd.grad(loss, [layer.mlp.down_proj.weight for layer in model.layers])
        got = table[(table["placement"] == placement) & (table["depth"] == 3) & (table["seed"] == 1)]
        np.testing.assert_allclose(got["w2_grad_norm"], [g.double().norm().item() for g in grads],
                                   rtol=1e-5)
        h = model.embed(x)
        for layer, rms in zip(model.layers, got["residual_rms"]):
            h = layer(h)
            assert rms == pytest.approx(h.double().pow(2).mean().sqrt().item(), rel=1e-5)


def test_power_law_exponent():
    x = np.array([6, 12, 24, 48])
    assert probes.power_law_exponent(x, 3 * x ** 0.5) == pytest.approx(0.5)
    assert probes.power_law_exponent(x, 2 * x ** -1.0) == pytest.approx(-1.0)
    assert probes.power_law_exponent([2, 4, 8, 16], [2, 4, 8, 16]) == pytest.approx(1.0)
    for x, y in (([1], [1]), ([4, 4], [1.0, 2.0]), ([1, 2], [1.0, -1.0]), ([1, 2, 3], [1.0, 2.0])):
        with pytest.raises(ValueError, match="two different x"):
            probes.power_law_exponent(x, y)
