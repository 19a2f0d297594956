"""Mask-row adapter checkpoints on disk: adapter-only and self-contained (docs/design.md#mask-row-adapter).

Two files describe an adapter, in one directory:

* ``mask_adapter.json`` (not ``adapter_config.json``: transformers would read that as a peft adapter): ``{"format": "unmask-mask-adapter", "version": 1, "rank", "alpha", "targets",
  "mask_token_id", "parent": {"sha256": CONTENT_HASH, "name": HINT, "gguf_sha256"?: ...}, "dllm": {overrides of
  the parent's dllm section: block_size, diffusion_block_size, default_sampling}, "training"?: {...}}``;
* ``mask_adapter.safetensors``: ``layers.<i>.<target>.lora_A`` ``[r, in]``, ``.lora_B`` ``[out, r]`` float32 (or
  float16) and ``mask_embedding`` ``[H]``.

An **adapter-only** checkpoint is just that directory; its parent (an a2d checkpoint directory, for example the
conversion of a GGUF file) is named by a content hash (:func:`parent_hash`) and found through ``parent=`` or the
``parent.name`` hint (relative to the adapter directory or absolute). A **self-contained** checkpoint is the
parent's own directory (``config.json``, weights, tokenizer) with the two adapter files side by side. Loading
refuses a parent whose hash differs, in one line. Merging the delta into the weights would change the causal rows
too: a merged model is a different, full-weight model and is not written here.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from .config import CheckpointError, DllmConfig, read_json_file
from .mask_adapter import DEFAULT_TARGETS, AdapterWeights
from .checkpoint import unique_suffix

ADAPTER_CONFIG = "mask_adapter.json"
ADAPTER_WEIGHTS = "mask_adapter.safetensors"
FORMAT = "unmask-mask-adapter"
#: dllm fields an adapter may override on its parent
OVERRIDABLE = ("block_size", "diffusion_block_size", "default_sampling")


def is_adapter_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds an adapter (``mask_adapter.json`` naming the mask-adapter format)."""
    cfg = Path(path) / ADAPTER_CONFIG
    if not cfg.is_file():
        return False
    data = read_json_file(cfg)
    return isinstance(data, dict) and data.get("format") == FORMAT


HASH_CACHE = ".unmask-content-hash.json"


def parent_hash(path: str | os.PathLike) -> str:
    """Content hash of a checkpoint's weights: sha256 over every safetensors tensor, sorted by name, of
    ``name | dtype | shape | raw bytes`` (so re-saving the same tensors keeps it; config and tokenizer do not
    count). ``sha256:<hex>``. The result is cached in ``<path>/.unmask-content-hash.json`` keyed by the weight
    files' names, sizes and modification times (when the directory is writable): hashing 0.5 GB takes seconds.

    A cache file that cannot be read (bad JSON, another shape) is ignored and rewritten: it is only a cache.

    Raises:
        CheckpointError: no ``*.safetensors`` files in ``path``, or one that is not a whole safetensors file (names
            it: truncated, not safetensors; ``checkpoint_check.safetensors_header``).
    """
    from safetensors import safe_open

    from .checkpoint_check import safetensors_header

    path = Path(path)
    files = [f for f in sorted(path.glob("*.safetensors")) if f.name != ADAPTER_WEIGHTS]
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weights to hash (the adapter's parent must be a "
                              f"safetensors checkpoint directory)")
    try:
        key = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    except OSError as exc:  # a dangling link in place of a weight file
        raise CheckpointError(f"{exc.filename}: cannot be read ({exc.strerror})") from None
    try:
        cached = read_json_file(path / HASH_CACHE) if (path / HASH_CACHE).is_file() else None
    except CheckpointError:  # a damaged cache: hash again and rewrite it
        cached = None
    if isinstance(cached, dict) and cached.get("files") == key and str(cached.get("sha256", "")).startswith("sha256:"):
        return cached["sha256"]
    for f in files:  # a damaged weight file is a one-line error naming it, not the reader's exception
        safetensors_header(f)
    handles = [safe_open(str(f), framework="pt") for f in files]
    where = {name: h for h in handles for name in h.keys()}
    h = hashlib.sha256()
    for name in sorted(where):
        t = where[name].get_tensor(name)
        h.update(f"{name}|{str(t.dtype).replace('torch.', '')}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(memoryview(t.contiguous().view(torch.uint8).numpy()))
    digest = "sha256:" + h.hexdigest()
    try:
        tmp = path / f"{HASH_CACHE}.tmp-{unique_suffix()}"
        tmp.write_text(json.dumps({"files": key, "sha256": digest}) + "\n", encoding="utf-8")
        os.replace(tmp, path / HASH_CACHE)
    except OSError:  # a read-only parent: hash again next time
        pass
    return digest


def file_sha256(path: str | os.PathLike) -> str:
    """``sha256:<hex>`` of a file's bytes (a GGUF parent's provenance)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def write_adapter(out: str | os.PathLike, weights: AdapterWeights, parent: dict, dllm: dict | None = None,
                  training: dict | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``mask_adapter.json`` + ``mask_adapter.safetensors`` into ``out`` (created; existing adapter files are
    replaced atomically, file by file, with ``os.replace``). ``parent``: at least ``sha256`` (and a ``name``
    hint). ``dtype``: float32 or float16 for the stored tensors. Returns ``out``.

    Raises:
        ValueError: ``parent`` has no ``sha256``, or a ``dllm`` key is not overridable (names it).
    """
    from safetensors.torch import save_file

    if not isinstance(parent, dict) or not str(parent.get("sha256", "")).startswith("sha256:"):
        raise ValueError("parent: needs a 'sha256' content hash (engine.adapter_files.parent_hash)")
    bad = sorted(set(dllm or {}) - set(OVERRIDABLE))
    if bad:
        raise ValueError(f"dllm: {bad} cannot be overridden by an adapter (only {', '.join(OVERRIDABLE)})")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"format": FORMAT, "version": 1, "rank": weights.rank, "alpha": weights.alpha,
           "targets": list(weights.targets), "mask_token_id": weights.mask_token_id, "parent": parent,
           "dllm": dict(dllm or {}), "n_parameters": weights.n_parameters()}
    if training:
        cfg["training"] = training
    tensors = {k: v.to(dtype) for k, v in weights.state_dict().items()}
    tmp_w = out / f".{ADAPTER_WEIGHTS}.tmp-{unique_suffix()}"
    save_file(tensors, str(tmp_w), metadata={"format": FORMAT})
    os.replace(tmp_w, out / ADAPTER_WEIGHTS)
    tmp_c = out / f".{ADAPTER_CONFIG}.tmp-{unique_suffix()}"
    tmp_c.write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp_c, out / ADAPTER_CONFIG)
    return out


