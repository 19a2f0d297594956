"""Reading a GGUF file (llama.cpp's format) with the ``gguf`` package: its metadata as Python values and its tensors
as float32 torch tensors in PyTorch's ``[out, in]`` order (docs/design.md#model-families, "GGUF files").

The file is memory-mapped by :class:`gguf.GGUFReader`; a tensor is dequantized (``gguf.quants.dequantize``: F32,
F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q2_K..Q6_K among others) only when asked for, so a caller
holds one float32 copy at a time. What the file's bytes cannot give (a truncated file, a bad magic, a tensor whose data
runs past the end, a type ``gguf`` cannot dequantize) is a one-line :class:`CheckpointError` naming the file.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .config import CheckpointError

GGUF_MAGIC = b"GGUF"


def is_gguf_file(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts with GGUF's magic (a ``.gguf`` name alone is not enough)."""
    p = Path(path)
    if not p.is_file():
        return False
    try:
        with p.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


class GGUFFile:
    """One opened GGUF file: ``metadata`` (key -> int | float | bool | str | list), ``tensor_names`` (in file order),
    ``tensor_type(name)`` (the GGML type's name, ``"Q4_K"``), ``tensor(name)`` (float32 ``[out, in]``).

    Raises:
        CheckpointError: (one line, naming the file) not a GGUF file, or one the reader cannot parse (truncated,
            corrupt header, tensor data past the end of the file).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such file")
        if not is_gguf_file(self.path):
            raise CheckpointError(f"{self.path}: not a GGUF file (it does not start with the bytes 'GGUF')")
        try:
            from gguf import GGUFReader
        except ImportError as exc:  # pragma: no cover - gguf is a runtime dependency
            raise CheckpointError(f"{self.path}: reading GGUF needs the `gguf` package (pip install gguf)") from exc
        try:
            reader = GGUFReader(str(self.path), "r")
            self.metadata = {name: _field_value(field) for name, field in reader.fields.items()
                             if not name.startswith("GGUF.")}
            self._tensors = {t.name: t for t in reader.tensors}
        except CheckpointError:
            raise
        except Exception as exc:  # the reader's own errors: ValueError (reshape past the end), IndexError, ...
            raise CheckpointError(f"{self.path}: corrupt or truncated GGUF file ({type(exc).__name__}: "
                                  f"{' '.join(str(exc).split())[:200]})") from exc
        self._reader = reader
        self.tensor_names = list(self._tensors)

    def tensor_type(self, name: str) -> str:
        """The GGML type of tensor ``name`` (``F16``, ``Q8_0``, ``Q4_K``, ...)."""
        return self._tensors[name].tensor_type.name

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Tensor ``name``'s shape in PyTorch order (GGML lists the innermost dimension first)."""
        return tuple(int(d) for d in reversed(self._tensors[name].shape.tolist()))

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` dequantized to float32, shape :meth:`tensor_shape`.

        Raises:
            CheckpointError: a type the ``gguf`` package cannot dequantize, or data that does not fit the shape.
        """
        import numpy as np
        from gguf.quants import dequantize

        t = self._tensors[name]
        try:
            values = dequantize(t.data, t.tensor_type)
            values = np.array(values, dtype=np.float32, copy=values.base is not None or not values.flags.writeable)
            out = torch.from_numpy(values).reshape(self.tensor_shape(name))  # owns its memory: the map may close
        except Exception as exc:  # NotImplementedError for a type without a dequantizer, ValueError on a bad shape
            raise CheckpointError(f"{self.path}: tensor {name} ({t.tensor_type.name}) cannot be read "
                                  f"({type(exc).__name__}: {' '.join(str(exc).split())[:160]})") from exc
        return out

    def get(self, key: str, default=None):
        """``metadata[key]`` or ``default``."""
        return self.metadata.get(key, default)


def _field_value(field):
    """A reader field as a Python value: strings decoded, arrays as lists, scalars as int/float/bool."""
    from gguf import GGUFValueType

    types = field.types
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        if len(types) > 1 and types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [_scalar(field.parts[i][0], types[-1]) for i in field.data]
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return _scalar(field.parts[field.data[0]][0], types[0])


def _scalar(value, value_type):
    from gguf import GGUFValueType

    if value_type == GGUFValueType.BOOL:
        return bool(value)
    if value_type in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        return float(value)
    return int(value)
