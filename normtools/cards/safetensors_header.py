"""Read the header of a ``.safetensors`` file: tensor names, dtypes and shapes, never tensor data.

File layout (https://github.com/huggingface/safetensors):

    [8 bytes: N, unsigned little-endian]  [N bytes: UTF-8 JSON object]  [data bytes]

The JSON object maps each tensor name to ``{"dtype": str, "shape": [int, ...],
"data_offsets": [begin, end]}`` (offsets relative to the start of the data bytes); an optional
``"__metadata__"`` entry maps strings to strings. Nothing here unpickles or loads tensor data.
Every malformed header raises :class:`SafetensorsHeaderError` (a ``ValueError``) and nothing else.
"""

import json
import math
import os
import stat
import struct
from dataclasses import dataclass

_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the cap the safetensors library itself uses

# Bytes per element; the sub-byte float formats are packed, so only their offsets' order is checked.
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
    "C64": 8,
}
_PACKED_DTYPES = {"F4", "F6_E2M3", "F6_E3M2"}


class SafetensorsHeaderError(ValueError):
    """A safetensors header that is truncated, oversized, not a JSON object or inconsistent."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path) -> dict:
    """Return ``{name: TensorInfo}`` for the safetensors file at ``path`` (header bytes only)."""
    path = os.fspath(path)
    with open_regular_file(path) as f:
        return read_header_from(f, os.fstat(f.fileno()).st_size, name=path)


def open_regular_file(path):
    """``path`` opened for binary reading, if it is a regular file; ``OSError`` if it is not (a
    named pipe would block forever, a device never end). Opened without blocking, then checked."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path}: not a regular file (normtools reads no pipes, devices or sockets)")
    return os.fdopen(fd, "rb")


def read_header_from(f, file_size: int, name: str = "<stream>") -> dict:
    """Return ``{name: TensorInfo}`` from a binary file object holding ``file_size`` bytes."""
    prefix = f.read(8)
    if len(prefix) != 8:
        raise SafetensorsHeaderError(f"{name}: truncated: {len(prefix)} bytes, expected at least 8")
    (n,) = struct.unpack("<Q", prefix)
    if n > _MAX_HEADER_BYTES:
        raise SafetensorsHeaderError(f"{name}: header length {n} exceeds the {_MAX_HEADER_BYTES}-byte cap")
    if 8 + n > file_size:
        raise SafetensorsHeaderError(f"{name}: header length {n} runs past the end of the {file_size}-byte file")
    raw = f.read(n)
    if len(raw) != n:
        raise SafetensorsHeaderError(f"{name}: truncated header: {len(raw)} of {n} bytes")
    return _parse_header_json(raw, data_size=file_size - 8 - n, name=name)


def _parse_header_json(raw: bytes, data_size: int, name: str = "<stream>") -> dict:
    """Validate the JSON header ``raw`` against a data region of ``data_size`` bytes."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, too deep, a 5,000-digit integer
        raise SafetensorsHeaderError(f"{name}: header is not valid UTF-8 JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise SafetensorsHeaderError(f"{name}: header is a JSON {type(header).__name__}, not an object")
    tensors = {}
    for key, entry in header.items():
        if key == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise SafetensorsHeaderError(f"{name}: __metadata__ must map strings to strings")
            continue
        tensors[key] = _tensor_info(entry, data_size, f"{name}: tensor {key[:100]!r}")
    return tensors


MAX_DIMS = 64  # bounds a shape's element count below 2**(63·64): it prints, and compares fast


def _is_count(value) -> bool:
    """A non-negative integer that fits safetensors' unsigned 64-bit fields."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64


def _tensor_info(entry, data_size: int, where: str) -> TensorInfo:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise SafetensorsHeaderError(f"{where}: entry must be an object with exactly dtype, shape, data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or (dtype not in _DTYPE_BYTES and dtype not in _PACKED_DTYPES):
        raise SafetensorsHeaderError(f"{where}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_count(d) for d in shape):
        raise SafetensorsHeaderError(f"{where}: shape must be a list of at most {MAX_DIMS} integers in "
                                     f"[0, 2**64), got {str(shape)[:80]}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise SafetensorsHeaderError(f"{where}: data_offsets must be two integers in [0, 2**64), "
                                     f"got {str(offsets)[:80]}")
    begin, end = offsets
    if not begin <= end <= data_size:
        raise SafetensorsHeaderError(f"{where}: data_offsets {offsets} outside the {data_size}-byte data region")
    info = TensorInfo(dtype, tuple(shape))
    if dtype in _DTYPE_BYTES and end - begin != info.numel * _DTYPE_BYTES[dtype]:
        raise SafetensorsHeaderError(
            f"{where}: {end - begin} data bytes for shape {list(shape)} of {dtype} "
            f"(expected {info.numel * _DTYPE_BYTES[dtype]})"
        )
    return info