def read_adapter(path: str | os.PathLike, projections: dict[tuple[int, str], tuple[int, int]] | None = None,
                 hidden: int | None = None, max_magnitude: float | None = None) -> tuple[AdapterWeights, dict]:
    """``(weights, config dict)`` of the adapter in ``path``, checked (:mod:`unmask.engine.adapter_check`): the
    config's fields, then the weights' header (exactly the tensors of every layer and target, shapes, float
    dtypes), then their values (finite). ``projections`` (``{(layer, target): (out, in)}``,
    :func:`unmask.engine.mask_adapter.projection_shapes`) and ``hidden`` (the embedding width) are the model's
    the adapter goes on; None checks the adapter's own consistency only. ``max_magnitude``: the largest weight
    accepted (default :data:`unmask.engine.limits.MAX_WEIGHT_MAGNITUDE`; 0 = no bound).

    Raises:
        CheckpointError: (one line) a missing/invalid file, field or tensor, naming the file and field or tensor.
    """
    from safetensors.torch import load_file

    from .adapter_check import check_adapter_config, check_adapter_tensors, check_adapter_values

    path = Path(path)
    cfg_file = path / ADAPTER_CONFIG
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such adapter directory")
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file}: missing (not a mask-adapter directory)")
    cfg = read_json_file(cfg_file)
    check_adapter_config(cfg_file, cfg, FORMAT, DEFAULT_TARGETS)
    wfile = path / ADAPTER_WEIGHTS
    if not wfile.is_file():
        raise CheckpointError(f"{wfile}: missing (the adapter's weights)")
    check_adapter_tensors(wfile, cfg["rank"], cfg["targets"], projections, hidden)
    try:
        tensors = load_file(str(wfile))
    except Exception as exc:  # safetensors raises its own error types
        raise CheckpointError(f"{wfile}: unreadable ({exc})") from exc
    check_adapter_values(wfile, tensors, max_magnitude)
    w = AdapterWeights(rank=cfg["rank"], alpha=float(cfg["alpha"]), targets=tuple(cfg["targets"]),
                       mask_token_id=cfg["mask_token_id"])
    w.stored_dtype = "float16" if any(t.dtype == torch.float16 for t in tensors.values()) else "float32"
    if "mask_embedding" in tensors:
        w.mask_embedding = tensors.pop("mask_embedding").float()
    for key in sorted(tensors):  # the names are checked: layers.<i>.<target>.lora_A|lora_B
        _, i, target, kind = key.split(".")
        a, b = w.layers.get((int(i), target), (None, None))
        w.layers[(int(i), target)] = (tensors[key].float(), b) if kind == "lora_A" else (a, tensors[key].float())
    return w, cfg


