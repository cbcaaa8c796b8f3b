"""Real text for the stability lab: the Python standard library's own sources, as bytes.

Nothing is downloaded and nothing is committed: the text is read at run time from the
``.py`` files that ship with the running Python (``sysconfig.get_paths()["stdlib"]``).
Tokenization is byte level (one token per byte, vocabulary 256), so ``decode(encode(s)) == s``.

The corpus is a fixed list of modules (:data:`STDLIB_MODULES`), read in that order and joined
with a separator, so it is deterministic for a given Python version. The last ``val_fraction``
of the bytes is the validation split.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB_SIZE = 256

#: Standard-library modules that make up the corpus (a mix of code and long docstrings;
#: every one exists as a single ``.py`` file in CPython 3.10 to 3.13).
STDLIB_MODULES = (
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "cmd", "codecs", "colorsys",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal",
    "difflib", "dis", "enum", "fnmatch", "fractions", "functools", "getopt", "gettext",
    "glob", "gzip", "heapq", "hmac", "inspect", "ipaddress", "keyword", "linecache",
    "locale", "numbers", "operator", "optparse", "pathlib", "pprint", "queue", "random",
    "reprlib", "sched", "secrets", "selectors", "shlex", "shutil", "signal", "statistics",
    "string", "struct", "textwrap", "threading", "timeit", "tokenize", "trace", "traceback",
    "types", "typing", "uuid", "warnings", "weakref", "zipfile",
)

_SEPARATOR = b"\n\n# ----\n\n"


def stdlib_files(modules: tuple[str, ...] = STDLIB_MODULES) -> list[Path]:
    """Paths of the named modules' sources in the running Python's standard library.

    A module that is a package in this Python (``pathlib`` became one in 3.13) contributes
    its ``__init__.py``; a module that is missing altogether is skipped.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for name in modules:
        for candidate in (root / f"{name}.py", root / name / "__init__.py"):
            if candidate.is_file():
                paths.append(candidate)
                break
    if not paths:
        raise FileNotFoundError(f"no standard-library sources found under {root}")
    return paths


def encode(text: str | bytes) -> torch.Tensor:
    """Byte-level tokens: UTF-8 bytes as int64 ids in 0..255."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def decode(ids: torch.Tensor) -> str:
    """Inverse of :func:`encode` (invalid UTF-8 sequences are replaced)."""
    return bytes(ids.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


@dataclass
class TextData:
    """Byte tokens of a text, split into train and validation parts."""

    train: torch.Tensor
    val: torch.Tensor
    vocab_size: int = VOCAB_SIZE

    def get_batch(
        self,
        split: str,
        batch_size: int,
        seq_len: int,
        generator: torch.Generator | None = None,
        device: str | torch.device = "cpu",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows ``x = ids[i : i+T]`` and next-token targets ``y = ids[i+1 : i+T+1]``.

        The start positions come from ``generator`` (a seeded ``torch.Generator`` gives a
        fixed data order). Returns two int64 tensors of shape (batch_size, seq_len).
        """
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
        ids = self.train if split == "train" else self.val
        if ids.numel() <= seq_len:
            raise ValueError(f"the {split} split has {ids.numel()} tokens, too few for seq_len={seq_len}")
        starts = torch.randint(ids.numel() - seq_len, (batch_size,), generator=generator)
        offsets = torch.arange(seq_len)
        x = ids[starts[:, None] + offsets]
        y = ids[starts[:, None] + offsets + 1]
        return x.to(device), y.to(device)


def load_stdlib_text(modules: tuple[str, ...] = STDLIB_MODULES, val_fraction: float = 0.1) -> TextData:
    """The corpus: the named standard-library sources, joined, as byte tokens (about 2 MB)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    raw = _SEPARATOR.join(path.read_bytes() for path in stdlib_files(modules))
    ids = encode(raw)
    n_train = int(ids.numel() * (1.0 - val_fraction))
    return TextData(train=ids[:n_train], val=ids[n_train:])
