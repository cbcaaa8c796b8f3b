"""Issue 34: the command line has one error path. Every subcommand, given bad arguments or
hostile input, ends in exactly one line on stderr and exit code 2, never a traceback; output
degrades to ASCII where the terminal's encoding cannot hold it; a committed study is never
replaced by a smaller or empty one."""

import json
import os
import subprocess
import sys

import pytest

from normtools.cli import main
from normtools.core.command_line import MAX_ERROR_CHARS
from normtools.lab import studies

ENV = {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    files = {"missing": d / "missing.json", "malformed": d / "malformed.json", "list": d / "list.json",
             "empty_object": d / "empty.json", "deep": d / "deep.json"}
    files["malformed"].write_text("{not json")
    files["list"].write_text("[1, 2]")
    files["empty_object"].write_text("{}")
    files["deep"].write_text("[" * 100_000 + "]" * 100_000)
    return {k: str(v) for k, v in files.items()}


BAD_ARGUMENTS = [
    [], ["frob"], ["--bogus"],
    ["card"], ["card", "no-such-model"], ["card", "{bad[malformed]}"], ["card", "{bad[list]}"],
    ["card", "{bad[deep]}"], ["card", "qwen3-8b", "--bogus"],
    ["diff", "llama-3-8b"], ["diff", "llama-3-8b", "{bad[empty_object]}"],
    ["atlas", "--compare", "{bad[malformed]}"], ["atlas", "--compare", "{bad[missing]}"],
    ["atlas", "--compare", "{bad[list]}"], ["atlas", "--atlas", "{bad[empty_object]}"],
    ["atlas", "--atlas", "{bad[deep]}"],
    ["bench", "--report", "{bad[missing]}"], ["bench", "--report", "{bad[malformed]}"],
    ["bench", "--report", "{bad[list]}"], ["bench", "--report", "{bad[empty_object]}"],
    ["bench", "--report", "{bad[deep]}"],
    ["bench", "--device", "bogus", "--dry-run"], ["bench", "--threads", "0", "--dry-run"],
    ["bench", "--processes", "-1", "--dry-run"], ["bench", "--ops", "nope"],
    ["lab"], ["lab", "run"], ["lab", "run", "nope"], ["lab", "list", "--bogus"],
    ["lab", "run", "placements", "--threads", "0"], ["lab", "run", "placements", "--seeds", "-1"],
    ["lab", "run", "placements", "--seeds", "0"], ["lab", "run", "placements", "--device", "bogus"],
]


@pytest.mark.parametrize("argv", BAD_ARGUMENTS, ids=" ".join)
def test_every_subcommand_with_bad_arguments_ends_in_one_line_and_exit_code_2(argv, bad_files, capsys):
    code = main([a.format(bad=bad_files) for a in argv])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("normtools") and ": error: " in err
    assert len(err) <= MAX_ERROR_CHARS + 40 and "Traceback" not in err


def test_bench_module_entry_point_has_the_same_error_path():
    result = subprocess.run([sys.executable, "-m", "normtools.measure.bench", "--device", "bogus"],
                            capture_output=True, text=True, timeout=120, env=ENV)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith("python -m normtools.measure.bench: error: ")


def test_a_card_written_to_a_cp1252_pipe_degrades_to_ascii(tmp_path):
    """How Windows writes redirected output: the card's x̂ used to crash the encoder."""
    result = subprocess.run([sys.executable, "-m", "normtools", "card", "gpt-oss-20b"],
                            capture_output=True, timeout=120, env={**ENV, "PYTHONIOENCODING": "cp1252"})
    assert result.returncode == 0, result.stderr.decode("cp1252", "replace")
    text = result.stdout.decode("cp1252")
    assert "x_hat" in text and "\u0302" not in text


def test_lab_run_with_bad_seeds_leaves_the_study_file_untouched(tmp_path, capsys):
    out = tmp_path / "placements.json"
    out.write_text('{"runs": [1, 2, 3]}')
    for seeds in ("-1", "0"):
        assert main(["lab", "run", "placements", "--seeds", seeds, "--out", str(out)]) == 2
    assert out.read_text() == '{"runs": [1, 2, 3]}'


def _document(runs):
    return {"study": "placements", "runs": [{"seed": s} for s in range(runs)]}


def test_a_study_is_never_replaced_by_a_smaller_or_empty_one_without_force(tmp_path):
    path = tmp_path / "placements.json"
    studies._write_study(_document(4), path)
    for smaller in (_document(2), _document(0)):
        with pytest.raises(ValueError, match="runs"):
            studies._write_study(smaller, path)
        assert len(json.loads(path.read_text())["runs"]) == 4
    studies._write_study(_document(2), path, force=True)
    assert len(json.loads(path.read_text())["runs"]) == 2
    with pytest.raises(ValueError, match="no runs"):
        studies._write_study(_document(0), path, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["placements.json"]  # no temporary left


def test_a_study_is_written_atomically(tmp_path, monkeypatch):
    """A write that fails half-way leaves the old file whole (temporary file, then rename)."""
    path = tmp_path / "placements.json"
    studies._write_study(_document(2), path)
    before = path.read_text()

    def fail(self, *args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(type(path), "write_text", fail)
    with pytest.raises(OSError):
        studies._write_study(_document(3), path)
    monkeypatch.undo()
    assert path.read_text() == before
