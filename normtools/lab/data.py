"""Real text for the stability lab: a fixed public-domain corpus stored in the package, as bytes.

The corpus is ``normtools/lab/corpus/tinyshakespeare.txt`` (a subset of Shakespeare's plays,
1,115,394 bytes; source, licence and hash in ``corpus/SOURCE.md``). It ships with the package, so
every machine and every Python version trains on the same bytes; nothing is downloaded.
Tokenization is byte level (one token per byte, vocabulary 256), so ``decode(encode(s)) == s``.
The last ``val_fraction`` of the bytes is the validation split.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

_VOCAB_SIZE = 256

#: The corpus file, read at run time from the installed package.
CORPUS_PATH = Path(__file__).with_name("corpus") / "tinyshakespeare.txt"
#: sha256 of the corpus bytes; :func:`load_corpus` refuses a file that does not match.
CORPUS_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


def corpus_bytes(path: Path = CORPUS_PATH) -> bytes:
    """The corpus file's bytes, after checking them against :data:`CORPUS_SHA256`."""
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != CORPUS_SHA256:
        raise ValueError(f"{path} has sha256 {digest}, expected {CORPUS_SHA256}: the corpus was changed")
    return raw


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
    vocab_size: int = _VOCAB_SIZE

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


def load_corpus(val_fraction: float = 0.1) -> TextData:
    """The corpus as byte tokens: the first ``1 - val_fraction`` of the bytes train, the rest validate.

    With the default split: 1,003,854 training and 111,540 validation bytes.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    ids = encode(corpus_bytes())
    n_train = int(ids.numel() * (1.0 - val_fraction))
    return TextData(train=ids[:n_train], val=ids[n_train:])

