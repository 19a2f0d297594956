"""Writing servable checkpoints atomically (docs/design.md#checkpoints and #decisions).

A servable checkpoint is a Hugging Face directory (safetensors weights, ``config.json`` with a ``dllm`` section,
tokenizer with its chat template). Everything is written into ``<out>.tmp-<pid>`` first and renamed into place,
so a crash never leaves a half-written checkpoint under the final name. ``out`` must not exist or be empty.
"""
from __future__ import annotations

import glob
import json
import os
import re
import secrets
import shutil
import socket
from pathlib import Path

from .config import DllmConfig


WRITER_MARKER = ".unmask-writer"  # "<hostname> <pid>" inside every temporary directory this module creates


def unique_suffix() -> str:
    """``<pid>-<8 hex digits>``: the tail of every temporary name made for an atomic write. The pid alone collided
    in containers (pid 1 everywhere; two containers sharing a volume), and a writer deleted the other's staging
    directory as its own leftover."""
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def mark_temporary(directory: Path) -> None:
    """Claim ``directory`` (a staging/aside directory of this process) for :func:`remove_stale_temporaries`: only
    directories carrying this marker, written by a process of this host that is gone, are ever deleted."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / WRITER_MARKER).write_text(f"{socket.gethostname()} {os.getpid()}\n")


class CheckpointWriteError(RuntimeError):
    """The output path exists and is not empty, or the write failed (the partial temporary is removed)."""


def write_checkpoint(out: str | os.PathLike, model, tokenizer, dllm: DllmConfig, overwrite: bool = False,
                     extra_files: dict[str, bytes | str] | None = None) -> Path:
    """Save ``model`` + ``tokenizer`` with ``dllm`` merged into ``config.json``, atomically.

    Args:
        out: final directory. It must not exist (or be empty) unless ``overwrite``.
        model: a transformers ``PreTrainedModel`` (plain or bitsandbytes-quantized).
        tokenizer: its tokenizer (saved with the chat template).
        dllm: the diffusion settings, written as the ``dllm`` section.
        extra_files: more files to place in the directory (name -> content).

    Returns:
        the final path.

    Raises:
        CheckpointWriteError: ``out`` is a non-empty directory (and not ``overwrite``), or saving failed.
    """
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise CheckpointWriteError(f"{out}: exists and is not empty; choose a new directory")
    tmp = out.parent / f"{out.name}.tmp-{unique_suffix()}"
    remove_stale_temporaries(out)
    try:
        mark_temporary(tmp)
        model.config.dllm = dllm.to_dict()
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        cfg_path = tmp / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["dllm"] = dllm.to_dict()
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
        for name, content in (extra_files or {}).items():
            mode = "wb" if isinstance(content, bytes) else "w"
            with open(tmp / name, mode) as fh:
                fh.write(content)
        _fsync_tree(tmp)  # the marker stays until publish_directory: a kill while flushing leaves a claimed tmp
        publish_directory(tmp, out)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, CheckpointWriteError):
            raise
        raise CheckpointWriteError(f"{out}: write failed ({exc})") from exc
    return out


def publish_directory(ready: Path, out: Path) -> Path:
    """Move the complete directory ``ready`` to ``out`` (same filesystem), replacing ``out`` if it exists.

    ``out`` is at every moment either absent, the old directory, or the new one: the old one is first renamed to
    ``<out>.old-<pid>`` and deleted only after the new one is in place (a kill in between leaves it for
    :func:`remove_stale_temporaries`). A :data:`WRITER_MARKER` in ``ready`` is removed before it is published.
    """
    (ready / WRITER_MARKER).unlink(missing_ok=True)
    if out.exists():
        old = out.parent / f"{out.name}.old-{unique_suffix()}"
        os.replace(out, old)
        mark_temporary(old)
        os.replace(ready, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(ready, out)
    return out


def remove_stale_temporaries(out: Path) -> None:
    """Delete ``<out>.tmp-<pid>-<hex>`` / ``<out>.old-<pid>-<hex>`` / ``<out>.verify-<pid>-<hex>`` left by a writer that was killed,
    and nested ones such as an export's ``<out>.verify-<pid>.tmp-<pid>`` (one pid throughout).

    Only directories that carry this module's :data:`WRITER_MARKER` naming this host and a pid that no longer
    runs are deleted: a user's own ``<out>.old-2024`` directory, or the staging directory of a writer in another
    container sharing the volume, is never touched.
    """
    if not out.parent.is_dir():
        return
    host = socket.gethostname()
    name = re.compile(re.escape(out.name) + r"((?:\.(?:tmp|old|verify)-\d+(?:-[0-9a-f]{8})?)+)")
    for p in out.parent.glob(f"{glob.escape(out.name)}.*-*"):
        m = name.fullmatch(p.name)
        pids = set(re.findall(r"\.(?:tmp|old|verify)-(\d+)", m.group(1))) if m else set()
        if len(pids) != 1:
            continue
        pid = pids.pop()
        if int(pid) == os.getpid():
            continue
        try:
            marker_host, marker_pid = (p / WRITER_MARKER).read_text().split()
        except (OSError, ValueError):
            continue  # not ours (or not a directory)
        if marker_host != host or marker_pid != pid:
            continue
        try:
            os.kill(int(pid), 0)
            continue  # still running: another writer
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except (PermissionError, OverflowError):
            continue


def _fsync_tree(root: Path) -> None:
    """Flush every file to disk and give it the umask's permissions (safetensors writes 0600, which another user -
    e.g. a server in a container - could not read)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in root.rglob("*"):
        if path.is_file():
            os.chmod(path, 0o666 & ~umask)
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
        elif path.is_dir():
            os.chmod(path, 0o777 & ~umask)
    os.chmod(root, 0o777 & ~umask)
