"""normtools.measure.model_bench: the step times of a transformers model before and after
normtools.patch, on a tiny model (CPU), and the full-width configs against the bundled ones."""

import json

import pytest
import torch

from normtools import cards
from normtools.measure import model_bench


def _norm_modules(model):
    """The transformers norm modules of a model, found by class name (RMSNorm, LayerNorm)."""
    return [n for n, m in model.named_modules() if type(m).__name__.endswith(("RMSNorm", "LayerNorm"))]


@pytest.mark.parametrize("family", ["qwen3", "olmo2"])
def test_tiny_model_before_and_after_patch(family):
    config = cards.tiny_config(family)
    result = model_bench.model_step_times(config, warmup=1, reps=3, batch=2, seq=8)
    rows = result["rows"]
    assert [(r["mode"], r["stage"]) for r in rows] == [
        ("forward", "before"), ("forward+backward", "before"),
        ("forward", "after"), ("forward+backward", "after")]
    expected = len(_norm_modules(cards.build_model(config)))
    for r in rows:
        assert 0 < r["min_ms"] <= r["p50_ms"] <= r["p95_ms"] <= r["p99_ms"]
        if r["stage"] == "after":
            assert r["backend"] == "torch" and r["norms_replaced"] == expected > 0
            # the reference backend follows the transformers modules' casts: same logits
            assert r["max_ulps"] == 0 and r["allclose"]
        else:
            assert r["norms_replaced"] == 0 and r["max_abs"] is None
    c = result["conditions"]
    assert (c["batch"], c["seq"], c["tokens_per_step"]) == (2, 8, 16)
    assert c["cache"].startswith("warm") and c["concurrency"] == "one process, one stream"
    assert c["parameters"] == sum(p.numel() for p in cards.build_model(config).parameters())
    assert set(model_bench.speedups(result)) == {"forward", "forward+backward"}
    json.dumps(result, default=str)


@pytest.mark.parametrize("name", ["qwen3-8b", "gemma-3-4b", "olmo-2-1124-7b"])
def test_full_width_config_keeps_the_published_widths(name):
    full = cards.build_model(cards.load_bundled_config(name), device="meta").config
    stack = cards.build_model(model_bench.full_width_config(name, layers=2), device="meta").config
    full, stack = (c.get_text_config() for c in (full, stack))
    assert stack.num_hidden_layers == 2
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size"):
        assert getattr(stack, key, None) == getattr(full, key, None), key


def test_cli_writes_json(tmp_path):
    out = tmp_path / "model.json"
    assert model_bench.main(["--device", "cpu", "--size", "tiny", "--reps", "2", "--warmup", "0",
                             "--seq", "8", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["conditions"]["model"] == "tiny qwen3"
    assert set(data["speedup_p50"]) == {"forward", "forward+backward"}