def resolve_adapter(path: Path, adapter: str | os.PathLike | None = None,
                    parent: str | os.PathLike | None = None) -> tuple[Path, Path | None]:
    """``(the checkpoint directory to load, the adapter directory or None)`` for ``load_model``.

    ``path`` is a self-contained checkpoint (``config.json`` and the adapter files), an adapter-only directory
    (its parent from ``parent`` or the config's ``parent.name`` hint), or a plain checkpoint (``adapter`` names an
    adapter directory to put on it, or None).

    Raises:
        CheckpointError: an adapter-only directory whose parent cannot be found (names ``parent``).
    """
    if adapter is not None:
        return path, Path(adapter).expanduser()
    if not is_adapter_dir(path):
        return path, None
    if (path / "config.json").is_file():
        return path, path  # self-contained
    if parent is None:
        _, cfg = _peek(path)
        hint = str(cfg["parent"].get("name") or "")
        cand = Path(hint).expanduser()
        if hint and not cand.is_absolute():
            cand = path / cand
        if not hint or not (cand / "config.json").is_file():
            raise CheckpointError(f"{path / ADAPTER_CONFIG}: parent: {hint or '(no name)'} is not a checkpoint "
                                  f"directory; pass the parent (parent=DIR, --parent DIR)")
        parent = cand
    return Path(parent).expanduser(), path


def _peek(path: Path) -> tuple[None, dict]:
    cfg = read_json_file(path / ADAPTER_CONFIG)
    if not isinstance(cfg, dict) or not isinstance(cfg.get("parent"), dict):
        raise CheckpointError(f"{path / ADAPTER_CONFIG}: field 'parent' missing or not an object")
    return None, cfg


#: ``config.json`` key where ``unmask export`` records a (quantized) export's provenance (:func:`record_export`)
EXPORT_RECORD = "unmask_export"


def record_export(out: str | os.PathLike, source: str | os.PathLike, quantization: str) -> dict:
    """Record in ``<out>/config.json`` that ``out`` is ``unmask export --quantization Q`` of ``source``:
    ``"unmask_export": {"quantization", "source_sha256": parent_hash(source), "sha256": parent_hash(out)}``
    (both content hashes; docs/design.md#mask-row-adapter). An adapter trained on ``source`` is then accepted over
    ``out`` (:func:`parent_relation`) while ``out``'s tensors are still those the record names. Returns the record.

    Raises:
        CheckpointError: ``out`` or ``source`` has no safetensors weights, or ``out`` has no ``config.json``.
    """
    out = Path(out)
    rec = {"quantization": str(quantization), "source_sha256": parent_hash(source), "sha256": parent_hash(out)}
    cfg_file = out / "config.json"
    cfg = read_json_file(cfg_file)
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_file}: missing or not a JSON object")
    cfg[EXPORT_RECORD] = rec
    tmp = out / f".config.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, cfg_file)
    return rec


def parent_relation(parent_dir: str | os.PathLike, want: str, adapter_cfg: Path) -> dict:
    """How the checkpoint in ``parent_dir`` relates to the parent hash ``want`` an adapter names
    (docs/design.md#mask-row-adapter): ``{"parent_sha256": want, "relation": "same"}`` when its content hash is
    ``want``; ``{..., "relation": "quantized export", "quantization": Q, "loaded_sha256": HASH}`` when its
    ``config.json`` records (:func:`record_export`) that it is an export of the parent ``want`` and its tensors still
    hash to the recorded ``sha256``.

    Raises:
        CheckpointError: (one line naming both hashes) any other parent: another model, an export of another
            parent, or an export whose weights changed after it was recorded.
    """
    parent_dir = Path(parent_dir)
    got = parent_hash(parent_dir)
    if got == want:
        return {"parent_sha256": want, "relation": "same"}
    cfg = read_json_file(parent_dir / "config.json")
    rec = cfg.get(EXPORT_RECORD) if isinstance(cfg, dict) else None
    if isinstance(rec, dict) and rec.get("source_sha256") == want:
        if rec.get("sha256") != got:
            raise CheckpointError(f"{parent_dir / 'config.json'}: {EXPORT_RECORD}.sha256 {rec.get('sha256')} is "
                                  f"not the weights' hash {got}: the weights changed after the export; re-export "
                                  f"the parent {want}")
        return {"parent_sha256": want, "relation": "quantized export",
                "quantization": str(rec.get("quantization")), "loaded_sha256": got}
    src = f" (an export of {rec.get('source_sha256')})" if isinstance(rec, dict) else ""
    raise CheckpointError(f"{adapter_cfg}: parent hash {want} differs from {parent_dir}'s {got}{src}: this "
                          f"adapter was trained on another parent")


