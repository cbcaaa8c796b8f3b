"""Issue 34: the card reader under hostile input. A checkpoint directory, config.json, index file
or safetensors header ends in a clean error (SpecError, SafetensorsHeaderError: ValueErrors;
OSError for what cannot be read) or a correct card, in bounded time and memory, and its config
is checked against the tensors."""

import json
import os
import shutil
import struct
import threading
import time
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from normtools import cards
from normtools.cards.safetensors_header import SafetensorsHeaderError, read_header
from normtools.cards.sources import from_checkpoint, load
from normtools.cards.types import SpecError

pytest.importorskip("transformers")

CLEAN_ERRORS = (SpecError, SafetensorsHeaderError, OSError)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama checkpoint: (config dict, {tensor name: (dtype, shape)})."""
    d = tmp_path_factory.mktemp("ckpt")
    config = cards.tiny_config("llama", num_attention_heads=4, num_key_value_heads=2)
    cards.build_model(config).save_pretrained(d)
    config = json.loads((d / "config.json").read_text())
    header = {name: (i.dtype, list(i.shape)) for name, i in read_header(d / "model.safetensors").items()}
    return config, header


def write_checkpoint(path, config, tensors, index=None, raw_header=None):
    """A checkpoint directory with ``config`` (dict, or text written as is) and one safetensors
    file holding ``tensors`` ({name: (dtype, shape)}, zero data) or the header bytes ``raw_header``."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if raw_header is None:
        header, offset = {}, 0
        for name, (dtype, shape) in tensors.items():
            size = 2 * max(1, 1) * _numel(shape) if dtype in ("BF16", "F16") else 4 * _numel(shape)
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
        raw_header, data = json.dumps(header).encode(), bytes(offset)
    else:
        data = b""
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw_header)) + raw_header + data)
    if index is not None:
        (path / "model.safetensors.index.json").write_text(index if isinstance(index, str) else json.dumps(index))
    return path


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def test_the_untouched_checkpoint_reads(checkpoint, tmp_path):
    config, tensors = checkpoint
    assert from_checkpoint(write_checkpoint(tmp_path / "c", config, tensors)).num_kv_heads == 2


def test_num_key_value_heads_is_checked_against_the_k_and_v_projections(checkpoint, tmp_path):
    """The config says 4 kv heads (it divides the 4 heads), the tensors hold 2."""
    config, tensors = checkpoint
    with pytest.raises(SpecError, match="k_proj.weight has shape"):
        from_checkpoint(write_checkpoint(tmp_path / "c", {**config, "num_key_value_heads": 4}, tensors))


@pytest.mark.parametrize("key, value", [("vocab_size", -5), ("hidden_size", 0), ("num_hidden_layers", 2.5),
                                        ("num_key_value_heads", 3), ("vocab_size", 10**4000),
                                        ("num_attention_heads", True)])
def test_impossible_config_values_are_refused(checkpoint, key, value):
    config, _ = checkpoint
    with pytest.raises(SpecError, match=key):
        cards.count_parameters({**config, key: value})


@pytest.mark.parametrize("text, reason", [
    ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
    ('{"model_type": "llama", "vocab_size": ' + "9" * 5000 + "}", "not valid JSON"),
])
def test_config_json_too_deep_or_with_a_5000_digit_integer_is_a_spec_error(checkpoint, tmp_path, text, reason):
    _, tensors = checkpoint
    with pytest.raises(SpecError, match=reason):
        from_checkpoint(write_checkpoint(tmp_path / "c", text, tensors))


def test_a_5000_digit_integer_in_a_safetensors_header_is_a_header_error(checkpoint, tmp_path):
    config, _ = checkpoint
    raw = b'{"w": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}'
    with pytest.raises(SafetensorsHeaderError):
        from_checkpoint(write_checkpoint(tmp_path / "c", config, None, raw_header=raw))


@pytest.mark.parametrize("weight_map", [["a", "b"], 5, {"x": 3}])
def test_an_index_whose_weight_map_is_not_a_mapping_of_names_to_files_is_a_spec_error(checkpoint, tmp_path, weight_map):
    config, tensors = checkpoint
    path = write_checkpoint(tmp_path / "c", config, tensors, index={"weight_map": weight_map})
    with pytest.raises(SpecError, match="weight_map"):
        from_checkpoint(path)


@pytest.mark.parametrize("unconfirmed", [5, "rms_norm_eps", [1, 2]])
def test_unconfirmed_must_be_a_list_of_keys(checkpoint, unconfirmed):
    config, _ = checkpoint
    with pytest.raises(SpecError, match="_unconfirmed"):
        cards.from_hf_config({**config, "_unconfirmed": unconfirmed})


