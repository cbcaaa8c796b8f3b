"""``normtools card`` and ``normtools diff``: golden output, JSON output, one-line errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from normtools import cards
from normtools.cli import main

GOLDEN = Path(__file__).parents[1] / "golden"


def run_cli(capsys, *argv):
    """(exit code, stdout, stderr) of the card/diff commands, through ``normtools.cli.main``."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_card_of_a_bundled_config_matches_the_golden_file():
    """The installed entry point (``python -m normtools``), byte for byte."""
    result = subprocess.run([sys.executable, "-m", "normtools", "card", "gpt-oss-20b"],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    assert result.returncode == 0, result.stderr
    assert result.stdout == (GOLDEN / "card_gpt-oss-20b.md").read_text()


def test_card_json_is_the_spec_and_the_counts(capsys):
    code, out, _ = run_cli(capsys, "card", "qwen3-8b", "--json")
    assert code == 0
    data = json.loads(out)
    config = cards.load_bundled_config("qwen3-8b")
    assert cards.ModelNormSpec.from_dict(data["spec"]) == cards.from_hf_config(config)
    assert data["parameters"] == cards.count_parameters(config)


def test_card_of_a_checkpoint_directory_and_of_a_config_file(capsys, tmp_path):
    pytest.importorskip("transformers")
    cards.build_model(cards.tiny_config("olmo2")).save_pretrained(tmp_path / "ckpt")
    code, from_dir, _ = run_cli(capsys, "card", str(tmp_path / "ckpt"))
    assert code == 0 and "| Placement | post_sublayer |" in from_dir
    code, from_file, _ = run_cli(capsys, "card", str(tmp_path / "ckpt" / "config.json"))
    assert code == 0 and from_file == from_dir


def test_card_flags_unconfirmed_values(capsys, tmp_path):
    config = {**cards.load_bundled_config("qwen3-8b"), "_unconfirmed": ["rms_norm_eps"]}
    code, out, _ = run_cli(capsys, "card", str(_write(tmp_path / "config.json", json.dumps(config))))
    assert code == 0
    assert "| eps | 1e-06 (unconfirmed) |" in out
    assert "| Unconfirmed config values | rms_norm_eps |" in out
    assert "| Casting | llama:" in out and "(unconfirmed)" not in out.split("| Casting |")[1].split("\n")[0]


def test_bundled_configs_confirmed_by_their_sources_have_no_unconfirmed_rows(capsys):
    """OLMo-2-1124-7B: every kept value is confirmed by allenai/OLMo's official training config
    (configs/SOURCES.md), so its card carries no "(unconfirmed)" mark."""
    code, out, _ = run_cli(capsys, "card", "olmo-2-1124-7b")
    assert code == 0 and "unconfirmed" not in out
    assert "| eps | 1e-06 |" in out


def test_diff_lists_the_differing_fields(capsys):
    code, out, _ = run_cli(capsys, "diff", "llama-3-8b", "olmo-2-1124-7b", "--json")
    assert code == 0
    d = json.loads(out)
    assert d["placement"] == ["pre", "post_sublayer"]
    assert d["block_norm.casting"] == ["llama", "gemma"]
    assert d["qk_norm.scope"] == ["none", "per_layer"]
    code, table, _ = run_cli(capsys, "diff", "llama-3-8b", "olmo-2-1124-7b")
    assert code == 0 and table.count("\n") == len(d) + 2
    assert run_cli(capsys, "diff", "qwen3-8b", "qwen3-8b")[1] == "no differences\n"


@pytest.mark.parametrize("make_bad_input, reason", [
    (lambda tmp: tmp / "nowhere", "not a checkpoint directory, a config.json file or a bundled config"),
    (lambda tmp: tmp, "no config.json"),
    (lambda tmp: _write(tmp / "c.json", "{not json"), "not valid JSON"),
    (lambda tmp: _write(tmp / "c.json", '{"model_type": "rwkv"}'), "unsupported model_type 'rwkv'"),
])
def test_bad_input_gives_one_line_and_exit_code_2(capsys, tmp_path, make_bad_input, reason):
    for command in (["card", str(make_bad_input(tmp_path))], ["diff", "llama-3-8b", str(make_bad_input(tmp_path))]):
        code, out, err = run_cli(capsys, *command)
        assert code == 2 and out == ""
        assert err.count("\n") == 1 and reason in err
        # an atlas family is offered only for a name that is no file or directory
        assert ("atlas family" in err) == (not Path(command[-1]).exists())


@pytest.mark.parametrize("config, key", [
    (cards.load_bundled_config("qwen3-8b"), "rms_norm_eps"),
    (cards.tiny_config("phi"), "layer_norm_eps"),
])
@pytest.mark.parametrize("eps_text", ["-1.0", "0.0", "1e400", "NaN", "1e-40"])
def test_a_config_with_a_bad_eps_gives_one_line_naming_the_key(capsys, tmp_path, config, key, eps_text):
    """eps must be finite and at least float32's smallest normal number (1.18e-38), as for
    every normtools op; 1e400 and NaN are what Python's json reads as inf and nan."""
    text = json.dumps({**config, key: 1e-5}).replace("1e-05", eps_text)
    for command in (["card", str(_write(tmp_path / "c.json", text))], ["card", str(tmp_path / "c.json"), "--json"]):
        code, out, err = run_cli(capsys, *command)
        assert code == 2 and out == ""
        assert err.count("\n") == 1 and f"{key}: eps must be finite and > 0" in err


def test_corrupt_safetensors_gives_one_line(capsys, tmp_path):
    _write(tmp_path / "config.json", json.dumps(cards.tiny_config("llama")))
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00")
    code, _, err = run_cli(capsys, "card", str(tmp_path))
    assert code == 2 and err.count("\n") == 1 and "truncated" in err


def _write(path, text):
    path.write_text(text)
    return path
