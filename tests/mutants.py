"""Mutation check: does the test suite see realistic one-line bugs?

Each mutant is one textual edit of one file and the tests that must catch it. For each, the
repository's tracked files are copied to a temporary folder, the edit is applied there (never
in the working tree) and those tests run; a mutant is caught when they fail.

    .venv/bin/python tests/mutants.py            # every mutant
    .venv/bin/python tests/mutants.py spike      # mutants whose name contains "spike"

Exit code 1 when a mutant survives. CI does not run this by default (it takes minutes).
"""

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name: (file, original text, mutated text, tests that must fail)
MUTANTS = {
    "spike threshold 7 -> 6 sigma": (
        "normtools/lab/train.py", "OLMO2_SPIKE_K = 1000, 7.0", "OLMO2_SPIKE_K = 1000, 6.0",
        ["tests/lab/test_spike_threshold.py"]),
    "weight check relaxed to the last dimension": (
        "normtools/core/validate.py", "if param.shape != (n,):", "if param.shape[-1] != n:",
        ["tests/core/test_bad_inputs.py", "-k", "one_dimensional"]),
    "eps check back to > 0": (
        "normtools/core/validate.py", "if not SMALLEST_EPS <= eps < math.inf:", "if not 0 < eps < math.inf:",
        ["tests/core/test_bad_inputs.py", "-k", "eps"]),
    "shard_columns without its width check": (
        "normtools/core/tp.py", "    if x.shape[-1] != num_heads * head_dim:", "    if False:",
        ["tests/core/test_bad_inputs.py", "-k", "shard_columns"]),
    "patch copies the parameters again": (
        "normtools/cards/patching.py", "    new.weight = weight\n",
        "    new.weight = type(weight)(weight.detach().clone())\n",
        ["tests/cards/test_patching_keeps_state.py"]),
    # kernels (tests/core/test_kernel_hardening.py; the copy's kernels/ is what normtools._kernels
    # imports there, see link_package_dirs)
    "QK-Norm launcher swaps the casting conventions": (
        "normtools/core/qk.py", 'ROUND_XHAT=casting == "llama", num_warps',
        'ROUND_XHAT=casting == "gemma", num_warps',
        ["tests/core/test_kernel_hardening.py", "-k", "qk_norm_casting_in_ulps"]),
    "QK-Norm + RoPE launcher swaps the casting conventions": (
        "normtools/core/rope.py", 'ROUND_XHAT=casting == "llama",', 'ROUND_XHAT=casting == "gemma",',
        ["tests/core/test_kernel_hardening.py", "-k", "qk_norm_rope_casting_in_ulps"]),
    "k programs of QK-Norm use q's head count": (
        "kernels/qk_norm.py", "k_heads, stride_k, stride_ky,", "q_heads, stride_k, stride_ky,",
        ["tests/core/test_kernel_hardening.py", "-k", "several_programs_per_head_slot"]),
    "chunked RMSNorm mean of squares over N - 1": (
        "kernels/rms_norm.py", "tl.rsqrt(tl.sum(sum_sq, axis=1) / N + eps)",
        "tl.rsqrt(tl.sum(sum_sq, axis=1) / (N - 1) + eps)",
        ["tests/core/test_kernel_hardening.py", "-k", "error_within and rms_norm and chunked"]),
    "chunked LayerNorm variance over N - 1": (
        "kernels/layer_norm.py", "tl.rsqrt(m2 / N + eps)", "tl.rsqrt(m2 / (N - 1) + eps)",
        ["tests/core/test_kernel_hardening.py", "-k", "error_within and layer_norm and chunked"]),
    "chunked LayerNorm backward without its mean term": (
        "kernels/layer_norm.py", "(dy * w[None, :] - c1[:, None] - x_hat * c2[:, None])",
        "(dy * w[None, :] - x_hat * c2[:, None])",
        ["tests/core/test_kernel_hardening.py", "-k", "error_within and layer_norm and chunked"]),
    "chunked RMSNorm backward without its mean term": (
        "kernels/rms_norm.py", "(dy * s[None, :] - x_hat * c[:, None])", "(dy * s[None, :])",
        ["tests/core/test_kernel_hardening.py", "-k", "error_within and rms_norm and chunked"]),
}


def link_package_dirs(tmp):
    """Make the copy's own folders the packages that pyproject's package-dir maps elsewhere
    (normtools._kernels is kernels/): the editable install would import the working tree's,
    so a mutant of kernels/ would go untested."""
    package_dirs = tomllib.loads((Path(tmp) / "pyproject.toml").read_text())["tool"][
        "setuptools"]["package-dir"]
    for package, folder in package_dirs.items():
        link = Path(tmp, *package.split("."))
        if link != Path(tmp, folder) and not link.exists():
            link.symlink_to(Path(tmp, folder), target_is_directory=True)


def run(name, file, original, mutated, tests) -> bool:
    """True when ``tests`` fail on the mutant."""
    with tempfile.TemporaryDirectory(prefix="normtools-mutant-") as tmp:
        files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.splitlines()
        for f in files:
            if (ROOT / f).is_file():
                (Path(tmp) / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / f, Path(tmp) / f)
        link_package_dirs(tmp)
        target = Path(tmp) / file
        text = target.read_text()
        if text.count(original) != 1:
            raise SystemExit(f"{name}: {original!r} is not exactly once in {file}; update the mutant")
        target.write_text(text.replace(original, mutated))
        env = {**os.environ, "PYTHONPATH": tmp, "PYTHONHASHSEED": "0"}
        result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x",
                                 *tests], cwd=tmp, env=env, capture_output=True, text=True)
        return result.returncode != 0


def main(selection=()):
    survivors = []
    for name, (file, original, mutated, tests) in MUTANTS.items():
        if selection and not any(s in name for s in selection):
            continue
        caught = run(name, file, original, mutated, tests)
        print(f"{'caught' if caught else 'NOT CAUGHT'}: {name} ({file})", flush=True)
        survivors += [] if caught else [name]
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