@pytest.mark.parametrize("index", [3_000_000, 10**12, 999_999])
def test_a_huge_layer_index_gives_a_short_error_in_bounded_memory(checkpoint, tmp_path, index):
    """One name with layer 3,000,000 made an 89 MB error; 10**12 grew memory without bound."""
    config, tensors = checkpoint
    name = f"model.layers.{index}.input_layernorm.weight"
    path = write_checkpoint(tmp_path / "c", config, {**tensors, name: ("F32", [config["hidden_size"]])})
    tracemalloc.start()
    try:
        with pytest.raises(SpecError) as error:
            from_checkpoint(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(str(error.value)) < 2000 and peak < 50 * 2**20


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_named_pipe_called_model_safetensors_is_refused_not_read(checkpoint, tmp_path):
    config, tensors = checkpoint
    path = write_checkpoint(tmp_path / "c", config, tensors)
    (path / "model.safetensors").unlink()
    os.mkfifo(path / "model.safetensors")
    outcome = []
    reader = threading.Thread(target=lambda: outcome.append(_outcome(path)), daemon=True)
    reader.start()
    reader.join(timeout=30)
    if reader.is_alive():  # unblock the reader so that the test process can end
        with open(path / "model.safetensors", "wb"):
            pass
        pytest.fail("reading a named pipe blocked")
    assert isinstance(outcome[0], OSError) and "not a regular file" in str(outcome[0])


def _outcome(path):
    try:
        return load(path)
    except Exception as e:  # noqa: BLE001 - the test looks at what it is
        return e


# ------------------------------------------------------------------------- property-based

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**30, 10**30), st.floats(allow_nan=True),
                         st.text(max_size=20))
# Hostile values as JSON text: ordinary values of the wrong kind, nesting 100,000 deep, a 5,000-digit
# integer (both beyond what Python's json builds, so they are spliced into the text).
HOSTILE_JSON = st.one_of(
    st.one_of(JSON_SCALARS, st.lists(JSON_SCALARS, max_size=3),
              st.dictionaries(st.text(max_size=5), JSON_SCALARS, max_size=3)).map(json.dumps),
    st.just("[" * 100_000 + "]" * 100_000), st.just("9" * 5000), st.just(str(10**4000)))
CONFIG_KEYS = ["model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps", "_unconfirmed",
               "attention_bias", "tie_word_embeddings"]
LAYER_NAMES = st.one_of(st.integers(0, 10**15).map(lambda i: f"model.layers.{i}.input_layernorm.weight"),
                        st.text(max_size=40))


def json_object(entries: dict) -> str:
    """A JSON object whose values are already JSON text."""
    return "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in entries.items()) + "}"


@st.composite
def hostile_checkpoints(draw, checkpoint):
    """(config.json text, tensors, header bytes or None, index text or None)."""
    config, tensors = checkpoint
    entries = {k: json.dumps(v) for k, v in config.items()}
    for key in draw(st.lists(st.sampled_from(CONFIG_KEYS), max_size=3, unique=True)):
        entries[key] = draw(HOSTILE_JSON)
    tensors = dict(tensors)
    for name in draw(st.lists(LAYER_NAMES, max_size=3)):
        tensors[name] = (draw(st.sampled_from(["F32", "BF16"])), draw(st.lists(st.integers(0, 64), max_size=3)))
    for name in draw(st.lists(st.sampled_from(sorted(tensors)), max_size=2, unique=True)):
        tensors[name] = (tensors[name][0], draw(st.lists(st.integers(0, 64), max_size=3)))
    raw = None
    if draw(st.booleans()):  # a hostile header instead of a well-formed one
        header = {name: {"dtype": json.dumps(dtype), "shape": json.dumps(shape), "data_offsets": "[0, 0]"}
                  for name, (dtype, shape) in tensors.items()}
        victim = draw(st.sampled_from(sorted(header)))
        header[victim][draw(st.sampled_from(["dtype", "shape", "data_offsets"]))] = draw(HOSTILE_JSON)
        raw = json_object({name: json_object(entry) for name, entry in header.items()}).encode()
    index = draw(st.one_of(st.none(), HOSTILE_JSON.map(lambda m: json_object({"weight_map": m}))))
    return json_object(entries), tensors, raw, index


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hostile_checkpoints_end_in_a_clean_error_or_a_card_in_bounded_time_and_memory(checkpoint, tmp_path, data):
    config, tensors, raw, index = data.draw(hostile_checkpoints(checkpoint))
    path = tmp_path / "c"
    shutil.rmtree(path, ignore_errors=True)
    write_checkpoint(path, config, tensors, index=index, raw_header=raw)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        try:
            spec, _ = load(path)
        except CLEAN_ERRORS as e:
            assert len(str(e)) < 100_000
        else:
            assert spec == cards.from_hf_config(json.loads(config))  # a card: the config's, confirmed
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - start < 20 and peak < 200 * 2**20