def apply_adapter(loaded, adapter_dir: Path | None, check_parent: bool = True,
                  max_magnitude: float | None = None) -> None:
    """Read the adapter in ``adapter_dir`` (None: nothing), check the parent (:func:`parent_relation`: its content
    hash, or a recorded quantized export of that parent), apply its ``dllm`` overrides and attach it
    (:func:`unmask.engine.mask_adapter.attach_mask_adapter`) over whatever ``loaded``'s linear layers are (native,
    bitsandbytes nf4/int8, fp16-packed, int8/int4 low-bit): the adapter's A/B keep their stored values.

    Raises:
        CheckpointError: another parent (one line naming both hashes), a bad adapter file, or a bad override.
    """
    if adapter_dir is None:
        return
    from .mask_adapter import attach_mask_adapter

    from .mask_adapter import projection_shapes

    decoder = loaded.model.base_model  # the adapter is checked against its shapes before any module is wrapped
    try:
        emb = getattr(decoder.embed_tokens, "base", decoder.embed_tokens)
        shapes, hidden = projection_shapes(decoder), int(emb.weight.shape[-1])
    except (AttributeError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{adapter_dir}: mask adapter: {type(loaded.model).__name__} has no Llama-style "
                              f"decoder layers to adapt ({type(exc).__name__}: {exc})") from exc
    weights, cfg = read_adapter(adapter_dir, shapes, hidden, max_magnitude)
    from .checkpoint_check import check_mask_distinct

    check_mask_distinct(weights.mask_token_id, loaded.dllm, getattr(loaded.tokenizer, "bos_token_id", None),
                        f"{adapter_dir / ADAPTER_CONFIG}: field 'mask_token_id'")
    want = cfg["parent"].get("sha256")
    relation = parent_relation(loaded.path, want, adapter_dir / ADAPTER_CONFIG) if check_parent else {}
    overrides = cfg.get("dllm") or {}
    bad = sorted(set(overrides) - set(OVERRIDABLE))
    if bad:
        raise CheckpointError(f"{adapter_dir / ADAPTER_CONFIG}: dllm.{bad[0]} cannot be overridden by an adapter")
    if overrides:
        from .checkpoint_check import check_block_sizes

        merged = {**loaded.dllm.to_dict(), **overrides}
        loaded.dllm = DllmConfig.from_dict(merged, where=f"{adapter_dir / ADAPTER_CONFIG}:dllm")
        check_block_sizes(loaded.dllm, loaded.max_context, f"{adapter_dir / ADAPTER_CONFIG}:dllm")
    try:
        attach_mask_adapter(loaded, weights)
    except ValueError as exc:
        raise CheckpointError(f"{adapter_dir}: {exc}") from exc
    loaded.adapter = {"path": str(adapter_dir), "rank": weights.rank, "alpha": weights.alpha,
                      "targets": list(weights.targets), "n_parameters": weights.n_parameters(),
                      "parent_sha256": want, "weights": loaded.weight_format,
                      "tensor_dtype": weights.stored_dtype, **relation}


def write_self_contained(out: str | os.PathLike, parent_dir: str | os.PathLike, adapter_dir: str | os.PathLike
                         ) -> Path:
    """Copy the parent checkpoint (every file) and the adapter files into ``out`` (must not exist), via a
    temporary name renamed into place. Returns ``out``.

    Raises:
        CheckpointError: ``out`` exists, or the parent is not a checkpoint directory.
    """
    import shutil

    out, parent_dir, adapter_dir = Path(out), Path(parent_dir), Path(adapter_dir)
    if out.exists():
        raise CheckpointError(f"{out}: exists; choose a new directory")
    if not (parent_dir / "config.json").is_file():
        raise CheckpointError(f"{parent_dir}: not a checkpoint directory (no config.json)")
    tmp = out.parent / f"{out.name}.tmp-{unique_suffix()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(parent_dir, tmp, ignore=shutil.ignore_patterns("*.tmp-*", "training_state.pt"))
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        shutil.copy2(adapter_dir / name, tmp / name)
    cfg = json.loads((tmp / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    cfg["parent"] = {**cfg["parent"], "name": "."}
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out)
    return out
